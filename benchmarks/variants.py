"""Launch-configuration variants of the ``cuda`` plugin, timed side by side with the default.

A variant is the ``cuda`` plugin's hooks rebuilt (``make_hookimpls``) with some
:class:`LaunchConfig` fields overridden, so one run measures the current
kernels and candidate changes on the same inputs, each checked against the
reference first. ``mm3 bench --variants att3,sort`` (or ``ALL``).

This module imports a backend on purpose: it is benchmark code, never loaded by
the core.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

__all__ = ["VARIANTS", "VariantBackend", "make_variants"]

#: name -> (LaunchConfig overrides, step kinds it changes)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "att3": (dict(decode_attention_branchless=True, decode_attention_stages=3), ("decode",)),
    "att3f4": (dict(decode_attention_branchless=True, decode_attention_stages=3,
                    decode_attention_programs_factor=4), ("decode",)),
    "att2f8": (dict(decode_attention_branchless=True, decode_attention_stages=2,
                    decode_attention_programs_factor=8), ("decode",)),
    "sort": (dict(topk_sort=True), ("decode",)),
    "keysA": (dict(index_keys_as_a=True), ("decode", "prefill")),
    "dall": (dict(topk_sort=True, index_keys_as_a=True, decode_attention_branchless=True,
                  decode_attention_stages=3, decode_attention_programs_factor=4), ("decode",)),
    "pchunk": (dict(prefill_index_chunk=32), ("prefill",)),
    "pchunkA": (dict(prefill_index_chunk=32, index_keys_as_a=True), ("prefill",)),
    "prow128": (dict(prefill_index_chunk=32, prefill_index_rows=128), ("prefill",)),
    "union": (dict(prefill_attention_union=True), ("prefill",)),
    "pall": (dict(prefill_index_chunk=32, index_keys_as_a=True, prefill_attention_union=True), ("prefill",)),
}


class VariantBackend:
    """Quacks like :class:`mm3.registry.Backend` for the harness: name, alloc, index_topk, attention_forward."""

    def __init__(self, name: str, overrides: dict[str, Any], kinds: tuple[str, ...]) -> None:
        from mm3_backends.cuda.plugin import SPEC
        from mm3_backends.triton.plugin_factory import make_hookimpls

        self.name = f"cuda[{name}]"
        self.kinds = kinds
        self.overrides = overrides
        self._hooks = make_hookimpls(replace(SPEC, launch=replace(SPEC.launch, **overrides)))
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
