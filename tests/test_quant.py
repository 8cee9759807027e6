import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nsa_inductor.quant import act_quant, fp8_max
from helpers.reference64 import act_quant64

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 3),
    log_scale=st.integers(-12, 8),
    seed=st.integers(0, 2**16),
    fp8_dtype=st.sampled_from(FP8),
    scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    zero_row=st.booleans(),
)
def test_act_quant_matches_float64(rows, blocks, log_scale, seed, fp8_dtype, scale_fmt, zero_row):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, blocks * 128, generator=gen) * 2.0**log_scale).to(torch.bfloat16)
    if zero_row:
        x[0] = 0
    fmax = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}[fp8_dtype]
    y, s = act_quant(x, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
    scaled64, s64 = act_quant64(x, fmax, scale_fmt == "ue8m0")

    assert y.dtype == fp8_dtype and y.shape == x.shape and s.shape == (rows, blocks)
    if scale_fmt == "ue8m0":
        assert torch.equal(s.double(), s64)
        mantissa, _ = torch.frexp(s)
        assert bool((mantissa == 0.5).all()), "ue8m0 scales must be powers of two"
    else:
        torch.testing.assert_close(s.double(), s64, rtol=2**-23, atol=0)
    if zero_row:
        assert bool((s[0] > 0).all()) and bool((y[0].float() == 0).all())
    assert float(y.float().abs().max()) <= fmax
    if scale_fmt == "ue8m0":
        # x / s is exact for a power-of-two s, so the fp8 cast of the float64 quotient is the answer.
        assert torch.equal(y.view(torch.uint8), scaled64.float().to(fp8_dtype).view(torch.uint8))
    else:
        min_normal = {torch.float8_e4m3fn: -6, torch.float8_e4m3fnuz: -7}[fp8_dtype]
        step = torch.exp2(torch.floor(torch.log2(scaled64.abs())).clamp(min=min_normal) - 3)
        assert bool(((y.double() - scaled64).abs() <= step).all())


def test_act_quant_clamps_to_the_given_max():
    x = torch.full((1, 128), 3.0)
    x[0, 0] = 1000.0
    y, s = act_quant(x, scale_fmt="fp32", fp8_dtype=torch.float8_e4m3fnuz, max_value=224.0)
    assert float(s[0, 0]) == pytest.approx(1000.0 / 224.0)
    assert float(y.float().abs().max()) <= 224.0


def test_fp8_max_and_bad_arguments():
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(torch.float8_e4m3fnuz) == 240.0
    with pytest.raises(ValueError, match="fp8 dtype"):
        fp8_max(torch.bfloat16)
    with pytest.raises(ValueError, match="scale_fmt"):
        act_quant(torch.zeros(1, 128), scale_fmt="e8m0")


def test_fp8_ulps_counts_steps_of_the_fp8_grid():
    from nsa_inductor.quant import fp8_ulps

    a = torch.tensor([1.0, 1.0, -1.0, 0.0, 448.0, -448.0, 0.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([1.125, 1.0, -1.125, -0.0, 416.0, 448.0, 2.0**-9]).to(torch.float8_e4m3fn)
    assert fp8_ulps(a, b).tolist() == [1, 0, 1, 1, 1, 253, 1]
    with pytest.raises(ValueError, match="share one fp8 type"):
        fp8_ulps(a, b.float())
