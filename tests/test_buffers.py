"""TopkBuffer owns its layout; PagedKVCache validates and reports its page layout."""

from __future__ import annotations

import pytest
import torch

from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_views_agree_whatever_the_storage(layout: str) -> None:
    H, T, K = 3, 7, 5
    buf = TopkBuffer.allocate(T, H, K, layout)
    logical = torch.arange(H * T * K, dtype=torch.int32).reshape(H, T, K)
    buf.head_major().copy_(logical)
    assert torch.equal(buf.head_major(), logical)
    assert torch.equal(buf.token_major(), logical.permute(1, 0, 2))
    sh, st, sk = buf.strides()
    flat = buf.storage.reshape(-1) if buf.is_contiguous() else None
    assert flat is not None
    for h, t, k in [(0, 0, 0), (2, 6, 4), (1, 3, 2)]:
        assert int(flat[h * sh + t * st + k * sk]) == int(logical[h, t, k])
    assert (buf.num_heads, buf.num_tokens, buf.topk, buf.layout) == (H, T, K, layout)


def test_storage_order_is_the_declared_one() -> None:
    hm = TopkBuffer.allocate(4, 2, 3, "head_major")
    tm = TopkBuffer.allocate(4, 2, 3, "token_major")
    assert hm.storage.shape == (2, 4, 3) and hm.strides() == (12, 3, 1)
    assert tm.storage.shape == (4, 2, 3) and tm.strides() == (3, 6, 1)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_rows_share_storage_and_leave_other_rows_alone(layout: str) -> None:
    buf = TopkBuffer.allocate(10, 2, 4, layout, fill=777)
    step = buf.rows(0, 6)
    assert step.num_tokens == 6 and step.layout == layout and step.is_dense()
    step.fill_(-1)
    hm = buf.head_major()
    assert bool((hm[:, :6] == -1).all()) and bool((hm[:, 6:] == 777).all())
    with pytest.raises(InputError, match="capacity is 10"):
        buf.rows(0, 11)


@pytest.mark.parametrize("src,dst", [("head_major", "token_major"), ("token_major", "head_major")])
def test_to_layout_converts_contents(src: str, dst: str) -> None:
    a = TopkBuffer.allocate(5, 3, 4, src)
    a.head_major().copy_(torch.randint(-1, 50, (3, 5, 4), dtype=torch.int32))
    b = a.rows(0, 4).to_layout(dst)
    assert b.layout == dst and b.is_contiguous()
    assert torch.equal(b.head_major(), a.head_major()[:, :4])
    assert a.to_layout(src) is a


def test_bad_buffers_are_rejected_with_reasons() -> None:
    with pytest.raises(InputError, match="int32"):
        TopkBuffer(torch.zeros(2, 3, 4, dtype=torch.int64))
    with pytest.raises(InputError, match="unknown top-k layout"):
        TopkBuffer.allocate(3, 2, 4, layout="HTK")
    with pytest.raises(InputError, match=r"logical \[H, T, K\] view"):
        TopkBuffer(torch.zeros(6, 4, dtype=torch.int32))
    with pytest.raises(InputError, match="reads the layout from its strides"):
        TopkBuffer(torch.zeros(2, 3, 4, dtype=torch.int32), "token_major")     # no label: the memory says it
    with pytest.raises(InputError, match="cannot copy"):
        TopkBuffer.allocate(3, 2, 4).copy_(TopkBuffer.allocate(4, 2, 4))


def test_non_dense_view_is_reported() -> None:
    # A token-major storage wrapped with a stride gap is not dense.
    big = torch.zeros(6, 2, 8, dtype=torch.int32)
    buf = TopkBuffer(big[:, :, :4].permute(1, 0, 2))
    assert buf.layout == "token_major" and not buf.is_dense()


def test_paged_cache_layouts() -> None:
    nhd = PagedKVCache.allocate(3, 16, 2, 8, 8, torch.float32, torch.float32, "NHD")
    hnd = nhd.to_layout("HND")
    assert nhd.kv_layout == "NHD" and hnd.kv_layout == "HND"
    nhd.k.copy_(torch.randn(nhd.k.shape))
    assert torch.equal(nhd.to_layout("HND").k, nhd.k)
    assert (hnd.num_pages, hnd.block_size, hnd.num_kv_heads, hnd.head_dim) == (3, 16, 2, 8)


def test_paged_cache_rejects_mismatches() -> None:
    k = torch.zeros(3, 16, 2, 8)
    with pytest.raises(InputError, match="differ in shape"):
        PagedKVCache(k, torch.zeros(3, 16, 2, 4), torch.zeros(3, 16, 8))
    with pytest.raises(InputError, match="index cache pages/block"):
        PagedKVCache(k, k.clone(), torch.zeros(3, 8, 8))
    with pytest.raises(InputError, match="4-D"):
        PagedKVCache(torch.zeros(3, 16, 16), k, torch.zeros(3, 16, 8))
    with pytest.raises(InputError, match="dtype"):
        PagedKVCache(k, k.to(torch.float16), torch.zeros(3, 16, 8))


# -- the memory is the layout ------------------------------------------------------------------------

def test_the_seeds_memory_under_either_view_gets_its_own_layout() -> None:
    """vLLM's MiniMax-M3 bug: token-major [T, H, K] memory handed over as a head-major view. Wrapped
    as the view it is, it is a token_major buffer; nothing else can be said of it."""
    T, H, K = 9, 2, 4
    token_major = torch.full((T, H, K), -1, dtype=torch.int32)
    buf = TopkBuffer(token_major.permute(1, 0, 2))
    assert buf.layout == "token_major" and buf.storage.data_ptr() == token_major.data_ptr()
    assert buf.head_major().shape == (H, T, K) and buf.strides() == (4, 8, 1)
    with pytest.raises(InputError, match="reads the layout from its strides"):
        TopkBuffer(token_major.permute(1, 0, 2), "head_major")   # the label a caller might get wrong


def test_mm3s_own_storage_form_refuses_memory_that_contradicts_the_layout() -> None:
    """The custom ops' storage argument is wrapped in the layout the layer allocated: a permuted
    tensor of the other layout is refused, with the view constructor as the fix."""
    token_major = torch.full((9, 2, 4), -1, dtype=torch.int32)
    with pytest.raises(InputError) as info:
        TopkBuffer._wrap(token_major.permute(1, 0, 2), "head_major")
    for fragment in ("(2, 9, 4)", "(4, 8, 1)", "'head_major' storage", "vLLM", "TopkBuffer(view)"):
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_one_head_makes_both_layouts_the_same_memory(layout: str) -> None:
    """With H = 1 the head axis has no memory extent: either layout is true of either storage."""
    other = "token_major" if layout == "head_major" else "head_major"
    buf = TopkBuffer.allocate(7, 1, 4, other)
    relabelled = TopkBuffer._wrap(buf.storage.permute(1, 0, 2), layout)
    assert relabelled.layout == layout and relabelled.strides()[1:] == buf.strides()[1:]


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_row_views_and_padded_storage_stay_legal(layout: str) -> None:
    buf = TopkBuffer.allocate(10, 3, 4, layout)
    for start, stop in [(0, 10), (0, 6), (3, 9), (5, 6), (4, 4), (0, 0)]:
        assert buf.rows(start, stop).rows(0, stop - start).layout == layout
    memory = torch.zeros((3, 10, 8) if layout == "head_major" else (10, 3, 8), dtype=torch.int32)[:, :, :4]
    padded = TopkBuffer(memory if layout == "head_major" else memory.permute(1, 0, 2))   # honest, not dense
    assert padded.layout == layout and not padded.is_dense() and padded.rows(2, 7).num_tokens == 5


def test_storage_whose_elements_overlap_is_refused() -> None:
    """An expand()-ed buffer would have two heads write one row: not a layout at all."""
    with pytest.raises(InputError, match="not laid out"):
        TopkBuffer(torch.zeros(1, 5, 4, dtype=torch.int32).expand(3, 5, 4))


@pytest.mark.parametrize("storage", ["token_major", "head_major"])
def test_a_buffer_built_from_the_callers_view_reads_right_whatever_its_storage(storage: str) -> None:
    """The seed's case: T == H, token-major storage behind the head-major view an engine passes.
    The view's strides carry the layout, so the attention reads each token's own rows."""
    import mm3
    from mm3.runtime.registry import default_registry
    from mm3.testing.factories import make_case
    from mm3.testing.oracle import oracle_attention, oracle_topk

    p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                  index_head_dim=16, block_size=16, topk=4)
    case = make_case(p, decodes=[40], prefills=[(1, 30)], dtype="float32", seed=5)   # T == H == 2
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    T, H, K = case.batch.num_tokens, p.num_kv_heads, p.topk
    assert T == H
    memory = torch.full((T, H, K) if storage == "token_major" else (H, T, K), -1, dtype=torch.int32)
    view = memory.permute(1, 0, 2) if storage == "token_major" else memory
    view.copy_(sel.head_major())
    buf = TopkBuffer(view)
    assert buf.layout == storage and buf.storage.data_ptr() == memory.data_ptr()
    out = torch.full_like(case.q, float("nan"))
    default_registry().get("cpu_ref").attention_forward(case.q, case.caches, buf, case.batch, p, out)
    torch.testing.assert_close(out.double(), oracle_attention(case.q, case.caches, sel, case.batch, p),
                               rtol=1e-6, atol=1e-6)


def test_what_is_not_a_view_is_refused() -> None:
    with pytest.raises(InputError, match=r"logical \[H, T, K\] view"):
        TopkBuffer(torch.zeros(6, 4, dtype=torch.int32))
    with pytest.raises(InputError, match="not laid out outermost-to-innermost"):
        TopkBuffer(torch.zeros(2, 4, 6, dtype=torch.int32).transpose(1, 2))   # slots not innermost


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_rows_carry_the_facts_their_memory_has(layout: str) -> None:
    """A rows view takes its buffer's facts where they cannot differ (two or more rows of two or more): each
    view's facts are what reading its memory gives, for every range, one row included."""
    from mm3.contract.facts import topk_facts

    buf = TopkBuffer.allocate(64, 2, 16, layout, "cpu")
    for start, stop in [(0, 1), (0, 2), (0, 37), (5, 64), (0, 64), (63, 64), (7, 7)]:
        rows = buf.rows(start, stop)
        assert rows.facts == topk_facts(rows.storage, layout), (start, stop)
        assert rows.num_tokens == stop - start and rows.layout == layout
    one = TopkBuffer.allocate(1, 2, 16, layout, "cpu")
    assert one.rows(0, 1).facts == topk_facts(one.rows(0, 1).storage, layout)
