"""Every kernel launch the ``cuda`` and ``rocm`` plugins make on a few small steps, as plain data.

Nothing runs: each kernel is replaced by a recorder of its grid, its
non-tensor arguments and its launch options. The plugin's own config path is
used (``PLATFORM.launch_config`` for a 132-multiprocessor GPU), on its own
platform and on the other one (the test-only overrides), so the dump pins the
effective launch parameters, not the shape of the config objects.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch

__all__ = ["dump_launches"]

# (name, params kwargs, make_case kwargs)
_CASES = (
    ("decode1", dict(h=4, g=16, d=128, di=128, block=64, topk=16),
     dict(decodes=[3000], dtype="bfloat16", index_dtype="bfloat16")),
    ("decode64_fp8", dict(h=4, g=16, d=128, di=128, block=64, topk=16),
     dict(decodes=[700] * 64, dtype="bfloat16", index_dtype="float8_e4m3fn")),
    ("spec3_mixed", dict(h=1, g=8, d=64, di=64, block=16, topk=8),
     dict(decodes=[300, 90], prefills=[(40, 400), (3, 3)], decode_query_len=3, dtype="float16",
          index_dtype="float16")),
    ("decode64_fp8kv", dict(h=4, g=16, d=128, di=128, block=64, topk=16),
     dict(decodes=[700] * 64, dtype="bfloat16", index_dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn")),
    ("prefill_fp8kv", dict(h=2, g=4, d=32, di=32, block=32, topk=4),
     dict(prefills=[(50, 500)], dtype="bfloat16", index_dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn")),
)

# (scenario, plugin, torch.version.hip): each plugin on its own platform and on the other one
_SCENARIOS = (("cuda", "cuda", None), ("rocm", "rocm", "6.2"), ("rocm_on_nvidia", "rocm", None),
              ("cuda_on_rocm", "cuda", "6.2"))


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return repr(v)


class _Recorder:
    def __init__(self, name: str, sink: list) -> None:
        self.name, self.sink = name, sink

    def __getitem__(self, grid: Any):  # noqa: ANN204 - mimics JITFunction[grid]
        def launch(*args: Any, **kwargs: Any) -> None:
            self.sink.append(dict(kernel=self.name, grid=_plain(tuple(grid)), args=_plain(args),
                                  kwargs={k: _plain(v) for k, v in sorted(kwargs.items())}))
        return launch


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _Props:
    multi_processor_count = 132


@functools.lru_cache(maxsize=None)
def _case(name: str) -> Any:
    """The step of ``_CASES[name]``, built once for all six scenarios: no kernel runs, so nothing
    changes it, and the random caches were three quarters of the dump's time."""
    from mm3.contract import SparseAttentionParams
    from mm3.testing.factories import make_case

    p, kw = next((p, kw) for n, p, kw in _CASES if n == name)
    params = SparseAttentionParams(num_heads=p["h"] * p["g"], num_kv_heads=p["h"], head_dim=p["d"],
                                   num_index_heads=p["h"], index_head_dim=p["di"], block_size=p["block"],
                                   topk=p["topk"])
    return make_case(params, seed=0, **kw)


def _run_cases(cfg: Any, layout: str, sink: list) -> None:
    from mm3.contract import TopkBuffer
    from mm3_backends.triton import attention, indexer

    for name, _, _ in _CASES:
        case = _case(name)
        params = case.params
        buf = TopkBuffer.allocate(case.batch.num_tokens, params.num_kv_heads, params.topk, layout, fill=0)
        sink.append(dict(case=name))
        indexer.index_topk(case.index_q, case.caches, case.batch, params, buf, cfg)
        attention.attention_forward(case.q, case.caches, buf, case.batch, params, torch.empty_like(case.q), cfg)


def dump_launches() -> dict[str, list]:
    """scenario -> the recorded launches (dicts of plain values), in launch order."""
    from mm3_backends.cuda import plugin as cuda_plugin
    from mm3_backends.rocm import plugin as rocm_plugin
    from mm3_backends.triton import attention, indexer, plugin_factory, prefill_attention, prefill_plan

    plugins = {"cuda": cuda_plugin.PLATFORM, "rocm": rocm_plugin.PLATFORM}
    out: dict[str, list] = {}
    sink: list = []
    with contextlib.ExitStack() as stack:
        for m in (indexer, attention, prefill_attention, prefill_plan):
            for n in [n for n in dir(m) if n.startswith("_") and n.endswith("_kernel")]:
                stack.enter_context(_patched(m, n, _Recorder(n, sink)))
        stack.enter_context(_patched(torch.cuda, "get_device_properties", lambda i: _Props()))
        env = os.environ.get("TRITON_INTERPRET")
        try:
            for scenario, plugin, hip in _SCENARIOS:
                os.environ["TRITON_INTERPRET"] = "0"
                with contextlib.ExitStack() as s2:
                    s2.enter_context(_patched(torch.version, "hip", hip))
                    # the plugin keeps its answer per process: these launches are for a GPU
                    s2.enter_context(_patched(plugin_factory, "_kernels_interpreted", lambda: False))
                    platform = plugins[plugin]
                    cfg = platform.launch_config(torch.device("cuda", 0))
                    sink.clear()
                    _run_cases(cfg, platform.topk_layout, sink)
                    out[scenario] = list(sink)
            os.environ["TRITON_INTERPRET"] = "1"
            for plugin, platform in plugins.items():
                sink.clear()
                _run_cases(platform.launch_config(torch.device("cpu")), platform.topk_layout, sink)
                out[f"{plugin}_interpreter"] = list(sink)
        finally:
            if env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = env
    return out


if __name__ == "__main__":  # rewrite the golden file (an intended tuning change only)
    import json
    import pathlib

    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported, as under pytest
    path = pathlib.Path(__file__).parent / "data" / "launch_parameters.json"
    path.write_text(json.dumps(dump_launches(), indent=0, sort_keys=True))
