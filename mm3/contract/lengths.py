"""The host-side arguments of a batch built from per-request lengths, before any tensor is built.

Example:
    >>> check_lengths(to_int_list("query_lens", [1, 1, 5]), [300, 129, 5], num_decodes=2,
    ...               decode_query_len=None, block_size=128)
    1
    >>> to_int_list("seq_lens", [300, 30.5])
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: seq_lens[1] is 30.5: lengths count tokens, so they must be ints
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Union

import torch

from mm3.contract.errors import InputError

__all__ = ["IntSeq", "to_int_list", "check_lengths", "check_table", "INT32_MIN", "INT32_MAX"]

IntSeq = Union[Sequence[int], torch.Tensor]
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def to_int_list(name: str, v: IntSeq) -> list[int]:
    """``v`` (a 1-D integer tensor, or a sequence of ints) as a list; ``name`` is for the error.

    Each item must be an integer (``int``, a NumPy integer, a 0-d integer tensor): a float would
    be truncated, a string's characters or a bool's 0/1 would pass for lengths without a word.

    Example:
        >>> to_int_list("query_lens", "12")
        Traceback (most recent call last):
        ...
        mm3.contract.errors.InputError: query_lens is the string '12': pass the lengths as ints, e.g. [1, 2]
        >>> to_int_list("query_lens", [True, True, 5])
        Traceback (most recent call last):
        ...
        mm3.contract.errors.InputError: query_lens[0] is True, a bool: lengths count tokens, so they must be ints
    """
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
            raise InputError(f"{name} must be a 1-D integer tensor or list, got {v.dtype} {tuple(v.shape)}")
        return [int(x) for x in v.tolist()]
    if isinstance(v, (str, bytes)):
        raise InputError(f"{name} is the string {v!r}: pass the lengths as ints, e.g. [1, 2]")
    try:
        items = list(v)
    except TypeError as e:
        raise InputError(f"{name} must be a sequence of ints: {e}") from None
    out = []
    for r, x in enumerate(items):
        if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
            raise InputError(f"{name}[{r}] is {x!r}, a bool: lengths count tokens, so they must be ints")
        try:
            out.append(operator.index(x))   # ints only: int() would truncate 30.5 or parse "5"
        except TypeError:
            raise InputError(f"{name}[{r}] is {x!r}: lengths count tokens, so they must be ints") from None
    return out


def check_lengths(ql: list[int], sl: list[int], num_decodes: int, decode_query_len: Optional[int],
                  block_size: int) -> int:
    """The arguments of :meth:`~mm3.contract.batch.BatchMetadata.build` that are not a batch's contents: the
    decode count, the block size, lengths that fit int32, and the decodes' one query length (returned:
    ``decode_query_len``, or the decodes' own). What the lengths must say of a step (a seq_len at least
    its query, blocks that fit the table...) is the contents' rules', judged on the tensors built from
    them (:func:`mm3.contract.contents.check_on_host`), as for every batch."""
    n = len(ql)
    if not (0 <= num_decodes <= n):
        raise InputError(f"num_decodes={num_decodes} must be in [0, {n}] (number of requests)")
    if not isinstance(block_size, int) or block_size <= 0:
        raise InputError(f"block_size must be a positive int, got {block_size!r}")
    for r, (q, s) in enumerate(zip(ql, sl)):
        if max(q, s) > INT32_MAX or min(q, s) < INT32_MIN:
            raise InputError(f"request {r}: a length ({q}, {s}) does not fit int32 (max {INT32_MAX})")
    dec_q = sorted({q for q in ql[:num_decodes] if q > 0})
    if len(dec_q) > 1:
        longest = next(r for r in range(num_decodes) if ql[r] == dec_q[-1])
        raise InputError(
            f"decode query lengths must be uniform (1, or 1 + draft tokens) or 0 for padding; "
            f"got lengths {dec_q} among the first num_decodes={num_decodes} requests. If request "
            f"{longest} (query_len {dec_q[-1]}) is a prefill, the batch is not decode-first: put every "
            f"decode before the first prefill (is_decode= checks the order); otherwise run speculative "
            f"and plain decodes with the same length")
    if decode_query_len is None:
        decode_query_len = dec_q[0] if dec_q else 1
    elif dec_q and dec_q[0] != decode_query_len:
        raise InputError(f"decodes have query length {dec_q[0]} but decode_query_len={decode_query_len}")
    if decode_query_len < 1:
        raise InputError(f"decode_query_len must be >= 1, got {decode_query_len}")
    return decode_query_len


def check_table(block_table: object, n: int) -> torch.Tensor:
    """:meth:`~mm3.contract.batch.BatchMetadata.build`'s ``block_table`` as a 2-D integer tensor of ``n``
    rows whose ids fit int32 (one host read of a wider table's range, only here)."""
    if not isinstance(block_table, torch.Tensor):
        try:  # no dtype here: a float list must be rejected below, not truncated
            block_table = torch.as_tensor(block_table)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"block_table must be a 2-D integer tensor or a rectangular nested list "
                             f"of ints: {e}") from None
        if block_table.numel() == 0:
            block_table = block_table.to(torch.int32)  # [] / [[]] carry no dtype information
    if block_table.dim() != 2 or block_table.shape[0] != n:
        raise InputError(f"block_table must be [num_requests={n}, max_blocks], got {tuple(block_table.shape)}")
    if block_table.is_floating_point() or block_table.is_complex():
        raise InputError(f"block_table must hold integer page ids, got {block_table.dtype}")
    if block_table.dtype != torch.int32 and block_table.numel():
        lo, hi = int(block_table.min()), int(block_table.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise InputError(f"block_table holds {hi if hi > INT32_MAX else lo}, which does not fit "
                             f"the int32 page ids mm3 uses")
    return block_table
