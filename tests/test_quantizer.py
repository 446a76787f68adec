"""Quantizer math against hand-worked examples."""

import pytest
import torch

from lite.quantizer import QuantSpec, compute_params, dequantize, fake_quantize, quantize


def test_asymmetric_hand_worked() -> None:
    # One group of 32: values -1.0 .. 2.0 plus filler inside the range.
    w = torch.full((1, 32), 0.5)
    w[0, 0], w[0, 1], w[0, 2] = -1.0, 2.0, 0.1
    spec = QuantSpec(group_size=32)
    qw = quantize(w, spec)
    # s = (2 - (-1)) / 15 = 0.2; z = round(1 / 0.2) = 5
    assert qw.scale.item() == pytest.approx(0.2)
    assert qw.zero.item() == 5
    # -1 -> 0, 2 -> 15, 0.1 -> round(0.5)+5 = 5 (round half to even), 0.5 -> 3 + 5 = 8 (2.5->2)
    assert qw.q[0, :3].tolist() == [0, 15, 5]
    assert qw.q[0, 3].item() == round(0.5 / 0.2) + 5
    deq = dequantize(qw, 32)
    assert deq[0, 0].item() == pytest.approx(-1.0)
    assert deq[0, 1].item() == pytest.approx(2.0)


def test_symmetric_hand_worked() -> None:
    w = torch.full((1, 32), 0.25)
    w[0, 0], w[0, 1] = -1.4, 0.7
    qw = quantize(w, QuantSpec(group_size=32, symmetric=True))
    # s = 1.4 / 7 = 0.2; zero = 8; q = round(w / s) + 8
    assert qw.scale.item() == pytest.approx(0.2)
    assert qw.zero.item() == 8
    assert qw.q[0, 0].item() == 1  # -7 + 8
    assert qw.q[0, 1].item() == 12  # 3.5 -> 4 (half to even) + 8
    assert qw.q[0, 2].item() == 9  # 1.25 -> 1 + 8


def test_one_signed_and_constant_groups_keep_zero_in_range() -> None:
    w = torch.cat([torch.full((1, 32), 0.5), torch.zeros(1, 32)], dim=1)
    spec = QuantSpec(group_size=32)
    qw = quantize(w, spec)
    assert qw.zero.tolist() == [[0, 0]]
    assert torch.allclose(dequantize(qw, 32), w, atol=1e-6)


def test_partial_group_ignores_padding() -> None:
    """K = 40 with group 32: the second group holds 8 real columns, its range is theirs."""
    torch.manual_seed(0)
    w = torch.rand(3, 40) + 1.0  # all positive: a padded zero would change nothing here...
    w[:, 32:] = torch.linspace(-3, -2, 8)  # ...but this group is all negative
    scale, zero = compute_params(w, QuantSpec(group_size=32))
    assert scale.shape == (3, 2)
    assert torch.allclose(scale[:, 1], torch.full((3,), 3.0 / 15))
    assert (zero[:, 1] == 15).all()


def test_error_bounded_by_half_step() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 200)
    spec = QuantSpec(group_size=64)
    qw = quantize(w, spec)
    err = (dequantize(qw, 64) - w).abs()
    step = qw.scale.repeat_interleave(64, dim=1)[:, :200]
    assert (err <= step / 2 + 1e-6).all()


def test_clip_ratio_shrinks_range() -> None:
    torch.manual_seed(2)
    w = torch.randn(8, 64)
    full = fake_quantize(w, QuantSpec(group_size=64))
    clipped = fake_quantize(w, QuantSpec(group_size=64), clip_ratio=0.5)
    assert clipped.abs().max() < full.abs().max()


@pytest.mark.parametrize("bits,gs", [(3, 128), (8, 128), (4, 48), (4, 256)])
def test_unsupported_settings_named(bits: int, gs: int) -> None:
    with pytest.raises(ValueError, match="--w-bits|--w-group-size"):
        QuantSpec(bits=bits, group_size=gs)
