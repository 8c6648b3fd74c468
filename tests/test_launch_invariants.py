"""What must hold of every kernel launch of both Triton plugins, on every platform they configure.

Each step below is run through the indexer and the attention with a plugin's
own launch configuration (sized for a 132-multiprocessor GPU, on its own
platform and on the other vendor's, and the interpreter's), with the launches
recorded and not made (``fast_launch.recording``): no kernel runs. Every
recorded launch must then

* bind: its arguments and constexprs name each parameter of the kernel once,
  constexprs only where the kernel declares them;
* fit the platform: a grid of 1-3 positive sizes within the GPU's limits;
  ``num_warps`` a power of two within a 1024-thread program; launch options
  the platform takes (none but warps and stages under the interpreter, AMD's
  only on AMD); programmatic dependent launch only where NVIDIA's Triton
  compiles it, and a kernel that waits on its predecessor (``PDL``) launched
  as a dependent, and only such a kernel;
* compute its dots as the kernels promise: ``ieee`` precision for fp32 dots
  (tf32 would round the scores to the selection's own tolerance);
* tile in powers of two: every constexpr a kernel spans with ``tl.arange``;
* cover its work: each kernel's grid and splits take every request, token,
  KV head, block and top-k slot, none twice and no program without work, with
  its tile and head sizes consistent with the step (the kernel-specific
  checks below); a merge follows exactly the launches that leave partials;
* not depend on lengths or positions when it is a decode launch (CUDA graphs
  replay it with new ones).

The tile sizes, warps and rules themselves are free to change: this fails
when a launch breaks one of these, not on an intended change. Each check is
shown to fail on a launch that breaks it (``MUTATIONS``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")

from mm3.contract import BatchMetadata, SparseAttentionParams, TopkBuffer  # noqa: E402
from mm3.testing.factories import Case, make_case  # noqa: E402
from mm3_backends.cuda import plugin as cuda_plugin  # noqa: E402
from mm3_backends.rocm import plugin as rocm_plugin  # noqa: E402
from mm3_backends.triton import attention, contents, index_scores, indexer, plugin_factory, tl_utils  # noqa: E402
from mm3_backends.triton.addressing import block_columns  # noqa: E402
from mm3_backends.triton.fast_launch import Launch, recording  # noqa: E402
from mm3_backends.triton.launch import LaunchConfig, override  # noqa: E402

MAX_THREADS = 1024
#: grid limits of both vendors' GPUs: x up to 2^31 - 1, y and z up to 65535
GRID_MAX = (2**31 - 1, 65535, 65535)
OPTIONS = {"num_warps", "num_stages", "launch_pdl", "waves_per_eu"}


def _params(h: int, g: int, d: int, di: int, block: int, topk: int, index_heads: int = 0) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=h * g, num_kv_heads=h, head_dim=d, num_index_heads=index_heads or h,
                                 index_head_dim=di, block_size=block, topk=topk)


#: name -> (params, make_case arguments); between them: one and many decodes (TP1 and TP8 heads, the
#: latter streamed on the cuda plugin), speculative decode, mixed steps, fp8 index, fp8 K/V scaled per head
#: and per slot, a prefill whose index tiles are split, a GQA group of 3
STEPS: dict[str, tuple[SparseAttentionParams, dict]] = {
    "decode1": (_params(4, 16, 128, 128, 64, 16), dict(decodes=[3000])),
    "decode64_tp8_fp8": (_params(1, 16, 128, 128, 64, 16), dict(decodes=[700] * 64, index_dtype="float8_e4m3fn")),
    "spec3_mixed": (_params(1, 8, 64, 64, 16, 8), dict(decodes=[300, 90], prefills=[(40, 400), (3, 3)],
                                                       decode_query_len=3, dtype="float16", index_dtype="float16")),
    "decode64_fp8kv": (_params(4, 16, 128, 128, 64, 16), dict(decodes=[700] * 64, index_dtype="float8_e4m3fn",
                                                              kv_dtype="float8_e4m3fn")),
    "prefill_fp8kv_slot": (_params(2, 4, 32, 32, 32, 4), dict(prefills=[(50, 500)], kv_dtype="float8_e4m3fn",
                                                              kv_scale="slot")),
    "prefill_long_g3": (_params(2, 3, 32, 32, 16, 8), dict(decodes=[40], prefills=[(20, 4000)],
                                                           dtype="float32", index_dtype="float32")),
}


@dataclass(frozen=True)
class Platform:
    """Where a scenario's launches run: NVIDIA's or AMD's Triton, or the CPU interpreter."""

    name: str
    hip: Any           # torch.version.hip while recording
    interpreter: bool = False

    @property
    def warp_size(self) -> int:
        return 64 if self.hip else 32


#: scenario -> (plugin, platform): each plugin on its own GPU and on the other (the test-only overrides),
#: and under the interpreter
SCENARIOS = {"cuda": (cuda_plugin, Platform("nvidia", None)), "rocm": (rocm_plugin, Platform("amd", "6.2")),
             "rocm_on_nvidia": (rocm_plugin, Platform("nvidia", None)),
             "cuda_on_rocm": (cuda_plugin, Platform("amd", "6.2")),
             "cuda_interpreter": (cuda_plugin, Platform("cpu", None, True)),
             "rocm_interpreter": (rocm_plugin, Platform("cpu", None, True))}


class _Props:
    multi_processor_count = 132


@contextlib.contextmanager
def _on(platform: Platform) -> Iterator[None]:
    """The kernels' launchers as they decide on ``platform`` (they read the environment, whether the kernels
    were imported for the interpreter, and PyTorch's build)."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("TRITON_INTERPRET", "1" if platform.interpreter else "0")
        mp.setattr(tl_utils, "_INTERPRETING", platform.interpreter)
        mp.setattr(torch.version, "hip", platform.hip)
        mp.setattr(torch.cuda, "get_device_properties", lambda i: _Props())
        mp.setattr(plugin_factory, "_kernels_interpreted", lambda: platform.interpreter)
        yield
    finally:
        mp.undo()


@functools.lru_cache(maxsize=None)
def _case(name: str, seed: int = 0, **changes: Any) -> Case:
    params, kw = STEPS[name]
    return make_case(params, seed=seed, **{**kw, **changes})


def _config(scenario: str) -> LaunchConfig:
    plugin, platform = SCENARIOS[scenario]
    with _on(platform):
        return plugin.PLATFORM.launch_config(torch.device("cpu" if platform.interpreter else "cuda", 0))


@dataclass
class Step:
    """A step's launches and what they must cover."""

    case: Case
    cfg: LaunchConfig
    platform: Platform
    launches: list[Launch]


def record(scenario: str, case: Case, cfg: LaunchConfig | None = None) -> Step:
    """The launches of ``case``'s contents check, indexer, attention and block scores on ``scenario`` (``cfg``:
    instead of the plugin's)."""
    plugin, platform = SCENARIOS[scenario]
    cfg = cfg or _config(scenario)
    p, T = case.params, case.batch.num_tokens
    with _on(platform), recording() as launches:
        contents.check_contents(case.batch, case.caches.num_pages, torch.zeros(1, dtype=torch.int64), cfg)
        # one column more than the table: a chunk of columns partly past the scores
        scores = torch.empty(p.num_index_heads, T, case.batch.block_table.shape[1] + 1)
        index_scores.index_scores(case.index_q, case.caches, case.batch, p, scores, cfg)
        buf = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, plugin.PLATFORM.topk_layout, fill=0)
        indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, cfg)
        attention.attention_forward(case.q, case.caches, buf, case.batch, p, torch.empty_like(case.q), cfg)
    return Step(case, cfg, platform, list(launches))


# -- the checks --------------------------------------------------------------------------------------------------

def _named(launch: Launch) -> dict[str, Any]:
    """Every value of the launch by parameter name: its arguments, constexprs and options."""
    return {**dict(zip(launch.kernel.arg_names, launch.args)), **launch.constexprs, **launch.options}


def _pow2(n: Any) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def _signature(kernel: Any) -> tuple[tuple[str, bool, bool], ...]:
    """(name, declared constexpr, has a default) of each parameter of a kernel."""
    return tuple((p.name, "constexpr" in str(p.annotation), p.default is not p.empty)
                 for p in inspect.signature(kernel.fn).parameters.values())


@functools.lru_cache(maxsize=None)
def _block_sizes(fn: Any) -> frozenset[str]:
    """The parameters of a kernel or helper (its Python function) that size a block: ``tl.arange(0, X)``,
    a shape of ``tl.zeros`` / ``tl.full``, or such a parameter of a ``triton.jit`` helper it calls."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    sizes: set[str] = set()
    for n in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr == "arange" and len(n.args) == 2:
            sizes.add(ast.unparse(n.args[1]))
        elif isinstance(f, ast.Attribute) and f.attr in ("zeros", "full") and n.args and \
                isinstance(n.args[0], ast.List):
            sizes |= {ast.unparse(e) for e in n.args[0].elts}
        elif isinstance(f, ast.Name) and hasattr(fn.__globals__.get(f.id), "fn"):
            helper = fn.__globals__[f.id].fn
            names = list(inspect.signature(helper).parameters)
            inner = _block_sizes(helper)
            sizes |= {ast.unparse(a) for name, a in [*zip(names, n.args), *((k.arg, k.value) for k in n.keywords)]
                      if name in inner}
    return frozenset(sizes)


def check_binding(step: Step, launch: Launch) -> None:
    sig = _signature(launch.kernel)
    names = [n for n, _, _ in sig]
    assert len(launch.args) <= len(names), f"{len(launch.args)} arguments for {len(names)} parameters"
    positional = set(names[:len(launch.args)])
    twice = positional & set(launch.constexprs)
    assert not twice, f"given twice: {sorted(twice)}"
    unknown = set(launch.constexprs) - set(names)
    assert not unknown, f"constexprs that are no parameter: {sorted(unknown)}"
    for name, constexpr, default in sig:
        if name in launch.constexprs:
            assert constexpr, f"{name} is given as a constexpr but is a runtime parameter"
        elif name not in positional:
            assert default, f"parameter {name} is not given"
        else:
            assert not constexpr or not isinstance(_named(launch)[name], torch.Tensor), f"tensor for constexpr {name}"


def check_grid_and_options(step: Step, launch: Launch) -> None:
    grid, opts = launch.grid, launch.options
    assert 1 <= len(grid) <= 3 and all(isinstance(g, int) and 1 <= g <= m for g, m in zip(grid, GRID_MAX)), \
        f"grid {grid} is not 1-3 sizes within {GRID_MAX}"
    assert set(opts) <= OPTIONS, f"unknown launch options {sorted(set(opts) - OPTIONS)}"
    warps = opts.get("num_warps", 4)
    assert _pow2(warps) and warps * step.platform.warp_size <= MAX_THREADS, \
        f"num_warps={warps} is not a power of two within {MAX_THREADS} threads of {step.platform.warp_size}-wide warps"
    assert opts.get("num_stages", 1) >= 1, f"num_stages={opts['num_stages']}"
    if step.platform.interpreter:
        assert set(opts) <= {"num_warps", "num_stages"}, f"GPU launch options under the interpreter: {opts}"
    if "waves_per_eu" in opts:
        assert step.platform.name == "amd", "an AMD-only launch option on another platform"


def check_pdl(step: Step, launch: Launch) -> None:
    c, dependent = launch.constexprs, bool(launch.options.get("launch_pdl"))
    if step.platform.name != "nvidia":
        assert not (dependent or c.get("PDL") or c.get("TRIGGER")), "programmatic dependent launch off NVIDIA"
    if c.get("PDL"):
        assert dependent, "a kernel that waits on its predecessor (PDL) is not launched as a dependent"
    if dependent:
        assert c.get("PDL") or c.get("STREAM"), "launched as a dependent, but waits for nothing"


def check_dots(step: Step, launch: Launch) -> None:
    c = launch.constexprs
    if "DOT_DTYPE" in c:
        import triton.language as tl
        assert c["DOT_DTYPE"] in (tl.float16, tl.bfloat16, tl.float32), c["DOT_DTYPE"]
        assert (c["DOT_PREC"] == "ieee") == (c["DOT_DTYPE"] == tl.float32), \
            f"{c['DOT_DTYPE']} dots in {c['DOT_PREC']} precision"


def check_tiles(step: Step, launch: Launch) -> None:
    values = _named(launch)
    bad = {n: values[n] for n in _block_sizes(launch.kernel.fn) if n in values and not _pow2(values[n])}
    assert not bad, f"tl.arange spans of no power of two: {bad}"


def _cover(total: int, parts: int, per_part: int, what: str) -> None:
    assert parts * per_part >= total, f"{parts} x {per_part} do not cover {total} {what}"
    assert (parts - 1) * per_part < total, f"{parts} x {per_part}: a part without {what} (total {total})"


def _inner_tile(c: dict, block: int) -> None:
    assert c["B"] == block and c["BN"] >= 16 and block % c["BN"] == 0, f"inner tile BN={c['BN']} of block B={c['B']}"


def check_kernel(step: Step, launch: Launch) -> None:
    """The kernel's own coverage and sizes (kernels not named here get the checks above only)."""
    p, b = step.case.params, step.case.batch
    c, v, name = launch.constexprs, _named(launch), launch.name
    width = b.block_table.shape[1]
    # the bounds a kernel holds rows, requests and blocks to (a batch edited wrongly in place stays inside
    # the tensors: tests/test_kernel_bounds.py); on a valid batch no test of results would see a wrong one
    T, td, columns = b.num_tokens, b.num_decode_tokens, block_columns(b)
    if "W" in v:
        assert v["W"] == columns, f"{name}: W={v['W']}, the table has {columns} columns of blocks"
    if name in ("_decode_score_kernel", "_decode_topk_kernel"):
        assert v["T"] == td, f"{name}: T={v['T']}, the step has {td} decode tokens"
    elif name in ("_decode_attention_kernel", "_decode_attention_flat_kernel"):
        assert v["num_decodes"] == b.num_decodes
    elif name == "_prefill_index_kernel":
        assert (v["first_token"], v["T"]) == (td, T)
    elif name == "_prefill_attention_kernel":
        assert (v["tok_lo"], v["tok_hi"]) == (td, T)
    elif name == "_index_scores_kernel":
        decodes = b.num_decodes > 0 and v["first_request"] == 0
        assert (v["tok_lo"], v["tok_hi"]) == ((0, td) if decodes else (td, T))
    if name == "_decode_score_kernel":
        rows = b.decode_query_len * p.num_index_heads
        nd, splits = launch.grid[::-1] if c.get("STREAM") else launch.grid
        assert nd == b.num_decodes and (c["Q"], c["DI"]) == (b.decode_query_len, p.index_head_dim)
        _cover(width, splits, c["BPS"], "blocks of the table")
        _inner_tile(c, p.block_size)
        assert c["ROWS"] >= max(16, rows) and c["TK_ROWS"] == rows, f"ROWS={c['ROWS']} for {rows} rows"
        assert c["K"] == p.topk and c["K_PAD"] >= max(16, p.topk) and c["NB_PAD"] >= max(width, c["K_PAD"])
        assert c["R_TK"] == 1 or c["R_TK"] * c["NB_PAD"] <= 2048, "the last program's top-k holds too many keys"
        assert not c.get("STREAM") or c["TOPK_LAST"], "a streamed score kernel must select its top-k"
    elif name == "_decode_topk_kernel":
        assert launch.grid == (b.num_decodes, b.decode_query_len * p.num_index_heads)
        assert c["K"] == p.topk and c["K_PAD"] >= max(16, p.topk) and c["NB_PAD"] >= width
    elif name in ("_decode_attention_kernel", "_decode_attention_flat_kernel"):
        td, hkv = b.num_decode_tokens, p.num_kv_heads
        assert (c["D"], c["K"]) == (p.head_dim, p.topk) and c["G_PAD"] >= max(16, p.gqa_group)
        _inner_tile(c, p.block_size)
        _cover(p.topk, c["SPLITS"], c["KPS"], "top-k slots")
        if name == "_decode_attention_kernel":
            assert launch.grid == (td, hkv, c["SPLITS"]), f"grid {launch.grid} for ({td}, {hkv}, {c['SPLITS']})"
        else:
            assert v["num_items"] == td * hkv * c["SPLITS"] and c["S_PAD"] >= c["SPLITS"]
            _cover(v["num_items"], launch.grid[0], v["IPP"], "work items")
            assert not c.get("MERGE_LAST") or c["SPLITS"] > 1
    elif name in ("_merge_kernel", "_merge_row_kernel"):
        parent = next(x for x in reversed(step.launches[:step.launches.index(launch)])
                      if x.name.startswith("_decode_attention"))
        assert {k: c[k] for k in ("D", "G_PAD", "SPLITS")} == {k: parent.constexprs[k] for k in ("D", "G_PAD", "SPLITS")}
        want = (b.num_decode_tokens, p.num_kv_heads) + ((p.gqa_group,) if name == "_merge_row_kernel" else ())
        assert launch.grid == want and c["S_PAD"] >= c["SPLITS"]
    elif name == "_prefill_index_kernel":
        npf, tiles, splits = launch.grid
        assert npf == b.num_prefills and v["first_request"] == b.num_decodes and _pow2(splits) == (splits == c["SPLITS"])
        assert c["M"] * p.num_index_heads <= c["ROWS"] and c["CH"] >= c["K_PAD"] >= max(16, p.topk)
        _cover(b.max_prefill_query_len, tiles, c["M"], "tokens of the longest prefill")
        _inner_tile(c, p.block_size)
        assert c["KEY_ROW"] in (0, step.case.caches.index.stride(1))
    elif name == "_prefill_index_merge_kernel":
        _cover(b.num_prefill_tokens * p.num_index_heads, launch.grid[0], c["R"], "prefill rows")
    elif name == "_prefill_attention_kernel":
        _cover(b.max_prefill_query_len, launch.grid[1], c["M"], "tokens of the longest prefill")
        assert launch.grid[::2] == (b.num_prefills, p.num_kv_heads) and c["M"] * p.gqa_group <= c["ROWS"]
        _inner_tile(c, p.block_size)
    elif name == "_block_run_kernel":
        pac = step.cfg.prefill_attention
        assert launch.grid[0] <= max(1, step.cfg.target_programs // 2 * pac.programs_per_sm)
        assert c["ROWS"] >= p.gqa_group and c["M"] == c["ROWS"] // p.gqa_group and (c["B"], c["D"]) == (
            p.block_size, p.head_dim)
    elif name == "_merge_slots_kernel":
        assert launch.grid == (v["Tc"], p.num_kv_heads) and c["K"] == p.topk
    elif name == "_index_scores_kernel":   # the decodes' launch first, then the prefills'
        decodes = b.num_decodes > 0 and v["first_request"] == 0
        count, longest = (b.num_decodes, b.decode_query_len) if decodes else (b.num_prefills, b.max_prefill_query_len)
        assert launch.grid[0] == count and (decodes or v["first_request"] == b.num_decodes)
        _cover(longest, launch.grid[1], c["M"], "tokens of the longest query")
        _cover(v["N"], launch.grid[2], c["CH"], "score columns")
        assert c["M"] * p.num_index_heads <= c["ROWS"] and (c["INIT"], c["LOCAL"]) == (p.init_blocks, p.local_blocks)
        _inner_tile(c, p.block_size)


def check_step(step: Step) -> None:
    """Over the step's launches: a merge after exactly the launches that leave partials, and the prefill
    attention's passes over every prefill token once."""
    names = [x.name for x in step.launches]
    for i, x in enumerate(step.launches):
        nxt = names[i + 1] if i + 1 < len(names) else ""
        if x.name.startswith("_decode_attention"):
            leaves = x.constexprs["SPLITS"] > 1 and not x.constexprs.get("MERGE_LAST")
            assert leaves == nxt.startswith("_merge"), f"{x.name} (SPLITS={x.constexprs['SPLITS']}) then {nxt!r}"
        if x.name == "_decode_score_kernel":
            assert x.constexprs["TOPK_LAST"] != (nxt == "_decode_topk_kernel"), f"TOPK_LAST then {nxt!r}"
        if x.name == "_prefill_index_kernel":
            assert (x.constexprs["SPLITS"] > 1) == (nxt == "_prefill_index_merge_kernel"), f"SPLITS then {nxt!r}"
    passes = [_named(x) for x in step.launches if x.name == "_merge_slots_kernel"]
    if passes:
        b = step.case.batch
        starts = [b.num_decode_tokens] + [v["tok0"] + v["Tc"] for v in passes]
        assert [v["tok0"] for v in passes] == starts[:-1] and starts[-1] == b.num_tokens, \
            f"prefill passes {[(v['tok0'], v['Tc']) for v in passes]} do not cover tokens {b.num_decode_tokens}.."


LAUNCH_CHECKS: tuple[Callable[[Step, Launch], None], ...] = (check_binding, check_grid_and_options, check_pdl,
                                                             check_dots, check_tiles, check_kernel)


def violations(step: Step) -> list[str]:
    """Every check that fails on the step, as ``kernel: check: why``."""
    out = []
    for launch in step.launches:
        for check in LAUNCH_CHECKS:
            try:
                check(step, launch)
            except AssertionError as e:
                out.append(f"{launch.name}: {check.__name__}: {e}")
    try:
        check_step(step)
    except AssertionError as e:
        out.append(f"step: {e}")
    return out


def _decode_signature(step: Step) -> list[tuple]:
    """What a captured decode launch replays: kernel, grid, constexprs, options, every non-tensor argument,
    each tensor's shape, strides and dtype."""
    return [(x.name, x.grid, x.constexprs, x.options,
             [(a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in x.args])
            for x in step.launches]


# -- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_launch_keeps_the_invariants(scenario: str, step: str) -> None:
    recorded = record(scenario, _case(step))
    assert recorded.launches, "nothing was launched"
    assert violations(recorded) == []


def test_the_steps_reach_every_kernel_and_variant() -> None:
    """The steps above launch every kernel, each decode variant and both prefill paths somewhere."""
    seen: set[str] = set()
    for scenario in SCENARIOS:
        for step in STEPS:
            for x in record(scenario, _case(step)).launches:
                c = x.constexprs
                seen |= {x.name} | {f"{x.name}:{k}" for k in ("STREAM", "MERGE_LAST", "TOPK_LAST", "PDL",
                                                                "SLOT_SCALED", "KV_SCALED") if c.get(k)}
                seen |= {f"{x.name}:SPLITS" for _ in [0] if c.get("SPLITS", 1) > 1}
    import mm3_backends.triton as package
    modules = [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
    kernels = {n for m in modules for n, k in vars(m).items() if n.endswith("_kernel") and hasattr(k, "arg_names")}
    assert len(kernels) >= 12 and kernels <= seen, f"never launched: {sorted(kernels - seen)}"
    for variant in ("_decode_score_kernel:STREAM", "_decode_score_kernel:TOPK_LAST", "_decode_score_kernel:PDL",
                    "_decode_attention_flat_kernel:MERGE_LAST", "_decode_attention_flat_kernel:STREAM",
                    "_decode_attention_kernel:SPLITS", "_prefill_index_kernel:SPLITS",
                    "_block_run_kernel:SLOT_SCALED", "_decode_attention_flat_kernel:KV_SCALED"):
        assert variant in seen, f"no step reaches {variant}"


@pytest.mark.parametrize("scenario", ["cuda", "rocm"])
@pytest.mark.parametrize("step", ["decode1", "decode64_tp8_fp8"])
def test_decode_launches_do_not_depend_on_lengths_or_positions(scenario: str, step: str) -> None:
    """A CUDA graph replays a decode step's launches with new lengths: they must be the same launches."""
    first = _case(step)
    other = _other_lengths(first)
    assert first.batch.seq_lens_host != other.batch.seq_lens_host
    assert _decode_signature(record(scenario, first)) == _decode_signature(record(scenario, other))


def _other_lengths(case: Case) -> Case:
    """``case``'s decode step on the same caches and block table, each request shorter by 1..B tokens."""
    b, block = case.batch, case.params.block_size
    lens = [s - 1 - i % block for i, s in enumerate(b.seq_lens_host)]
    other = BatchMetadata.build([b.decode_query_len] * b.num_decodes, lens, b.block_table, block_size=block,
                                num_decodes=b.num_decodes)
    return dataclasses.replace(case, batch=other)


def _break_record(step: Step, kernel: str, change: Callable[[Launch], Launch]) -> Step:
    i = next(i for i, x in enumerate(step.launches) if x.name == kernel)
    launches = list(step.launches)
    launches[i] = change(launches[i])
    return Step(step.case, step.cfg, step.platform, launches)


def _with(x: Launch, grid: Any = None, constexprs: Any = None, options: Any = None) -> Launch:
    return x._replace(grid=grid or x.grid, constexprs={**x.constexprs, **(constexprs or {})},
                      options=options if options is not None else x.options)


#: a broken launch per check: (scenario, step, config changes or None, a change of one recorded launch or None,
#: what the violations must say)
MUTATIONS = {
    "inner tile not dividing the block": ("cuda", "decode1", dict(decode_attention=dict(block_n=48)), None,
                                          "_decode_attention_flat_kernel: check_kernel: inner tile BN=48"),
    "too many warps": ("rocm", "decode1", dict(decode_index=dict(warps=32)), None, "num_warps=32 is not"),
    "a tile of no power of two": ("rocm", "spec3_mixed", dict(prefill_tiles=dict(rows=24)), None,
                                  "tl.arange spans of no power of two: {'ROWS': 24}"),
    "a split without slots": ("cuda", "decode1", None, ("_decode_attention_flat_kernel", lambda x: _with(
        x, constexprs=dict(KPS=x.constexprs["KPS"] + 8))), "a part without top-k slots"),
    "a program short": ("cuda", "decode64_fp8kv", None, ("_decode_attention_flat_kernel", lambda x: _with(
        x, grid=(x.grid[0] - 1,))), "do not cover"),
    "blocks left unscored": ("rocm", "decode1", None, ("_decode_score_kernel", lambda x: _with(
        x, constexprs=dict(BPS=x.constexprs["BPS"] // 2))), "blocks of the table"),
    "a waiter not launched as a dependent": ("cuda", "decode1", None, ("_decode_score_kernel", lambda x: _with(
        x, options={k: o for k, o in x.options.items() if k != "launch_pdl"})), "not launched as a dependent"),
    "PDL on AMD": ("rocm", "decode1", None, ("_decode_topk_kernel", lambda x: _with(
        x, constexprs=dict(PDL=True))), "programmatic dependent launch off NVIDIA"),
    "an unknown constexpr": ("cuda", "spec3_mixed", None, ("_prefill_index_kernel", lambda x: _with(
        x, constexprs=dict(SPLIT=2))), "constexprs that are no parameter: ['SPLIT']"),
    "tf32 on fp32 dots": ("cuda", "prefill_long_g3", None, ("_prefill_index_kernel", lambda x: _with(
        x, constexprs=dict(DOT_PREC="tf32"))), "fp32 dots in tf32 precision"),
    "a merge of other splits": ("rocm", "decode1", None, ("_merge_row_kernel", lambda x: _with(
        x, constexprs=dict(SPLITS=x.constexprs["SPLITS"] * 2, S_PAD=x.constexprs["S_PAD"] * 2))), "check_kernel"),
    "a merge nobody needs": ("cuda", "decode1", dict(algorithms=dict(merge_in_last_program=True)), (
        "_decode_attention_flat_kernel", lambda x: _with(x, constexprs=dict(MERGE_LAST=False))), "then ''"),
    "AMD options on NVIDIA": ("rocm_on_nvidia", "decode1", None, ("_decode_topk_kernel", lambda x: _with(
        x, options=dict(x.options, waves_per_eu=2))), "an AMD-only launch option"),
    "score columns left unwritten": ("cuda", "spec3_mixed", None, ("_index_scores_kernel", lambda x: _with(
        x, grid=(*x.grid[:2], x.grid[2] - 1))), "do not cover"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_check_fails_on_a_launch_that_breaks_it(name: str) -> None:
    scenario, step_name, changes, launch_change, expected = MUTATIONS[name]
    cfg = override(_config(scenario), **changes) if changes else None
    step = record(scenario, _case(step_name), cfg)
    if launch_change is None:
        assert any(expected in v for v in violations(step)), violations(step)
        return
    assert violations(step) == [], "the premise: the step keeps every invariant before its launch is broken"
    broken = violations(_break_record(step, *launch_change))
    assert any(expected in v for v in broken), broken


def test_a_length_dependent_decode_launch_is_caught() -> None:
    first = _case("decode1")
    other = _other_lengths(first)
    a, b = record("cuda", first), record("cuda", other)
    assert _decode_signature(a) == _decode_signature(b)
    b = _break_record(b, "_decode_score_kernel", lambda x: _with(x, grid=(x.grid[0], x.grid[1] + 1)))
    assert _decode_signature(a) != _decode_signature(b)


def test_a_decode_plan_is_derived_once_per_shape_class() -> None:
    """The launch parameters of a decode step depend on shapes only: a plan is derived on the first
    step of a shape class and the same object is handed back after (a step pays a dict lookup)."""
    from mm3_backends.cuda.tuning import NVIDIA_LAUNCH
    from mm3_backends.triton.plans import decode_attention_plan

    cfg = NVIDIA_LAUNCH.for_device_sms(132)
    shape = (cfg, 1, 1, 8, 16, 128, 128, torch.bfloat16, torch.bfloat16, False)
    plan = decode_attention_plan(*shape)
    assert decode_attention_plan(*shape) is plan
    assert (plan.flat, plan.splits, plan.merge) == (True, 16, True)
    assert decode_attention_plan(cfg, 2, *shape[2:]) is not plan


def test_recording_leaves_the_interpreter_setting_as_it_was() -> None:
    before = os.environ.get("TRITON_INTERPRET")
    record("cuda", _case("decode1"))
    assert os.environ.get("TRITON_INTERPRET") == before


@pytest.mark.parametrize("fmt", [{}, dict(kv_dtype="nvfp4", index_dtype="nvfp4")], ids=["bf16", "nvfp4"])
def test_decode_steps_of_token_slots_launch_their_plans_kept_constexprs(fmt: dict[str, Any]) -> None:
    """The fast launcher knows a launch's constexprs by the dict's identity (fast_launch._Kernel.static_token):
    two steps of one shape class through token slots must hand it the same dicts (their plan's), or every
    launch hashes them again and keeps one more."""
    from mm3.testing.factories import as_token_slots

    cases = [as_token_slots(make_case(_params(1, 16, 128, 128, 64, 16), decodes=[700, 3000, 90], seed=s, **fmt),
                            torch.Generator().manual_seed(s)) for s in (1, 2)]
    assert all(c.batch.slots is not None for c in cases)
    a, b = (record("cuda", c) for c in cases)
    decode = [(x, y) for x, y in zip(a.launches, b.launches) if "decode" in x.kernel.fn.__name__]
    assert {x.kernel.fn.__name__ for x, _ in decode} >= {"_decode_score_kernel", "_decode_attention_flat_kernel"}
    for x, y in decode:
        assert x.constexprs.get("SLOTS") is True and x.constexprs is y.constexprs, x.kernel.fn.__name__
