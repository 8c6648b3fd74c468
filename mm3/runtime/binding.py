"""Binding: backends selected for a set of requirements, and the target every step of that choice runs on.

The one place a choice is made and judged for good: :func:`bind` selects (with
its trace), allocates a layer's persistent top-k buffer through the indexer
backend, and builds the :class:`~mm3.runtime.step.OpTarget` whose plans,
guard policy and fault flag every later step uses; it registers the target
for ``torch.ops.mm3.*`` (:func:`mm3.runtime.ops.register`). A layer
(:class:`~mm3.SparseAttention`) binds once per backend names in force; a
drop-in call (:mod:`mm3.integrations.targets`) once per requirements and names.

Example:
    >>> import torch, mm3
    >>> from mm3.runtime.config import Settings
    >>> from mm3.runtime.registry import default_registry
    >>> from mm3.runtime.selection import requirements_for
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> req = requirements_for(p, torch.float32, torch.float32, "cpu")
    >>> b = bind(p, req, ("cpu_ref", None), torch.device("cpu"), Settings(), default_registry())
    >>> b.selection.attention.name, b.target.handle > 0, b.target.topk is None
    ('cpu_ref', True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mm3.contract.capabilities import Requirements
from mm3.contract.contents import FaultFlag
from mm3.contract.facts import LayerFacts
from mm3.contract.params import SparseAttentionParams
from mm3.debug.guard import check_topk_allocation, fill_sentinel
from mm3.runtime.config import Settings
from mm3.runtime.ops import register
from mm3.runtime.registry import Registry
from mm3.runtime.selection import Selection, select
from mm3.runtime.step import OpTarget

__all__ = ["Binding", "bind"]


@dataclass(frozen=True)
class Binding:
    """One choice: the selection (``selection.explain()`` says why) and the target its steps run on."""

    selection: Selection
    target: OpTarget


def bind(params: SparseAttentionParams, requirements: Requirements, names: tuple[str, Optional[str]],
         device: torch.device, settings: Settings, registry: Registry, *, layer: Optional[LayerFacts] = None,
         flag: Optional[FaultFlag] = None) -> Binding:
    """Select backends for ``requirements`` on ``device`` and build the target their steps run on.

    ``names``: ``(backend, indexer_backend)``. ``layer``: a layer's promises; its target then gets a
    persistent top-k buffer of ``layer.capacity`` rows, allocated by the indexer backend (and, unless the
    guard is off, checked and marked so stray writes show), and the selection is re-judged on that very
    buffer (:meth:`~mm3.runtime.selection.Selection.for_buffer`: what runs is what the trace says).
    ``flag``: where the target's device-side checks report (default: a new one on ``device``).
    Selection errors propagate with their explanation.
    """
    sel = select(requirements, registry, backend=names[0], indexer_backend=names[1],
                 allow_fallback=settings.allow_fallback, device=device)
    mode = settings.check_contracts
    buf = None
    if layer is not None:
        idx = sel.indexer
        # Backend.alloc_topk_buffer already checks type, layout and shape against the declaration.
        buf = idx.alloc_topk_buffer(layer.capacity, params.num_index_heads, params.topk, device)
        if mode != "never":   # the guard checks what a hook returned, then marks it to see stray writes
            check_topk_allocation(buf, layout=idx.capabilities.topk_layout, num_tokens=layer.capacity,
                                  num_heads=params.num_index_heads, topk=params.topk, device=device, backend=idx)
            fill_sentinel(buf)
        sel = sel.for_buffer(buf)
    target = OpTarget(sel.indexer, sel.attention, params, topk=buf, mode=mode,
                      flag=flag if flag is not None else FaultFlag(device), layer=layer, scorer=sel.scorer,
                      sync_contents=settings.check_contents_with_sync)
    register(target)
    return Binding(sel, target)
