"""backends/triton/interpreter.py: bf16, e4m3 NaNs and e5m2 under Triton's interpreter compute what torch computes.

Each patched operation runs in a small kernel through the interpreter and is
compared with torch's bf16 on the CPU (which widens to fp32, computes, and
rounds to nearest even, as a GPU's bf16 units do): dots, fp32 -> bf16 casts
(ties, NaN, infinities, overflow), elementwise arithmetic and comparisons,
int <-> bf16 casts, every e4m3 and e5m2 bit pattern widened. The interpreter's own code
(the patch taken out) fails the same checks, so they can fail. The patch must
be installed, which fails when a Triton release moves what it replaces.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the patch is for Triton's CPU interpreter only")

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    from mm3_backends.triton import interpreter as fix
    from mm3_backends.triton import tl_utils  # noqa: F401 - installs the patch, as the kernels' import does

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    @triton.jit
    def _cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _elementwise_kernel(a_ptr, b_ptr, out_ptr, lt_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)
        tl.store(out_ptr + offs, a * b)
        tl.store(out_ptr + N + offs, a + b)
        tl.store(out_ptr + 2 * N + offs, a - b)
        tl.store(out_ptr + 3 * N + offs, a / b)
        tl.store(out_ptr + 4 * N + offs, -a)
        tl.store(out_ptr + 5 * N + offs, tl.maximum(a, b))
        tl.store(lt_ptr + offs, (a < b).to(tl.int32))


def _bf16(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.fixture
def interpreters_own(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a context manager
    """The interpreter's own code for the block (the patch taken out), to show the checks can fail."""
    from triton.runtime import interpreter

    def take_out() -> None:
        for name, original in fix._ORIGINALS.items():
            monkeypatch.setattr(interpreter.InterpreterBuilder, name, original)
    return take_out


def test_the_patch_is_installed_on_this_triton() -> None:
    assert fix.missing() == [], f"Triton {triton.__version__} moved what the bf16 patch replaces"
    assert sorted(fix._ORIGINALS) == sorted(fix.PATCHED)
    assert fix.install() is True            # a second call changes nothing


def test_bf16_dot_equals_the_fp32_dot_of_its_values(interpreters_own) -> None:
    a, b = _bf16(16 * 32, 1).view(16, 32), _bf16(32 * 16, 2).view(32, 16)
    want = a.float() @ b.float()            # bf16 products are exact in fp32

    def run() -> torch.Tensor:
        out = torch.empty(16, 16)
        _dot_kernel[(1,)](a, b, out, 16, 32, 16)
        return out
    torch.testing.assert_close(run(), want, rtol=1e-6, atol=1e-5)
    interpreters_own()
    assert (run() - want).abs().max() > 1.0, "the interpreter's own bf16 dot was right: the test cannot fail"


def test_fp32_to_bf16_rounds_to_nearest_even(interpreters_own) -> None:
    x = torch.tensor([1.0, 1.00390625, 1.01171875, -1.00390625, 3.0e38, -3.4e38, float("inf"), float("-inf"),
                      float("nan"), 1e-40, -0.0, 0.1, 2.0 ** -130, 65504.5])
    x = torch.cat([x, torch.randn(50, generator=torch.Generator().manual_seed(3)) * 1e3])

    def run() -> torch.Tensor:
        out = torch.empty(64, dtype=torch.bfloat16)
        _cast_kernel[(1,)](x, out, 64)
        return out
    got, want = run(), x.to(torch.bfloat16)
    assert torch.equal(_bits(got)[~want.isnan()], _bits(want)[~want.isnan()]) and got[want.isnan()].isnan().all()
    interpreters_own()
    assert not torch.equal(_bits(run()), _bits(want))


def test_bf16_arithmetic_and_comparisons_equal_torchs(interpreters_own) -> None:
    a, b = _bf16(64, 4), _bf16(64, 5)
    want = torch.cat([a * b, a + b, a - b, a / b, -a, torch.maximum(a, b)])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out, lt = torch.empty(6 * 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.int32)
        _elementwise_kernel[(1,)](a, b, out, lt, 64)
        return out, lt
    out, lt = run()
    assert torch.equal(_bits(out), _bits(want))
    assert torch.equal(lt.bool(), a < b)
    interpreters_own()
    out, lt = run()
    assert not torch.equal(_bits(out), _bits(want)) and not torch.equal(lt.bool(), a < b)


@pytest.mark.parametrize("src, dst", [(torch.int32, torch.bfloat16), (torch.bfloat16, torch.int32),
                                      (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_casts_between_bf16_and_other_types_convert_values(src: torch.dtype, dst: torch.dtype) -> None:
    x = (torch.randn(64, generator=torch.Generator().manual_seed(6)) * 200).to(src)
    out = torch.empty(64, dtype=dst)
    _cast_kernel[(1,)](x, out, 64)
    assert torch.equal(out, x.to(dst))


def _every_byte_widened(fp8: torch.dtype, dst: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the 256 ``fp8`` bytes widened to ``dst`` by a kernel, and by torch."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    out = torch.empty(256, dtype=dst)
    _cast_kernel[(1,)](x, out, 256)
    return out, x.to(dst)


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float32])
def test_every_e4m3_value_widens_as_torch_widens_it(dst: torch.dtype, interpreters_own) -> None:
    got, want = _every_byte_widened(torch.float8_e4m3fn, dst)
    nan = want.isnan()
    assert nan.sum() == 2 and got[nan].isnan().all(), "e4m3's NaN (S.1111.111) must stay NaN"
    assert torch.equal(got[~nan], want[~nan])
    interpreters_own()
    assert not _every_byte_widened(torch.float8_e4m3fn, dst)[0][nan].isnan().any()


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float32])
def test_every_e5m2_value_widens_as_torch_widens_it(dst: torch.dtype, interpreters_own) -> None:
    """An e5m2 K/V cache's bytes: subnormals, the largest finite (57344), infinities and NaNs, exactly."""
    got, want = _every_byte_widened(torch.float8_e5m2, dst)
    nan = want.isnan()
    assert nan.sum() == 6 and got[nan].isnan().all(), "e5m2's NaNs (S.11111.xx, xx != 0) must stay NaN"
    assert torch.equal(got[~nan], want[~nan]) and got.isinf().sum() == 2
    interpreters_own()
    got = _every_byte_widened(torch.float8_e5m2, dst)[0]
    assert not torch.equal(got[~nan], want[~nan]) or not got[nan].isnan().all()
