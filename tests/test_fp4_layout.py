"""custom_ops.layouts.fp4: e2m1 codes with UE8M0 group scales, checked on hand-picked values and a round trip."""

from __future__ import annotations

import math

import pytest
import torch

from custom_ops.layouts.fp4 import dequantize_groups_e2m1, quantize_groups_e2m1


def _codes(packed: torch.Tensor) -> list[int]:
    return [n for byte in packed.flatten().tolist() for n in (byte & 0xF, byte >> 4)]


def test_hand_picked_codes_ties_signs_and_clamp():
    # group amax 6 -> scale 2^0 (exponent byte 127): codes are the e2m1 steps of the values themselves
    head = [6.0, 0.25, 0.26, 0.75, 0.76, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 3.6, 5.0, 5.1, -0.5, -0.2, -6.0, 0.0]
    y = torch.tensor([head + [0.0] * (32 - len(head))])
    packed, exponents = quantize_groups_e2m1(y)
    assert exponents.tolist() == [[127]]
    want = [7, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 7, 0x9, 0, 0xF, 0] + [0] * 14  # ties go down; -0.2 -> +0
    assert _codes(packed) == want
    assert packed[0, 0].item() == 7 | (0 << 4)  # even element in the low nibble


def test_scale_rounds_up_and_values_clamp_to_six():
    y = torch.zeros(1, 64)
    y[0, 0] = 6.5  # sraw = 6.5 / 6 -> next power of two 2: exponent byte 128, 6.5 / 2 = 3.25 -> 3 (code 5)
    y[0, 32] = 1e-9  # below the amax floor: sraw = 1e-4 / 6
    packed, exponents = quantize_groups_e2m1(y)
    assert exponents[0, 0].item() == 128
    assert _codes(packed)[0] == 5
    floor_exp = exponents[0, 1].item()
    assert 2.0 ** (floor_exp - 127) >= 1e-4 / 6 > 2.0 ** (floor_exp - 128)


def test_non_finite_values_keep_the_scale_finite():
    """A NaN is left out of its group's amax and coded 0 (e2m1 has no NaN); an infinity counts as the largest finite
    fp32 and is coded +-6; the other values of the group keep their codes (NaN) or round to 0 (infinity)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(32, generator=g)
    rows = base.repeat(5, 1)
    rows[0, 3] = float("nan")
    rows[1, 3] = -float("nan")
    rows[2, 3], rows[3, 3], rows[4, 3] = float("inf"), float("-inf"), 0.0
    packed, exponents = quantize_groups_e2m1(rows)
    codes = [_codes(packed[r]) for r in range(5)]
    for r in (0, 1):
        assert exponents[r].tolist() == exponents[4].tolist() and codes[r] == codes[4]
    top = 127 + math.ceil(math.log2(torch.finfo(torch.float32).max / 6))
    assert exponents[2].tolist() == exponents[3].tolist() == [top]
    assert codes[2] == [7 if i == 3 else 0 for i in range(32)]
    assert codes[3] == [0xF if i == 3 else 0 for i in range(32)]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_round_trip_error_is_at_most_half_a_step(scale):
    g = torch.Generator().manual_seed(int(scale * 1000))
    y = torch.randn(16, 128, generator=g) * scale
    got = dequantize_groups_e2m1(*quantize_groups_e2m1(y)).double()
    groups = y.double().reshape(16, 4, 32)
    step_scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-4) / 6)))[..., None]
    v = groups.abs() / step_scale
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0)) * step_scale
    assert ((got.reshape(16, 4, 32) - groups).abs() <= half_step * (1 + 1e-6)).all()


def test_width_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_groups_e2m1(torch.zeros(2, 48))
