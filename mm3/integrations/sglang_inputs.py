"""SGLang's MiniMax-M3 arguments as mm3's objects: pages from ``req_to_token``, the caches, the batches.

What :mod:`mm3.integrations.sglang` builds from the tensors SGLang passes, on
their device and without a device-to-host copy: the block table of 128-token
pages (``req_to_token[slot_ids[b], 128 * j] // 128``, or a batch-local
``page_table``) with a device-side check that every block is one aligned page
of contiguous slots, or, for any other ``page_size``, the token slots
``req_to_token``/``slot_ids`` as they are (:mod:`mm3.contract.slots`), the paged views of SGLang's token-major
``[slots, num_kv_heads, head_dim]`` K/V and ``[slots, 1, idx_head_dim]`` index
caches (no copy), their per-tensor scales, decode and prefill batches, and the
ascending top-k order of SGLang's rows (:data:`ORDER`, which the core
establishes). Every error is an
:class:`~mm3.InputError` naming SGLang's function and argument.

Example:
    >>> import torch
    >>> r2t = torch.zeros(4, 64, dtype=torch.int32)
    >>> r2t[2, :40] = torch.arange(40, dtype=torch.int32) + 48         # slot 2: pages 3, 4, 5 of 16 tokens
    >>> bt, _ = block_table("f", r2t, torch.tensor([2]), None, 16, 16, 40, torch.tensor([40]), 8)
    >>> bt.tolist()
    [[3, 4, 5]]
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.contents import NO_FAULT, FaultFlag
from mm3.contract.errors import InputError
from mm3.contract.facts import ArgNames
from mm3.contract.slots import TokenSlots
from mm3.debug.guard import capturing
from mm3.integrations.vllm_inputs import decode_batch as vllm_decode_batch
from mm3.integrations.vllm_inputs import kept, stand_in, tensor_arg

__all__ = ["RELEASE", "names", "refuse", "refusals", "one_index_head", "int_arg", "tensor_arg", "positive", "block_table",
           "uses_slots", "page_rows", "token_slots", "addressing", "pages", "fault_word", "record_pages",
           "on_host", "kv_caches", "index_caches", "decode_batch", "prefill_batch", "topk_arg", "ORDER",
           "widen"]

RELEASE = "0.5.23"
"""The SGLang release whose signatures :mod:`mm3.integrations.sglang` serves."""

ORDER = "ascending"
"""The order of a top-k row at SGLang's functions: the ids its attention reads and its callers get back
increase, ``-1`` last (its kernels read the first ``count(ids >= 0)`` entries in that order). The step's plan
sorts rows an indexer writes in another order (:mod:`mm3.contract.topk_order`)."""

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: a page check's findings on the device, per row: ``(faulty, fault word)`` (:func:`pages`)
Faults = tuple[torch.Tensor, torch.Tensor]
_FNUZ = tuple(d for d in (getattr(torch, n, None) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz")) if d is not None)


@functools.lru_cache(maxsize=None)
def names(block_size: int, page_table: bool, prefill: bool) -> ArgNames:
    """SGLang's spelling of a call's arguments (errors name these; token slots: ``req_to_token`` and
    ``slot_ids``, or ``page_table`` and its rows); made once per kind of call."""
    pages = "page_table" if page_table else (
        f"the page ids of req_to_token[slot_ids] (each {block_size}-token block must be {block_size} "
        f"contiguous slots of one aligned page: serve SGLang with --page-size {block_size})")
    made = "SGLang's ForwardBatch (seq_lens, req_pool_indices, extend_seq_lens, extend_prefix_lens)"
    return ArgNames(q="q", index_q="idx_q", out="the output o", topk="topk_idx", k="k_cache", v="v_cache",
                    index="idx_k_cache", k_scale="k_scale", v_scale="v_scale",
                    query_start_loc="cu_seqlens" if prefill else "the rows of q (one query token each)",
                    seq_lens="seq_lens", context_lens="prefix_lens", block_table=pages,
                    token_to_request="the tokens' requests (from cu_seqlens)",
                    token_positions="the tokens' positions (from seq_lens)", where_made=made,
                    slot_table="page_table" if page_table else "req_to_token",
                    slot_rows="the rows of page_table" if page_table else "slot_ids")


def refuse(fn: str, arg: str, value: object, why: str, advice: str) -> InputError:
    """The error of an argument value mm3 does not serve: what, why, and what to do in SGLang's terms."""
    return InputError(f"{fn} (SGLang {RELEASE}): {arg}={value!r} is not served: {why}; {advice}")


# -- arguments ---------------------------------------------------------------------------------

def int_arg(fn: str, name: str, t: object, dim: int, what: str) -> torch.Tensor:
    """An int32 or int64 tensor (SGLang keeps both) as int32 (a copy only for int64)."""
    t = tensor_arg(fn, name, t, dim, what)
    if t.dtype not in (torch.int32, torch.int64):
        raise InputError(f"{fn}: {name} must be int32 or int64, got {t.dtype}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def positive(fn: str, name: str, value: object, default: float = 1.0) -> float:
    """A per-tensor scale SGLang passes as an optional float (``None``: ``default``), checked on the host."""
    if value is None:
        return default
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        if value.device.type != "cpu":   # its value read on the host every call: a device sync in the step
            raise InputError(f"{fn}: {name} is a one-element tensor on {value.device}, whose value the host would "
                             f"wait for at every call; pass the float SGLang keeps (layer.k_scale_float, "
                             f"layer.v_scale_float) or a CPU tensor")
        value = float(value)     # SGLang passes floats (layer.k_scale_float); a host tensor reads without a wait
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < float(value) < float("inf")):
        raise InputError(f"{fn}: {name} must be a finite float > 0 or None, got {value!r}")
    return float(value)


def widen(t: torch.Tensor) -> torch.Tensor:
    """fp8 queries (SGLang's fp8 attention-GEMM mode) as bfloat16, exactly: mm3's queries are 16-bit."""
    return t.to(torch.bfloat16) if t.dtype in _FP8 else t


# -- what is not served ------------------------------------------------------------------------

def refusals(fn: str, *, score_type: object = "max", sink: object = None, idx_sink: object = None,
            disable_index_value: object = True, block_size_q: object = 1, page_size: object = None,
            block_size_k: int, hooks: tuple[tuple[str, object], ...] = ()) -> None:
    """The refusals every function shares, each naming SGLang's argument and what to do instead (``hooks``:
    SGLang's handles into its other kernels, served only when ``None``/``False``)."""
    if score_type != "max":
        raise refuse(fn, "score_type", score_type, "mm3's indexer scores a block by the max of its token scores "
                     "(docs/spec.md §3), not by their log-sum-exp", "run the layer with score_type='max', "
                     "MiniMax-M3's setting")
    for name, value in (("sink", sink), ("idx_sink", idx_sink)):
        if value is not None:
            raise refuse(fn, name, "<tensor>", "mm3's attention has no attention-sink logit (released "
                         "MiniMax-M3 has no sink)", f"pass {name}=None")
    if disable_index_value is not True:
        raise refuse(fn, "disable_index_value", disable_index_value, "the index value branch (idx_v_cache -> "
                     "idx_o) is an attention mm3 does not compute; released MiniMax-M3 uses none", "pass "
                     "disable_index_value=True (the layer is in SGLang's disable_value_layer_ids) and "
                     "idx_v_cache=None")
    if block_size_q != 1:
        raise refuse(fn, "block_size_q", block_size_q, "mm3 selects blocks per query token", "pass "
                     "block_size_q=1, SGLang's value on the GPU path")
    if not isinstance(block_size_k, int) or block_size_k < 1:
        raise InputError(f"{fn}: block_size_k must be a positive int, got {block_size_k!r}")
    if page_size is not None and (not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 0):
        raise refuse(fn, "page_size", page_size, "a page holds a whole number of tokens", f"pass SGLang's "
                     f"--page-size: a multiple of block_size_k={block_size_k} (pages), or 1 (token slots)")
    for name, value in hooks:
        if value is not None and value is not False:
            raise refuse(fn, name, value if isinstance(value, bool) else "<given>", "it hands the work to "
                         "another SGLang kernel or remaps slots that mm3's kernels do not read", f"pass "
                         f"{name}={'False' if isinstance(value, bool) else 'None'}")


def one_index_head(fn: str, idx_heads: int, kv_heads: int) -> None:
    """mm3 selects with one index head per KV head."""
    if idx_heads != kv_heads:
        raise refuse(fn, "idx_q.shape[1]", idx_heads, f"mm3 selects blocks with one index head per KV head "
                     f"(k_cache has {kv_heads}); SGLang's union of several index heads' blocks is not served",
                     "run a model with num_idx_heads == num_kv_heads per rank, as released MiniMax-M3")


# -- pages ---------------------------------------------------------------------------------------

def uses_slots(page_size: Optional[int], block_size: int) -> bool:
    """Whether a call reads its tokens through token slots: a ``page_size`` that does not hold whole
    ``block_size``-token blocks (1, SGLang's default; 0, the kernel-level attention's "unknown"; any
    other), so a block is not one page. ``None`` (a function without the argument) reads pages."""
    return page_size is not None and (page_size == 0 or page_size % block_size != 0)


def page_rows(page_size: Optional[int], block_size: int) -> int:
    """The tokens of a cache page mm3 reads: a block (pages), or one (token slots)."""
    return 1 if uses_slots(page_size, block_size) else block_size


def token_slots(fn: str, req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor],
                page_table: Optional[torch.Tensor], page_size: int, max_seqlen: Optional[int],
                seq_lens: torch.Tensor) -> TokenSlots:
    """The token slots of a call (docs/spec.md §2), used as they are: ``req_to_token`` (its first
    ``max_seqlen`` columns, a view) with each row's ``slot_ids``, or a ``page_table`` of one-token pages
    (``page_size=1``), row ``b`` for row ``b``. Nothing is copied or read on the host."""
    R = seq_lens.shape[0]
    if page_table is not None:
        if page_size != 1:
            raise refuse(fn, "page_size", page_size, "mm3 reads a page_table of whole sparse blocks (pages) or of "
                         "one-token pages (token slots), not of pages in between", "pass req_to_token and "
                         "slot_ids instead, or serve with --page-size 1 or 128")
        pt = tensor_arg(fn, "page_table", page_table, 2, "[batch, max_context_len]")
        if pt.shape[0] != R:
            raise InputError(f"{fn}: page_table has {pt.shape[0]} rows for {R} requests (seq_lens)")
        rows = torch.arange(R, device=pt.device)
        return TokenSlots.of(pt, rows, "page_table", "the rows of page_table")
    r2t = tensor_arg(fn, "req_to_token", req_to_token, 2, "[max_reqs, max_context_len]")
    sid = tensor_arg(fn, "slot_ids", slot_ids, 1, "[batch]")
    if sid.shape[0] != R:
        raise InputError(f"{fn}: slot_ids has {sid.shape[0]} rows for {R} requests (seq_lens)")
    if max_seqlen is not None and 0 <= int(max_seqlen) < r2t.shape[1]:
        r2t = r2t[:, :int(max_seqlen)]     # a view: the columns a request of this call may use
    return TokenSlots.of(r2t, sid, "req_to_token", "slot_ids")


def addressing(fn: str, req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor],
               page_table: Optional[torch.Tensor], seq_lens: torch.Tensor, max_seqlen: Optional[int],
               block_size: int, page_size: Optional[int],
               num_pages: int) -> tuple[torch.Tensor, Optional[Faults], Optional[TokenSlots]]:
    """``(block table, faults, token slots)``: pages (a table of ``block_size``-token pages derived on the
    device, with the faults of its contiguity check, :func:`pages`; none for a ``page_table``), or token
    slots (an empty block table, no faults)."""
    if uses_slots(page_size, block_size):
        slots = token_slots(fn, req_to_token, slot_ids, page_table, page_size, max_seqlen,  # type: ignore[arg-type]
                            seq_lens)
        return seq_lens.new_empty((seq_lens.shape[0], 0), dtype=torch.int32), None, slots
    if max_seqlen is None:    # no bound given: every column of the table
        max_seqlen = req_to_token.shape[1] if isinstance(req_to_token, torch.Tensor) else 0
    if page_table is not None:
        return block_table(fn, req_to_token, slot_ids, page_table, block_size, page_size or block_size, max_seqlen,
                           seq_lens, num_pages)[0], None, None
    bt, faults = pages(fn, req_to_token, slot_ids, block_size, max_seqlen, seq_lens)
    return bt, faults, None


def on_host(t: torch.Tensor) -> bool:
    """Whether the addressing lives in host memory (its pages are then checked there, at once)."""
    return t.device.type == "cpu"


def block_table(fn: str, req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor],
                page_table: Optional[torch.Tensor], block_size: int, page_size: int, max_seqlen: int,
                seq_lens: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(block table, fault word)``: each row's pages of ``block_size`` tokens as int32, on the device.

    From ``page_table`` (``[batch, max_pages]``, ids of ``page_size``-token pages) when given; else
    ``req_to_token[slot_ids[b], block_size * j] // block_size`` for ``j < cdiv(max_seqlen, block_size)``,
    with the fault word (``request << 32 | block`` of the first block that is not one aligned page of
    contiguous slots, else ``NO_FAULT``) computed by torch ops, or raised at once for a host table."""
    R, B = seq_lens.shape[0], block_size
    if page_table is not None:
        pt = int_arg(fn, "page_table", page_table, 2, "[batch, max_pages]")
        if pt.shape[0] != R:
            raise InputError(f"{fn}: page_table has {pt.shape[0]} rows for {R} requests (seq_lens)")
        m = page_size // B
        if m == 1:
            return pt, None
        # pages of m blocks: block j of a row is block j % m of page j // m
        return (pt.repeat_interleave(m, dim=1) * m + torch.arange(m, dtype=torch.int32, device=pt.device)
                .repeat(pt.shape[1])), None
    bt, faults = pages(fn, req_to_token, slot_ids, B, max_seqlen, seq_lens)
    return bt, None if faults is None else fault_word(faults)


#: what a row without a faulty slot scores in :func:`pages`' search (no position reaches it)
_NONE = 2 ** 31 - 1


def pages(fn: str, req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor], block_size: int,
          max_seqlen: int, seq_lens: torch.Tensor) -> tuple[torch.Tensor, Optional[Faults]]:
    """``(block table, faults)`` of ``req_to_token``/``slot_ids`` as pages of ``block_size`` tokens: each row's
    pages ``req_to_token[slot_ids[b], block_size * j] // block_size`` (int32), ``j < cdiv(max_seqlen,
    block_size)``, and on the device ``(faulty, word)`` (``[R]`` each): whether row ``b`` uses a slot that
    is not ``block_size * page + offset`` of its block's page (a misaligned block fails at offset 0), and
    ``b << 32 | block`` of its first such block (:func:`fault_word`, :func:`record_pages`). A table in host
    memory is checked at once (``faults`` None). Every call runs this, so it makes few passes over the
    ``[R, blocks, block_size]`` slots: two subtractions and a cast find the bad slots; each row's first is
    ``min(where(bad, position, _NONE))``, as one fused multiply-add on kept constants and one reduction;
    the rest is on ``[R]`` (a bad slot counts below ``seq_len``, int32, which ``_NONE`` never is below)."""
    R, B = seq_lens.shape[0], block_size
    r2t = tensor_arg(fn, "req_to_token", req_to_token, 2, "[max_reqs, max_context_len]")
    sid = tensor_arg(fn, "slot_ids", slot_ids, 1, "[batch]")
    if r2t.dtype not in (torch.int32, torch.int64) or sid.dtype not in (torch.int32, torch.int64):
        raise InputError(f"{fn}: req_to_token ({r2t.dtype}) and slot_ids ({sid.dtype}) must be integer tensors")
    if sid.shape[0] != R:
        raise InputError(f"{fn}: slot_ids has {sid.shape[0]} rows for {R} requests (seq_lens)")
    cols = -(-min(max(int(max_seqlen), 0), r2t.shape[1]) // B)
    width = cols * B
    # slot ids wrap as SGLang's kernels read them (a padding row's may be -1): never an index outside the table
    rows = r2t[:, :width].index_select(0, sid.remainder(max(r2t.shape[0], 1)))
    if rows.shape[1] < width:                                          # a context not a multiple of B
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)
    blocks = rows.view(R, cols, B)
    page = blocks[:, :, 0].div(B, rounding_mode="floor")
    bt = page if page.dtype == torch.int32 else page.to(torch.int32)
    if not (R and cols):
        return bt, None
    dev, host, graph = rows.device, on_host(rows), capturing(rows)
    offs, to_none, none = _page_constants(B, cols, rows.dtype, dev, graph)
    # slot - B * page - offset != 0 (two subtractions and a cast cost a CPU a third of one comparison)
    bad = torch.sub(blocks, page.unsqueeze(2), alpha=B).sub_(offs).bool()
    # each row's first bad position (its slots in order), else _NONE: where(bad, position, _NONE), fused
    first = torch.addcmul(none, to_none, bad, value=-1).amin(dim=(1, 2))
    faulty = first < seq_lens          # a bad slot counts where the row's seq_len uses it
    if host:
        if bool(faulty.any()):
            r = int(faulty.nonzero()[0])
            j, i = divmod(int(first[r]), B)
            s = int(sid[r])
            raise InputError(
                f"{fn}: req_to_token[{s}, {B * j}:{B * (j + 1)}] (request {r}'s block {j}) is not one aligned "
                f"{B}-slot page: req_to_token[{s}, {B * j + i}] = {int(rows[r, B * j + i])}, expected "
                f"{B * (int(rows[r, B * j]) // B) + i}; mm3 reads {B}-token pages: serve SGLang with "
                f"--page-size {B}, or pass page_size=1 so mm3 reads req_to_token per token (token slots)")
        return bt, None
    (req_word,) = kept(("page rows", R, dev), graph, _request_words, R, dev)
    return bt, (faulty, req_word | first.div(B, rounding_mode="floor"))


def fault_word(faults: Faults) -> torch.Tensor:
    """The least fault word of :func:`pages`' ``faults`` (``NO_FAULT`` when none), a 0-d int64 tensor."""
    return torch.where(faults[0], faults[1], NO_FAULT).amin()


def _page_constants(B: int, cols: int, dtype: torch.dtype, device: torch.device,
                    graph: bool) -> tuple[torch.Tensor, ...]:
    """What :func:`pages` computes with: each slot's offset in its page ``[B]`` (the slots' dtype), ``_NONE``
    minus each slot's position in the row ``[cols, B]`` and ``_NONE`` ``[1]`` (int32). Views of constants kept
    for a power of two of blocks: ``cols`` follows the longest context, which changes every step, and a set
    kept per value would grow with each new one (their sizes add up to twice the largest at most)."""
    cap = 1 << max(cols - 1, 0).bit_length()
    offs, to_none, none = kept(("pages", B, cap, dtype, device), graph, _make_page_constants, B, cap, dtype, device)
    return (offs, to_none, none) if cols == cap else (offs, to_none[:cols], none)


def _make_page_constants(B: int, cols: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.arange(B, dtype=dtype, device=device),
            (_NONE - torch.arange(cols * B, dtype=torch.int32, device=device)).view(cols, B),
            torch.full((1,), _NONE, dtype=torch.int32, device=device))


def _request_words(R: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each request's part of a fault word, ``request << 32``, as ``[R]``."""
    return (torch.arange(R, dtype=torch.int64, device=device) << 32,)


def record_pages(flag: FaultFlag, faults: Optional[Faults], fn: str, arg_names: ArgNames, batch: BatchMetadata,
                 num_pages: int, graph: bool) -> None:
    """Lower ``flag``'s word to the least of :func:`pages`' ``faults`` (no host sync): the fault is raised at the
    target's next eager call (:func:`mm3.integrations.targets.check_page_ids` after graph replays)."""
    if faults is None:
        return
    flag.about(fn, arg_names, num_pages, batch)
    torch.amin(torch.where(faults[0], faults[1], flag.word), dim=0, keepdim=True, out=flag.word)
    if not graph:
        flag.after_step()


# -- caches --------------------------------------------------------------------------------------
def _scale(value: float, heads: int, device: torch.device, graph: bool) -> torch.Tensor:
    """A per-tensor scale as the ``[Hkv]`` float32 view a cache keeps; kept when made outside capture."""
    return kept(("scale", value, heads, device), graph, _make_scale, value, heads, device)[0]


def _make_scale(value: float, heads: int, device: torch.device) -> tuple[torch.Tensor]:
    return (torch.full((1,), value, dtype=torch.float32, device=device).expand(heads),)


def _pages_of(fn: str, name: str, t: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[slots, ...]`` as ``[slots / B, B, ...]``: a view, whatever the strides (one op)."""
    n = t.shape[0]
    if n % block_size:
        raise InputError(f"{fn}: {name} has {n} slots, not a multiple of block_size_k={block_size}: mm3 "
                         f"reads it as pages of {block_size} tokens (SGLang's pool with --page-size {block_size} "
                         f"holds whole pages)")
    st = t.stride()
    return t.as_strided((n // block_size, block_size, *t.shape[1:]), (block_size * st[0], *st), t.storage_offset())


def index_caches(fn: str, idx_k_cache: torch.Tensor, heads: int, block_size: int, graph: bool,
                 kv: Optional[tuple[torch.Tensor, ...]] = None, dtype: torch.dtype = torch.bfloat16) -> PagedKVCache:
    """SGLang's index key cache ``[slots, 1, idx_head_dim]`` as ``[pages, B, idx_head_dim]``; K/V are ``kv``,
    else a one-element stand-in an index op never reads (``graph``: the call is being captured)."""
    tensor_arg(fn, "idx_k_cache", idx_k_cache, 3, "[max_slots, 1, idx_head_dim]")
    if idx_k_cache.shape[1] != 1:
        raise InputError(f"{fn}: idx_k_cache has {idx_k_cache.shape[1]} heads; MiniMax-M3's index keys have one "
                         f"head, shared by every index head")
    n, _, Di = idx_k_cache.shape
    if n % block_size:
        _pages_of(fn, "idx_k_cache", idx_k_cache, block_size)      # raises
    st = idx_k_cache.stride()     # its one head's [pages, B, Di] view, in one op
    index = idx_k_cache.as_strided((n // block_size, block_size, Di), (block_size * st[0], st[0], st[2]),
                                   idx_k_cache.storage_offset())
    if kv is None:
        P, B, Di = index.shape
        dev, shape = index.device, (P, B, heads, Di)
        (one,) = kept(("stand-in", dtype, dev, shape), graph, stand_in, dtype, dev, shape)
        return PagedKVCache.rewrap(one, one, index)
    return PagedKVCache.rewrap(kv[0], kv[1], index, *kv[2:])  # type: ignore[arg-type]


def kv_caches(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: object, v_scale: object,
              block_size: int, graph: bool) -> tuple[torch.Tensor, ...]:
    """``(k, v[, k_scale, v_scale])``: SGLang's ``[slots, num_kv_heads, head_dim]`` K/V as paged NHD views,
    and the ``[num_kv_heads]`` scales of an fp8 cache."""
    tensor_arg(fn, "k_cache", k_cache, 3, "[max_slots, num_kv_heads, head_dim]")
    tensor_arg(fn, "v_cache", v_cache, 3, "[max_slots, num_kv_heads, head_dim]")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise InputError(f"{fn}: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must agree in shape and dtype")
    if k_cache.dtype in _FNUZ:
        raise refuse(fn, "k_cache.dtype", k_cache.dtype, "mm3 reads fp8 K/V as float8_e4m3fn or float8_e5m2 "
                     "and has no fnuz path (the ROCm MI300 formats; vLLM's ROCm attention has no fnuz sparse "
                     "path either, vLLM #45562)", "serve the model with --kv-cache-dtype fp8_e4m3 (OCP e4m3fn) "
                     "or bf16")
    k, v = _pages_of(fn, "k_cache", k_cache, block_size), _pages_of(fn, "v_cache", v_cache, block_size)
    ks, vs = positive(fn, "k_scale", k_scale), positive(fn, "v_scale", v_scale)
    if k_cache.dtype not in _FP8:
        if (ks, vs) != (1.0, 1.0):
            raise refuse(fn, "k_scale/v_scale", (k_scale, v_scale), f"a {k_cache.dtype} K/V cache holds its "
                         f"values as they are (mm3 scales fp8 caches only)", "pass None for a 16-bit cache")
        return k, v
    H = k.shape[2]
    return k, v, _scale(ks, H, k.device, graph), _scale(vs, H, k.device, graph)


# -- the step's metadata -----------------------------------------------------------------------

def decode_batch(seq_lens: torch.Tensor, bt: torch.Tensor, block_size: int,
                 slots: Optional[TokenSlots] = None) -> BatchMetadata:
    """SGLang's decode rows as ``R`` one-token decodes at ``seq_len - 1`` (rows of one request share its
    pages: speculative verify rows each carry their own ``seq_len``); ``seq_len == 0`` is padding (pages:
    :func:`~mm3.integrations.vllm_inputs.decode_batch`'s batch, the same)."""
    R, dev = seq_lens.shape[0], seq_lens.device
    if slots is None:
        return vllm_decode_batch("SGLang decode", seq_lens, bt, 1, R, block_size, capturing(seq_lens))
    qsl, req = kept(("sglang decode", R, dev), capturing(seq_lens), _decode_constants, R, dev)
    return BatchMetadata.assemble(qsl, seq_lens, None, bt, req, seq_lens - 1, num_decodes=R, decode_query_len=1,
                                  num_decode_tokens=R, max_prefill_query_len=0, block_size=block_size,
                                  max_query_len=1 if R else 0, slots=slots)


def _decode_constants(R: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ar = torch.arange(R + 1, dtype=torch.int32, device=device)
    return ar, ar[:R]


def prefill_batch(fn: str, cu_seqlens: object, seq_lens: torch.Tensor, bt: torch.Tensor, num_tokens: int,
                  max_seqlen_q: int, block_size: int, prefix_lens: torch.Tensor,
                  slots: Optional[TokenSlots] = None) -> BatchMetadata:
    """An extend batch (chunked prefills; SGLang's mixed chunks and verify steps are extends too)."""
    cu = int_arg(fn, "cu_seqlens", cu_seqlens, 1, "[batch + 1]")
    try:
        return BatchMetadata.from_device(cu, seq_lens, bt, num_decodes=0, num_tokens=num_tokens,
                                         max_query_len=max_seqlen_q, block_size=block_size, context_lens=prefix_lens,
                                         slots=slots)
    except InputError as e:
        raise InputError(f"{fn}: {e} (query_start_loc is cu_seqlens, context_lens is prefix_lens)") from None


def topk_arg(fn: str, name: str, t: object, heads: int, rows: int) -> TopkBuffer:
    """SGLang's ``[num_kv_heads, rows, topk]`` int32 ids (any strides) as a :class:`~mm3.TopkBuffer`."""
    t = tensor_arg(fn, name, t, 3, "[num_kv_heads, num_tokens, topk]")
    if t.shape[0] != heads or t.shape[1] != rows:
        raise InputError(f"{fn}: {name} has shape {tuple(t.shape)}, needs [{heads}, {rows}, topk] "
                         f"(num_kv_heads, query tokens, topk)")
    try:
        return TopkBuffer(t)
    except InputError as e:
        raise InputError(f"{fn}: {name}: {e}") from None
