"""Safe by default: with no setting touched, a buggy plugin or a bad page id is never silent.

* ``check_contracts`` defaults to ``"first"``: the contract guard checks the
  first step of each kind of batch a layer's backend pair sees, then steps
  aside (never during CUDA-graph capture);
* vLLM's layout bug in one line (a token-major result written into a
  head-major buffer with ``reshape`` instead of ``permute``), shipped in a
  real pip-installed package found through its ``mm3.backends`` entry point,
  raises ``ContractViolation`` naming the plugin on its first step;
* every block-table entry a step uses must be a page of the cache: checked on
  the host when the table lives there, else by a device-side flag raised at
  the next step (docs/errors.md §2.6).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from plugin_fakes import pip_install_into, subprocess_env

import mm3.runtime.step as step_module
import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3 import BatchMetadata, SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.contract.errors import ContractViolation, InputError
from mm3.contract.contents import FaultFlag, check_on_host
import mm3.debug.guard as guard_mod
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.mock import MockBackend

FIRST = Settings(check_contracts="first")

# -- the reshape bug, in a package installed for real ---------------------------------------------

PLUGIN = textwrap.dedent('''
    """An indexer whose kernel produces token-major rows, copied into the head-major buffer."""
    import torch
    from mm3.plugin import BackendCapabilities, hookimpl
    from mm3.testing.oracle import oracle_topk

    CAPS = BackendCapabilities(name="reshape_bug", ops={"index_topk"}, device_types={"cpu"},
                               topk_layout="head_major", max_decode_query_len=4)

    @hookimpl
    def backend_capabilities():
        return CAPS

    @hookimpl
    def index_topk(index_q, caches, batch, params, out):
        rows = oracle_topk(index_q, caches, batch, params).token_major().contiguous()   # [T, H, K]
        H, T, K = out.num_heads, out.num_tokens, out.topk
        out.head_major().copy_(rows.reshape(H, T, K))      # the bug: should be rows.permute(1, 0, 2)
''')

PYPROJECT = textwrap.dedent('''
    [build-system]
    requires = ["setuptools>=77"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "mm3-reshape-bug"
    version = "0.0.1"

    [project.entry-points."mm3.backends"]
    reshape_bug = "mm3_reshape_bug"

    [tool.setuptools]
    py-modules = ["mm3_reshape_bug"]
''')

# One step of a mixed batch (H = 2) as a new user would run it: no setting touched.
STEP = textwrap.dedent('''
    import sys, torch, mm3
    from mm3.runtime.config import Settings
    from mm3.testing.factories import make_case
    from mm3.testing.oracle import oracle_attention, oracle_topk

    p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                  index_head_dim=16, block_size=16, topk=4)
    case = make_case(p, decodes=[70, 40, 90], prefills=[(9, 30), (17, 17)], dtype="float32")
    settings = Settings(check_contracts=sys.argv[1]) if len(sys.argv) > 1 else None
    layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend="cpu_ref",
                                indexer_backend="reshape_bug", settings=settings)
    print("mode", layer.settings.check_contracts)
    try:
        out = layer(case.q, case.index_q, case.caches, case.batch)
    except mm3.ContractViolation as e:
        print("violation", e.backend, e.hook, e.rule)
        print(e)
    else:
        ref = oracle_attention(case.q, case.caches, oracle_topk(case.index_q, case.caches, case.batch, p),
                               case.batch, p)
        print("ran", float((out.double() - ref).abs().max()))
''')


@pytest.fixture(scope="module")
def reshape_bug_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reshape_bug")
    src = root / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "mm3_reshape_bug.py").write_text(PLUGIN)
    target = root / "site"
    pip_install_into(src, target)
    shutil.rmtree(src)                      # only the installed copy remains importable
    return target


def _run_step(site: Path, cwd: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", STEP, *args], cwd=cwd, env=subprocess_env(site),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_reshape_bug_in_an_installed_plugin_stops_on_its_first_step_by_default(
        reshape_bug_site: Path, tmp_path: Path) -> None:
    out = _run_step(reshape_bug_site, tmp_path)
    lines = out.splitlines()
    assert lines[0] == "mode first", out                           # nothing set: the default
    assert lines[1].startswith("violation reshape_bug index_topk topk."), out
    assert "backend 'reshape_bug' (mm3-reshape-bug 0.0.1" in out and "layout mix-up" in out, out


def test_without_the_guard_the_reshape_bug_is_silent(reshape_bug_site: Path, tmp_path: Path) -> None:
    """The test above can fail: turned off, the same plugin runs and returns wrong numbers."""
    lines = _run_step(reshape_bug_site, tmp_path, "never").splitlines()
    assert lines[0] == "mode never" and lines[1].startswith("ran "), lines
    assert float(lines[1].split()[1]) > 0.05


# -- "first": which steps are checked ----------------------------------------------------------------

def _params() -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                 index_head_dim=16, block_size=16, topk=4)


def _case(kind: str, seed: int = 0) -> Case:
    p = _params()
    shapes: dict[str, dict[str, Any]] = {
        "decode": dict(decodes=[70, 40]),
        "speculative decode": dict(decodes=[70, 40], decode_query_len=2),
        "prefill": dict(prefills=[(9, 30)]),
        "mixed": dict(decodes=[70], prefills=[(9, 30)]),
    }
    return make_case(p, dtype="float32", seed=seed, **shapes[kind])


def _layer(plugin: Any, name: str, settings: Settings = FIRST) -> SparseAttention:
    return SparseAttention(_params(), dtype=torch.float32, max_num_tokens=64, max_decode_query_len=2,
                           backend=name, registry=Registry(plugins=[plugin], entry_points=False),
                           settings=settings)


def _count_guarded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The batch kinds of the indexer calls the guard checks."""
    calls: list[str] = []
    real = guard_mod.checked_call

    def counted(be: Any, op: str, args: Any, **kw: Any) -> None:
        if op == "index_topk":
            calls.append(args[2].kind)
        return real(be, op, args, **kw)
    monkeypatch.setattr(guard_mod, "checked_call", counted)
    return calls


def test_first_checks_each_kind_of_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_guarded(monkeypatch)
    layer = _layer(cpu_ref, "cpu_ref")
    kinds = ["mixed", "mixed", "decode", "decode", "speculative decode", "prefill", "mixed", "prefill"]
    for i, kind in enumerate(kinds):
        case = _case(kind, seed=i)
        assert case.batch.kind == kind
        layer(case.q, case.index_q, case.caches, case.batch)
    assert calls == ["mixed", "decode", "speculative decode", "prefill"]


@pytest.mark.parametrize("mode, guarded", [("always", 3), ("never", 0)])
def test_always_and_never_remain(monkeypatch: pytest.MonkeyPatch, mode: str, guarded: int) -> None:
    calls = _count_guarded(monkeypatch)
    layer = _layer(cpu_ref, "cpu_ref", Settings(check_contracts=mode))
    for i in range(3):
        case = _case("decode", seed=i)
        layer(case.q, case.index_q, case.caches, case.batch)
    assert len(calls) == guarded


def test_a_faulty_plugin_is_caught_on_each_new_kind_by_default() -> None:
    layer = _layer(MockBackend("faulty", fault="out_of_range", max_decode_query_len=2), "faulty")
    for kind in ("decode", "prefill"):
        case = _case(kind)
        with pytest.raises(ContractViolation, match="backend 'faulty'.*index_topk: rule topk.range"):
            layer(case.q, case.index_q, case.caches, case.batch)
    assert not layer.op_target.guarded             # a failed check is repeated next time


def test_cuda_graph_capture_never_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_guarded(monkeypatch)
    layer = _layer(cpu_ref, "cpu_ref")
    monkeypatch.setattr(step_module.OpTarget, "capturing", staticmethod(lambda t: True))
    case = _case("decode")
    layer(case.q, case.index_q, case.caches, case.batch)
    assert calls == [] and not layer.op_target.guarded   # the eager step after capture is still checked


# -- page ids ------------------------------------------------------------------------------------

def _with_page(case: Case, request: int, block: int, page: int) -> BatchMetadata:
    b = case.batch
    bt = b.block_table.clone()
    bt[request, block] = page
    return BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=b.block_size,
                               num_decodes=b.num_decodes, decode_query_len=b.decode_query_len)


@pytest.mark.parametrize("mode", ["first", "never"])
@pytest.mark.parametrize("page", [-1, 10_000])
def test_bad_page_ids_raise_on_cpu_ref_with_any_setting(mode: str, page: int) -> None:
    layer = _layer(cpu_ref, "cpu_ref", Settings(check_contracts=mode))
    case = _case("mixed")
    layer(case.q, case.index_q, case.caches, case.batch)           # warm: "mixed" is checked
    bad = _with_page(case, 1, 1, page)
    with pytest.raises(InputError, match=rf"request 1, block 1: batch.block_table\[1, 1\] = {page} is not a page id"):
        layer(case.q, case.index_q, case.caches, bad)
    layer(case.q, case.index_q, case.caches, case.batch)           # the layer stays usable


def test_device_flag_keeps_the_first_offence_and_reports_it_once() -> None:
    case = _case("mixed")
    pages = case.caches.num_pages
    flag = FaultFlag("cpu")
    flag.record(case.batch, pages)
    flag.raise_pending()                                            # a good table: nothing
    flag.record(_with_page(case, 1, 0, -4), pages)
    flag.record(_with_page(case, 0, 2, pages), pages)               # the smaller (request, block) wins
    with pytest.raises(InputError, match=r"request 0, block 2: batch.block_table\[0, 2\] is not a page id .*found on the device"):
        flag.raise_pending()
    flag.raise_pending()                                            # reported once
    again = _with_page(case, 1, 0, -4)
    for _ in range(2):                                              # the same batch is checked every time
        flag.record(again, pages)
        with pytest.raises(InputError, match=r"block_table\[1, 0\] is not a page id"):
            flag.check()


def test_a_refilled_batch_is_checked_again() -> None:
    """Nothing is remembered about a batch: refilled through ``update_``, it is judged as it is now."""
    case = _case("mixed")
    pages = case.caches.num_pages
    b = case.batch
    batch = BatchMetadata.build(b.query_lens, b.seq_lens_host, b.block_table.clone(), block_size=b.block_size,
                                num_decodes=b.num_decodes, decode_query_len=b.decode_query_len)
    check_on_host(batch, pages, entry="test")
    batch.update_(_with_page(case, 1, 1, pages + 5))
    with pytest.raises(InputError, match=rf"block_table\[1, 1\] = {pages + 5}"):
        check_on_host(batch, pages, entry="test")


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor value by the host (``item``, ``int(t)``, ``t[idx_tensor]``...)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor value was read on the host: a device sync, refused in CUDA graphs")
        return func(*args, **(kwargs or {}))


def test_device_flag_records_without_reading_a_value_on_the_host() -> None:
    """What a GPU step and a CUDA-graph capture run: no host read (on the GPU it would sync)."""
    case = _case("mixed")
    pages = case.caches.num_pages
    flag = FaultFlag("cpu")
    bad = _with_page(case, 1, 0, pages + 3)     # built from host lists (and judged there, on the host)
    with _NoHostReads():
        flag.record(bad, pages)
    with pytest.raises(InputError, match=r"block_table\[1, 0\] is not a page id"):
        flag.raise_pending()
