"""The ``cuda`` plugin with one of its kernel choices switched, timed beside the default (``mm3 bench --variants``).

Each variant is a choice another shipped configuration makes (the rocm
plugin's kernels, the separate launches), applied to the cuda plugin's
:class:`LaunchConfig` by ``override``: one run then measures what each choice
is worth on the same inputs, each checked against the reference first. A
candidate tuning is a new entry here for the run that decides it; the one
that loses leaves with its code. ``mm3 bench --variants slowlaunch,sep`` (or ``ALL``).

This module imports a backend on purpose: it is benchmark code, never loaded by
the core.

Example:
    >>> [v.name for v in make_variants("sep,tiles")]
    ['cuda[sep]', 'cuda[tiles]']
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

__all__ = ["VARIANTS", "VariantBackend", "make_variants"]

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


class VariantBackend:
    """Quacks like :class:`mm3.runtime.backend.Backend` for the harness: name, alloc, index_topk, attention_forward."""

    def __init__(self, name: str, overrides: dict[str, Any], kinds: tuple[str, ...]) -> None:
        from mm3_backends.cuda.plugin import PLATFORM
        from mm3_backends.triton.launch import override
        from mm3_backends.triton.plugin_factory import make_hookimpls

        self.name = f"cuda[{name}]"
        self.kinds = kinds
        self.overrides = overrides
        self._hooks = make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, **overrides)))
        self.index_topk = self._hooks.index_topk
        self.attention_forward = self._hooks.attention_forward

    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int, device: Any):  # noqa: ANN201
        return self._hooks.alloc_topk_buffer(num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                                             device=torch.device(device))


def make_variants(spec: str) -> list[VariantBackend]:
    """``"a,b"`` or ``"ALL"`` -> variant backends (unknown names raise ``KeyError`` listing the known)."""
    names = list(VARIANTS) if spec.strip().upper() == "ALL" else [n.strip() for n in spec.split(",") if n.strip()]
    out = []
    for n in names:
        if n not in VARIANTS:
            raise KeyError(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
        ov, kinds = VARIANTS[n]
        out.append(VariantBackend(n, ov, kinds))
    return out
