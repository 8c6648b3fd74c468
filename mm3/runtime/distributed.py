"""Tensor parallelism: shard a sparse-attention layer over the ranks of ``torch.distributed``.

MiniMax-M3 is served at tensor-parallel size 1, 2, 4 or 8. Query heads are
split contiguously across ranks. KV heads (and the index heads, which are tied
to them one to one) are split the same way while there are enough of them; once
the world is larger than the number of KV heads, each KV head is *replicated*
on every rank whose query heads read it, exactly as the model does:

=========  ===========  =================  ===============================
TP size    query heads  KV / index heads   rank ``r`` uses KV head(s)
=========  ===========  =================  ===============================
1          64           4 / 4              0-3
2          32           2 / 2              ``2r``, ``2r + 1``
4          16           1 / 1              ``r``
8          8            1 / 1              ``r // 2`` (two ranks per head)
=========  ===========  =================  ===============================

Rule: with ``Hq`` query heads, ``Hkv`` KV heads and world size ``W``:

* ``W`` must divide ``Hq``; rank ``r`` owns query heads ``[r*Hq/W, (r+1)*Hq/W)``;
* ``W <= Hkv``: ``W`` must divide ``Hkv``; rank ``r`` owns KV/index heads
  ``[r*Hkv/W, (r+1)*Hkv/W)`` and the GQA group is unchanged;
* ``W > Hkv``: ``Hkv`` must divide ``W``; rank ``r`` holds the one KV/index head
  ``r // (W / Hkv)`` and its GQA group shrinks to ``Hq / W``.

The index cache holds one key per token for *all* index heads, so every rank
keeps it whole. Each rank's index head selects blocks for its own KV head, so
the top-k rows a rank computes are exactly the full model's rows for that head:
per-rank outputs concatenated along the head axis equal the unsharded result.

Nothing here asks which platform it runs on: each rank builds an ordinary
:class:`~mm3.runtime.layer.SparseAttention`, which selects its backend through the
registry and settings (``MM3_BACKEND``, ``mm3.toml``, ``use_backend``) like any
other layer. Communication uses whatever process group the caller initialised
(NCCL on GPUs, gloo on CPUs).

Example:
    >>> from mm3.contract.params import SparseAttentionParams
    >>> full = SparseAttentionParams.minimax_m3(tp_size=1)
    >>> shard = rank_shard(full, rank=5, world_size=8)
    >>> shard.q_heads, shard.kv_heads, shard.kv_replicas
    (range(40, 48), range(2, 3), 2)
    >>> shard_params(full, 8) == SparseAttentionParams.minimax_m3(tp_size=8)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.distributed as dist

from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import InputError
from mm3.contract.params import SparseAttentionParams

from mm3.runtime.layer import SparseAttention

if TYPE_CHECKING:
    from mm3.contract.batch import BatchMetadata
    from mm3.runtime.config import Settings
    from mm3.runtime.registry import Registry
    from mm3.runtime.selection import Selection

__all__ = [
    "RankShard",
    "shard_params",
    "rank_shard",
    "all_rank_shards",
    "concat_heads",
    "gather_heads",
    "TensorParallelSparseAttention",
]

DeviceLike = Union[str, torch.device]


def _check_world(full: SparseAttentionParams, world_size: int) -> None:
    """Raise :class:`InputError` unless ``full`` can be split over ``world_size`` ranks."""
    if not isinstance(full, SparseAttentionParams):
        raise InputError(f"full-model params must be SparseAttentionParams, got {type(full).__name__}")
    # bool is an int subclass; True as a world size is always a bug.
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InputError(f"world_size must be a positive int, got {world_size!r}")
    hq, hkv = full.num_heads, full.num_kv_heads
    if hq % world_size:
        raise InputError(
            f"world_size {world_size} does not divide the {hq} query heads; tensor parallelism "
            f"shards query heads evenly, so use a world size that divides {hq}")
    if world_size <= hkv and hkv % world_size:
        raise InputError(
            f"cannot shard {hkv} KV heads over {world_size} ranks: {world_size} does not divide "
            f"{hkv}; use a world size that divides {hkv}, or a multiple of it to replicate KV heads")
    if world_size > hkv and world_size % hkv:
        raise InputError(
            f"cannot replicate {hkv} KV heads over {world_size} ranks: {world_size} is not a "
            f"multiple of {hkv}, so some rank's query heads would read two KV heads; use a world "
            f"size that divides {hkv} or is a multiple of it")


def shard_params(full: SparseAttentionParams, world_size: int) -> SparseAttentionParams:
    """The per-rank params of ``full`` at tensor-parallel size ``world_size`` (same on every rank).

    Only the head counts change; sizes, block policy and ``scale`` are kept
    (an unset ``scale`` still means ``head_dim ** -0.5``, identical per rank).

    Example:
        >>> full = SparseAttentionParams.minimax_m3()
        >>> p = shard_params(full, 4)
        >>> (p.num_heads, p.num_kv_heads, p.num_index_heads, p.gqa_group)
        (16, 1, 1, 16)
    """
    _check_world(full, world_size)
    kv_local = max(full.num_kv_heads // world_size, 1)
    fields = full.model_dump()
    fields.update(num_heads=full.num_heads // world_size, num_kv_heads=kv_local, num_index_heads=kv_local)
    # Rebuild rather than model_copy(update=...) so the validators run on the result.
    return SparseAttentionParams(**fields)


@dataclass(frozen=True)
class RankShard:
    """What one rank owns of a tensor-parallel sparse-attention layer.

    Build it with :func:`rank_shard`. Head ranges index the *full model's* heads.

    Attributes:
        rank, world_size: this rank and the tensor-parallel size.
        full: the full-model params.
        params: this rank's params (identical on every rank).
        q_heads: full-model query heads of this rank (contiguous).
        kv_heads: full-model KV heads this rank holds (one head when replicated).
        index_heads: full-model index heads this rank holds (always ``kv_heads``).
        kv_replicas: how many ranks hold each of these KV heads (1 = sharded).

    Example:
        >>> full = SparseAttentionParams(num_heads=16, num_kv_heads=4, head_dim=32,
        ...     num_index_heads=4, index_head_dim=32, block_size=16, topk=4)
        >>> s = rank_shard(full, rank=1, world_size=2)
        >>> s.q_heads, s.kv_heads, s.params.num_heads
        (range(8, 16), range(2, 4), 8)
    """

    rank: int
    world_size: int
    full: SparseAttentionParams
    params: SparseAttentionParams
    q_heads: range
    kv_heads: range
    index_heads: range
    kv_replicas: int

    @property
    def kv_replicated(self) -> bool:
        """True when other ranks hold the same KV head (world size > KV heads)."""
        return self.kv_replicas > 1

    # -- slicing full-model tensors ------------------------------------------------------
    def slice_q(self, q: torch.Tensor) -> torch.Tensor:
        """This rank's query heads of a full ``[T, Hq, D]`` tensor (a contiguous copy).

        Works for anything laid out like ``q``, e.g. a full-model output.
        """
        f = self.full
        _expect_3d("q", q, f.num_heads, f.head_dim, "[num_tokens, num_heads, head_dim] of the full model")
        # Contiguous because a rank's projection would produce a dense tensor, and
        # backends may assume unit stride over D with packed heads.
        return q[:, self.q_heads.start:self.q_heads.stop].contiguous()

    def slice_index_q(self, index_q: torch.Tensor) -> torch.Tensor:
        """This rank's index heads of a full ``[T, Hidx, Di]`` tensor (a contiguous copy)."""
        f = self.full
        _expect_3d("index_q", index_q, f.num_index_heads, f.index_head_dim,
                   "[num_tokens, num_index_heads, index_head_dim] of the full model")
        return index_q[:, self.index_heads.start:self.index_heads.stop].contiguous()

    def slice_caches(self, caches: PagedKVCache, *, contiguous: bool = False) -> PagedKVCache:
        """This rank's KV heads of full-model paged caches; the index cache is shared unchanged.

        By default ``k``/``v`` are strided views (no copy; backends read any
        strides). ``contiguous=True`` copies them into compact per-rank caches
        in the same page layout (NHD or HND), as an engine would allocate them.
        """
        if not isinstance(caches, PagedKVCache):
            raise InputError(f"caches must be an mm3.PagedKVCache, got {type(caches).__name__}")
        f = self.full
        if caches.num_kv_heads != f.num_kv_heads or caches.head_dim != f.head_dim:
            raise InputError(
                f"caches hold {caches.num_kv_heads} KV heads of dim {caches.head_dim}; the full model "
                f"has {f.num_kv_heads} of dim {f.head_dim}. Pass the full-model caches (already "
                f"per-rank caches need no slicing)")
        sl = slice(self.kv_heads.start, self.kv_heads.stop)
        k, v = caches.k[:, :, sl], caches.v[:, :, sl]
        # fp8 K/V: the scales of this rank's heads (views of the full-model ones)
        ks, vs = ((s[sl] if isinstance(s, torch.Tensor) else None) for s in (caches.k_scale, caches.v_scale))
        # NVFP4 K/V: this rank's heads of the block scales; the format goes with the cache (docs/spec.md §1)
        kb, vb = ((s[:, :, sl] if s is not None else None) for s in (caches.k_block_scale, caches.v_block_scale))
        quant = dict(kv_format=caches.kv_format, k_block_scale=kb, v_block_scale=vb,
                     index_block_scale=caches.index_block_scale)
        shard = PagedKVCache(k, v, caches.index, ks, vs, **quant)
        return shard.to_layout(caches.kv_layout) if contiguous else shard

    def slice_inputs(self, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache, *,
                     contiguous_caches: bool = False) -> tuple[torch.Tensor, torch.Tensor, PagedKVCache]:
        """``(slice_q(q), slice_index_q(index_q), slice_caches(caches))`` in one call."""
        if q.shape[:1] != index_q.shape[:1]:
            raise InputError(f"q has {q.shape[0]} tokens but index_q has {index_q.shape[0]}")
        return (self.slice_q(q), self.slice_index_q(index_q),
                self.slice_caches(caches, contiguous=contiguous_caches))


def _expect_3d(name: str, t: object, heads: int, dim: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3 or tuple(t.shape[1:]) != (heads, dim):
        raise InputError(f"{name} has shape {tuple(t.shape)}, expected [T, {heads}, {dim}] = {what}")


def rank_shard(full: SparseAttentionParams, rank: int, world_size: int) -> RankShard:
    """The heads and params rank ``rank`` of ``world_size`` owns (see the module docstring's rule).

    Example:
        >>> s = rank_shard(SparseAttentionParams.minimax_m3(), rank=3, world_size=4)
        >>> s.q_heads, s.kv_heads, s.kv_replicated
        (range(48, 64), range(3, 4), False)
    """
    params = shard_params(full, world_size)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise InputError(f"rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise InputError(f"rank {rank!r} is out of range for world_size {world_size}; ranks are "
                         f"0 .. {world_size - 1}")
    hq_local = params.num_heads
    hkv = full.num_kv_heads
    if world_size <= hkv:
        kv_local, replicas = hkv // world_size, 1
        kv = range(rank * kv_local, (rank + 1) * kv_local)
    else:
        replicas = world_size // hkv
        kv = range(rank // replicas, rank // replicas + 1)
    q = range(rank * hq_local, (rank + 1) * hq_local)
    # The rank's query heads must read only its KV heads (GQA: query head g uses g // G).
    G = full.gqa_group
    assert q.start // G == kv.start and (q.stop - 1) // G == kv.stop - 1, (q, kv, G)
    return RankShard(rank=rank, world_size=world_size, full=full, params=params,
                     q_heads=q, kv_heads=kv, index_heads=kv, kv_replicas=replicas)


def all_rank_shards(full: SparseAttentionParams, world_size: int) -> list[RankShard]:
    """:func:`rank_shard` for every rank ``0 .. world_size-1`` (for planning and tests)."""
    return [rank_shard(full, r, world_size) for r in range(world_size)]


def concat_heads(outputs: Sequence[torch.Tensor], full: SparseAttentionParams) -> torch.Tensor:
    """Concatenate per-rank outputs ``[T, Hq/W, D]`` (in rank order) into ``[T, Hq, D]``.

    The pure, communication-free counterpart of :func:`gather_heads`.

    Example:
        >>> full = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=8,
        ...     num_index_heads=2, index_head_dim=8)
        >>> parts = [torch.full((3, 2, 8), float(r)) for r in range(2)]
        >>> concat_heads(parts, full)[0, :, 0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Sequence) or not outputs:
        raise InputError("outputs must be a non-empty list of per-rank [T, Hq_local, D] tensors, in rank order")
    local = shard_params(full, len(outputs))
    T = outputs[0].shape[0] if isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 3 else -1
    for r, o in enumerate(outputs):
        _expect_3d(f"outputs[{r}]", o, local.num_heads, local.head_dim,
                   f"rank {r}'s output [num_tokens, num_heads / {len(outputs)}, head_dim]")
        if o.shape[0] != T:
            raise InputError(f"outputs[{r}] has {o.shape[0]} tokens but outputs[0] has {T}; every rank "
                             f"runs the same step")
    return torch.cat(list(outputs), dim=1)


def gather_heads(local_out: torch.Tensor, shard: RankShard,
                 group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather every rank's ``[T, Hq/W, D]`` output into the full ``[T, Hq, D]`` on every rank.

    A collective: every rank of ``group`` must call it with the same ``T``.
    Runs on whatever backend ``group`` uses (NCCL with GPU tensors, gloo with
    CPU tensors). A served model would not gather - its row-parallel output
    projection reduces instead - but checks, tests and debugging need the
    full tensor.

    Example (inside an initialised process group)::

        shard = rank_shard(full, dist.get_rank(), dist.get_world_size())
        out_local = layer(*shard.slice_inputs(q, index_q, caches), batch)
        out = gather_heads(out_local, shard)     # [T, Hq, D] on every rank
    """
    if not isinstance(shard, RankShard):
        raise InputError(f"shard must be a RankShard (rank_shard(...)), got {type(shard).__name__}")
    p = shard.params
    _expect_3d("local_out", local_out, p.num_heads, p.head_dim,
               f"this rank's output [num_tokens, {p.num_heads}, {p.head_dim}]")
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError("gather_heads needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group); use concat_heads for a list of outputs")
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    if (ws, rank) != (shard.world_size, shard.rank):
        raise InputError(f"shard is rank {shard.rank} of {shard.world_size} but the process group says "
                         f"rank {rank} of {ws}; build the shard from the same group")
    T = local_out.shape[0]
    # One allocation: gather into [W, T, Hl, D] slices, then interleave heads rank by rank.
    buf = local_out.new_empty((ws, T, p.num_heads, p.head_dim))
    dist.all_gather(list(buf.unbind(0)), local_out.contiguous(), group=group)
    return buf.permute(1, 0, 2, 3).reshape(T, ws * p.num_heads, p.head_dim)


class TensorParallelSparseAttention:
    """One rank's share of a tensor-parallel sparse-attention layer.

    Builds the rank's :class:`~mm3.runtime.layer.SparseAttention` from the full-model
    params; backend selection goes through the registry and settings as for
    any layer (each rank decides for its own device). Inputs to :meth:`forward`
    are this rank's tensors - as a sharded model produces them - and so is the
    output; :meth:`shard_inputs` cuts them from full-model tensors and
    :meth:`gather` reassembles the full output.

    Args:
        full_params: the full model's params (e.g. ``SparseAttentionParams.minimax_m3()``).
        rank, world_size: this rank and the tensor-parallel size; when both are
            ``None`` they are read from ``group`` (``torch.distributed`` must be initialised).
        group: the tensor-parallel process group (default: the world).
        Remaining keyword arguments are those of :class:`~mm3.runtime.layer.SparseAttention`.

    Example (rank 0 of 2, given without a process group; under ``torchrun`` leave both out):
        >>> from mm3.testing.factories import make_case
        >>> full = SparseAttentionParams(num_heads=8, num_kv_heads=4, head_dim=16, num_index_heads=4,
        ...                              index_head_dim=16, block_size=16, topk=4)
        >>> tp = TensorParallelSparseAttention(full, rank=0, world_size=2, dtype=torch.float32,
        ...                                    max_num_tokens=16, backend="cpu_ref")
        >>> case = make_case(full, decodes=[40], prefills=[(3, 20)], dtype="float32")
        >>> q_l, iq_l, caches_l = tp.shard_inputs(case.q, case.index_q, case.caches)   # full -> this rank
        >>> tp(q_l, iq_l, caches_l, case.batch).shape                                  # this rank's heads
        torch.Size([4, 4, 16])
    """

    def __init__(self, full_params: SparseAttentionParams, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
                 device: DeviceLike = "cpu", dtype: torch.dtype = torch.bfloat16,
                 index_dtype: Union[torch.dtype, str] = torch.bfloat16, max_num_tokens: int = 8192,
                 max_decode_query_len: int = 1, backend: Optional[str] = None,
                 indexer_backend: Optional[str] = None, settings: Optional["Settings"] = None,
                 registry: Optional["Registry"] = None, cuda_graph: bool = False,
                 kv_dtype: Union[torch.dtype, str, None] = None, q_dtype: Optional[torch.dtype] = None) -> None:
        if (rank is None) != (world_size is None):
            raise InputError("give both rank and world_size, or neither (to read them from the process group)")
        if rank is None or world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise InputError("rank/world_size not given and torch.distributed is not initialised; call "
                                 "init_process_group first or pass rank= and world_size=")
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.shard: RankShard = rank_shard(full_params, rank, world_size)
        self.group = group
        self.layer: SparseAttention = SparseAttention(
            self.shard.params, device=device, dtype=dtype, index_dtype=index_dtype,
            max_num_tokens=max_num_tokens, max_decode_query_len=max_decode_query_len, backend=backend,
            indexer_backend=indexer_backend, settings=settings, registry=registry, cuda_graph=cuda_graph,
            kv_dtype=kv_dtype, q_dtype=q_dtype)

    @property
    def params(self) -> SparseAttentionParams:
        """This rank's params."""
        return self.shard.params

    @property
    def full_params(self) -> SparseAttentionParams:
        return self.shard.full

    @property
    def selection(self) -> "Selection":
        """This rank's backend choice (see :attr:`SparseAttention.selection`)."""
        return self.layer.selection

    def explain(self) -> str:
        """This rank's selection trace."""
        return self.layer.explain()

    def shard_inputs(self, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache, *,
                     contiguous_caches: bool = False) -> tuple[torch.Tensor, torch.Tensor, PagedKVCache]:
        """This rank's slices of full-model ``q``, ``index_q`` and caches (:meth:`RankShard.slice_inputs`)."""
        return self.shard.slice_inputs(q, index_q, caches, contiguous_caches=contiguous_caches)

    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache,
                batch: "BatchMetadata", out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run this rank's heads for one step: per-rank inputs in, ``[T, Hq/W, D]`` out."""
        return self.layer.forward(q, index_q, caches, batch, out)

    __call__ = forward

    def gather(self, local_out: torch.Tensor) -> torch.Tensor:
        """All-gather the ranks' outputs into ``[T, Hq, D]`` (a collective; see :func:`gather_heads`)."""
        return gather_heads(local_out, self.shard, self.group)

    def __repr__(self) -> str:
        s = self.shard
        return (f"TensorParallelSparseAttention(rank={s.rank}/{s.world_size}, q_heads={s.q_heads}, "
                f"kv_heads={s.kv_heads}, layer={self.layer!r})")
