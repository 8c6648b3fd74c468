"""BatchMetadata and SparseAttentionParams: construction and every rejected input."""

from __future__ import annotations

import pytest
import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.errors import InputError
from mm3.contract.params import SparseAttentionParams


def _bt(rows: int, cols: int = 4) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)


def test_mixed_batch_with_spec_decode_padding_and_chunked_prefill() -> None:
    b = BatchMetadata.build(query_lens=[3, 3, 0, 4, 2], seq_lens=[40, 0, 0, 4, 30], block_table=_bt(5),
                            block_size=16, num_decodes=3)
    assert (b.num_decodes, b.num_prefills, b.decode_query_len) == (3, 2, 3)
    assert (b.num_tokens, b.num_decode_tokens, b.max_query_len) == (12, 6, 4)
    # the fresh prompt (4 of 4) has no cached context, the chunk (2 of 30) has 28; decodes do not count
    assert (b.max_prefill_query_len, b.max_prefill_context_len) == (4, 28)
    assert b.query_start_loc.tolist() == [0, 3, 6, 6, 10, 12]
    assert b.token_positions.tolist() == [37, 38, 39, -1, -1, -1, 0, 1, 2, 3, 28, 29]
    assert b.token_to_request.tolist() == [0, 0, 0, 1, 1, 1, 3, 3, 3, 3, 4, 4]
    assert b.context_lens.tolist() == [37, 0, 0, 0, 28]
    assert b.block_table.dtype == torch.int32


def test_is_decode_flags() -> None:
    b = BatchMetadata.build([1, 5], [9, 5], _bt(2), block_size=16, is_decode=[True, False])
    assert b.num_decodes == 1
    with pytest.raises(InputError, match="not decode-first: request 1 is a decode after prefill request 0"):
        BatchMetadata.build([5, 1], [5, 9], _bt(2), block_size=16, is_decode=[False, True])


@pytest.mark.parametrize("kwargs,match", [
    (dict(query_lens=[1, 2], seq_lens=[9, 9], num_decodes=2), "decode query lengths must be uniform"),
    (dict(query_lens=[1], seq_lens=[9, 9]), "query_lens has 1 requests but seq_lens has 2"),
    (dict(query_lens=[-1], seq_lens=[9]), "request 0 has a negative query length"),
    (dict(query_lens=[5], seq_lens=[3]), "seq_len 3 < query_len 5"),
    (dict(query_lens=[0], seq_lens=[3]), "prefills need >= 1 token"),
    (dict(query_lens=[1], seq_lens=[65]), "needs 5 blocks of 16 but the block table has only 4 columns"),
    (dict(query_lens=[1], seq_lens=[9], num_decodes=1, decode_query_len=2), "decode_query_len=2"),
    (dict(query_lens=[1], seq_lens=[9], num_decodes=3), "num_decodes=3 must be in"),
    (dict(query_lens=[1], seq_lens=[9], num_pages=0), r"block_table\[0, 0\] = 0 is not a page id"),
])
def test_bad_batches_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        BatchMetadata.build(block_table=_bt(len(kwargs["query_lens"])), block_size=16, **kwargs)


def test_float_lengths_are_refused() -> None:
    with pytest.raises(InputError, match="integer tensor"):
        BatchMetadata.build(torch.tensor([1.5]), [9], _bt(1), block_size=16)


@pytest.mark.parametrize("query_lens,match", [
    ("12", r"query_lens is the string '12': pass the lengths as ints"),      # not the lengths (1, 2)
    (b"12", r"query_lens is the string b'12'"),
    ([True, True, 5], r"query_lens\[0\] is True, a bool: lengths count tokens"),
    ([1, torch.tensor(False), 5], r"query_lens\[1\] is tensor\(False\), a bool"),
    (torch.tensor([True, True, True]), r"query_lens must be a 1-D integer tensor or list, got torch.bool"),
    ([1, "1", 5], r"query_lens\[1\] is '1': lengths count tokens, so they must be ints"),
    ([1, 1, 5.0], r"query_lens\[2\] is 5.0: lengths count tokens"),
], ids=["str", "bytes", "bools", "bool-tensor-item", "bool-tensor", "str-item", "float-item"])
def test_lengths_that_are_not_ints_are_refused(query_lens: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        BatchMetadata.build(query_lens, [300, 129, 5], _bt(3), block_size=128, num_decodes=2)


def test_integer_lengths_of_any_integer_type_are_accepted() -> None:
    import numpy as np

    for ql in ([1, 1, 5], (1, 1, 5), np.array([1, 1, 5]), [np.int64(1), 1, torch.tensor(5)], torch.tensor([1, 1, 5])):
        b = BatchMetadata.build(ql, [300, 129, 5], _bt(3), block_size=128, num_decodes=2)
        assert b.query_lens == (1, 1, 5) and all(type(x) is int for x in b.query_lens), ql


def test_block_ids_beyond_cache_are_named() -> None:
    bt = torch.tensor([[0, 7, -1]], dtype=torch.int32)
    with pytest.raises(InputError, match=r"block_table\[0, 1\] = 7 is not a page id in \[0, 4\)"):
        BatchMetadata.build([1], [20], bt, block_size=16, num_pages=4)
    # Entries past the request's blocks are never looked at.
    BatchMetadata.build([1], [16], bt, block_size=16, num_pages=4)


def test_update_in_place_keeps_addresses() -> None:
    a = BatchMetadata.build([1, 1], [20, 30], _bt(2), block_size=16, num_decodes=2)
    b = BatchMetadata.build([1, 1], [25, 33], _bt(2), block_size=16, num_decodes=2)
    ptr = a.seq_lens.data_ptr()
    a.update_(b)
    assert a.seq_lens.data_ptr() == ptr and a.seq_lens.tolist() == [25, 33]
    c = BatchMetadata.build([1], [20], _bt(1), block_size=16, num_decodes=1)
    with pytest.raises(InputError, match="shape"):
        a.update_(c)


@pytest.mark.parametrize("tp,heads", [(1, (64, 4, 4)), (2, (32, 2, 2)), (4, (16, 1, 1)), (8, (8, 1, 1))])
def test_minimax_m3_presets(tp: int, heads: tuple[int, int, int]) -> None:
    p = SparseAttentionParams.minimax_m3(tp)
    assert (p.num_heads, p.num_kv_heads, p.num_index_heads) == heads
    assert (p.head_dim, p.block_size, p.topk, p.local_blocks, p.init_blocks) == (128, 128, 16, 1, 0)
    assert p.softmax_scale == pytest.approx(128 ** -0.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_index_heads=2), "must equal num_kv_heads"),
    (dict(num_heads=6), "multiple of num_kv_heads"),
    (dict(init_blocks=10, topk=8), "forced blocks would not fit"),
    (dict(head_dim=0), "greater than 0"),
    (dict(bogus=1), "unknown field 'bogus'"),
])
def test_bad_params(kwargs: dict, match: str) -> None:
    base = dict(num_heads=8, num_kv_heads=4, head_dim=16, num_index_heads=4, index_head_dim=16)
    with pytest.raises(ValueError, match=match):
        SparseAttentionParams(**{**base, **kwargs})


def test_bad_tp_size() -> None:
    with pytest.raises(InputError, match="tp_size 1, 2, 4 or 8"):
        SparseAttentionParams.minimax_m3(3)


@pytest.mark.parametrize("seed", range(4))
def test_one_token_decodes_derive_the_tokens_of_the_general_search(seed: int) -> None:
    """A step of one-token decodes only takes a shorter derivation (no search, no gather): the same positions and
    requests as the general one (which ignores the decode count), padding decodes (seq_len 0) included, with
    fewer torch operations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mm3.contract.contents import derive_tokens

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.n += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 40, (1,), generator=g))
    sl = torch.randint(1, 5000, (R,), generator=g, dtype=torch.int32)
    sl[torch.rand(R, generator=g) < 0.2] = 0                              # padding decodes
    qsl = torch.arange(R + 1, dtype=torch.int32)
    with Ops() as short:
        pos, req = derive_tokens(qsl, sl, R, R)
    with Ops() as general:
        want_pos, want_req = derive_tokens(qsl, sl, R - 1, R)             # not all decodes: the search
    assert torch.equal(pos, want_pos) and torch.equal(req, want_req)
    assert pos.dtype == want_pos.dtype == req.dtype == want_req.dtype == torch.int32
    assert short.n < general.n, (short.n, general.n)
    b = BatchMetadata.from_device(qsl, sl, torch.zeros(R, 40, dtype=torch.int32), num_decodes=R, num_tokens=R,
                                  max_query_len=1, block_size=128)
    assert torch.equal(b.token_positions, want_pos) and torch.equal(b.token_to_request, want_req)
    assert b.validate().num_tokens == R
