"""The ``cuda`` plugin with one of its kernel choices switched, timed beside the default (``mm3 bench --variants``).

Each variant is a choice another shipped configuration makes (the rocm
plugin's kernels, the separate launches), applied to the cuda plugin's
:class:`LaunchConfig` by ``override``: one run then measures what each choice
is worth on the same inputs, each checked against the reference first. A
candidate tuning is a new entry here for the run that decides it; the one
that loses leaves with its code. ``mm3 bench --variants slowlaunch,sep`` (or ``ALL``).

This module imports a backend on purpose: it is benchmark code, never loaded by
the core.

Each variant is a real backend (its own plugin, registered in a registry of its
own), so the harness calls it exactly as it calls the cuda plugin.

Example:
    >>> [(v.name, v.backend.name) for v in make_variants("sep,tiles")]
    [('cuda[sep]', 'cuda_sep'), ('cuda[tiles]', 'cuda_tiles')]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from mm3.runtime.backend import Backend
from mm3.runtime.registry import Registry

__all__ = ["VARIANTS", "Variant", "make_variants"]

#: name -> (``override`` arguments of the cuda plugin's LaunchConfig, step kinds it changes)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # every kernel launched through Triton's own launcher: the GPU time must not change
    "slowlaunch": (dict(algorithms=dict(fast_launch=False)), ("decode", "prefill")),
    # the decode top-k and merge as launches of their own, never in the last program of their group
    "sep": (dict(algorithms=dict(merge_in_last_program=False, topk_in_last_program=False, streamed_decode=False)),
            ("decode",)),
    # no programmatic dependent launch
    "nopdl": (dict(algorithms=dict(pdl=False)), ("decode",)),
    # the decode attention after the indexer, never beside it
    "nostream": (dict(algorithms=dict(streamed_decode=False)), ("decode",)),
    # the rocm plugin's kernels: the grid decode attention, the token-tile prefill attention, the
    # prefill indexer without its instruction cuts, fp8 K/V widened to bf16
    "grid": (dict(algorithms=dict(decode_attention_flat=False)), ("decode",)),
    "tiles": (dict(prefill_attention=None), ("prefill",)),
    "piplain": (dict(prefill_index=dict(unmasked_full=False, sorted_merge=False, static_key_stride=False)),
                ("prefill",)),
    "kvbf16": (dict(numerics=dict(kv_fp8_as_f16=False)), ("decode",)),
}


@dataclass(frozen=True)
class Variant:
    """One variant: its report name (``cuda[sep]``), the step kinds it changes, its overrides, and the bound
    backend that runs it (the cuda plugin's hooks on the overridden launch config, named ``cuda_sep``)."""

    name: str
    kinds: tuple[str, ...]
    overrides: dict[str, Any]
    backend: Backend


def _variant(name: str, overrides: dict[str, Any], kinds: tuple[str, ...]) -> Variant:
    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    platform = replace(PLATFORM, name=f"cuda_{name}", launch=override(PLATFORM.launch, **overrides))
    plugin = SimpleNamespace(**make_hookimpls(platform)._asdict())
    backend = Registry(plugins=[plugin], entry_points=False).get(platform.name)
    return Variant(f"cuda[{name}]", kinds, overrides, backend)


def make_variants(spec: str) -> list[Variant]:
    """``"a,b"`` or ``"ALL"`` -> variants (unknown names raise ``KeyError`` listing the known)."""
    names = list(VARIANTS) if spec.strip().upper() == "ALL" else [n.strip() for n in spec.split(",") if n.strip()]
    out = []
    for n in names:
        if n not in VARIANTS:
            raise KeyError(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
        ov, kinds = VARIANTS[n]
        out.append(_variant(n, ov, kinds))
    return out
