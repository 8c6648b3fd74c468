"""The Triton NVFP4 tile loader (backends/triton/nvfp4.py) against the reference dequantization, under
Triton's interpreter: every byte value, scales across e4m3's range (subnormals, 448, zero), NHD and HND
page views with their scales in the same layout, masked rows, each dot dtype."""

from __future__ import annotations

import os

import pytest
import torch

from mm3.contract.quant import dequantize_nvfp4
from mm3_backends.triton.nvfp4 import load_nvfp4_rows

import triton  # noqa: E402  (after mm3_backends.triton: TRITON_INTERPRET is set by tests/conftest.py)
import triton.language as tl

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]


@triton.jit
def _read_rows(k_ptr, s_kp, s_kb, s_kd, ks_ptr, s_sp, s_sb, s_sd, out_ptr, h_k, h_s, n_ok,
               R: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr, MASKED: tl.constexpr, SPE: tl.constexpr):
    """Rows ``0..R-1`` (slot ``j`` of page ``program_id``) of one head into ``out[page, j, :]`` (``SPE``: the
    scales loaded per element, as the indexer and the prefill attention take them, else spread)."""
    page = tl.program_id(0)
    j = tl.arange(0, R)
    rows_k = k_ptr + page * s_kp + h_k + j * s_kb
    rows_s = ks_ptr + page * s_sp + h_s + j * s_sb
    if MASKED:
        tile = load_nvfp4_rows(rows_k, rows_s, s_kd, s_sd, D, DTYPE, j < n_ok, SCALE_PER_ELEMENT=SPE)
    else:
        tile = load_nvfp4_rows(rows_k, rows_s, s_kd, s_sd, D, DTYPE, SCALE_PER_ELEMENT=SPE)
    offs = tl.arange(0, D)
    tl.store(out_ptr + (page * R + j)[:, None] * D + offs[None, :], tile.to(tl.float32))


def _scales(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """e4m3 scales over the whole finite range: random bit patterns (NaN codes 0x7f/0xff excluded),
    so subnormals, zero and 448 all appear."""
    bits = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.int16)
    bits[..., 0] = 0x7E                                     # 448, the largest
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


def _pages(layout: str, pages: int, B: int, H: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    if layout == "NHD":
        return torch.empty(pages, B, H, width, dtype=dtype)
    return torch.empty(pages, H, B, width, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("per_element", [False, True], ids=["spread_scales", "scale_per_element"])
@pytest.mark.parametrize("layout, D, dtype", [("NHD", 32, "float32"), ("HND", 64, "float32"),
                                              ("NHD", 16, "float16"), ("HND", 128, "bfloat16")])
def test_tiles_equal_the_reference_dequantization(layout: str, D: int, dtype: str, per_element: bool) -> None:
    gen = torch.Generator().manual_seed(D)
    pages, B, H, h = 3, 16, 2, 1
    k = _pages(layout, pages, B, H, D // 2, torch.uint8)
    k.copy_(torch.randint(0, 256, k.shape, generator=gen, dtype=torch.int16).to(torch.uint8))
    n = pages * B * D // 2                                  # >= 256: every byte value, in a random order
    head = torch.cat([torch.arange(256), torch.randint(0, 256, (n - 256,), generator=gen)])
    k[:, :, h] = head[torch.randperm(n, generator=gen)].to(torch.uint8).view(pages, B, D // 2)
    s = _pages(layout, pages, B, H, D // 16, torch.float8_e4m3fn)
    s.copy_(_scales(gen, s.shape))
    out = torch.full((pages, B, D), float("nan"))
    tl_dtype = {"float32": tl.float32, "float16": tl.float16, "bfloat16": tl.bfloat16}[dtype]
    _read_rows[(pages,)](k, k.stride(0), k.stride(1), k.stride(3), s, s.stride(0), s.stride(1), s.stride(3), out,
                        h * k.stride(2), h * s.stride(2), B, R=B, D=D, DTYPE=tl_dtype, MASKED=False, SPE=per_element)
    want = dequantize_nvfp4(k[:, :, h], s[:, :, h], torch.float64)
    # exact in every dot dtype: at most 6 significant bits, magnitudes within [2^-10, 2688]
    assert torch.equal(out.double(), want), (out.double() - want).abs().max()
    assert want.abs().max() == 2688.0 and (want != 0).any()


@pytest.mark.parametrize("per_element", [False, True], ids=["spread_scales", "scale_per_element"])
def test_masked_rows_are_zeros_and_a_misread_would_show(per_element: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    D, B = 32, 16
    k = torch.randint(0, 256, (2, B, 1, D // 2), generator=gen, dtype=torch.int16).to(torch.uint8)
    s = _scales(gen, (2, B, 1, D // 16))
    out = torch.full((2, B, D), float("nan"))
    _read_rows[(2,)](k, *k.stride()[:2], k.stride(3), s, *s.stride()[:2], s.stride(3), out, 0, 0, 5,
                    R=B, D=D, DTYPE=tl.float32, MASKED=True, SPE=per_element)
    want = dequantize_nvfp4(k[:, :, 0], s[:, :, 0])
    assert torch.equal(out[:, :5], want[:, :5]) and (out[:, 5:] == 0).all()
    # the nibble order and the scale groups matter at these inputs: swapped nibbles read otherwise
    swapped = dequantize_nvfp4((k[:, :, 0] << 4) | (k[:, :, 0] >> 4), s[:, :, 0])
    assert not torch.equal(swapped[:, :5], out[:, :5])
