"""Exact checks of the dispersion statistics and of the full-vocabulary divergences."""

import math

import pytest
import torch

from tvopd_trl.divergences import exact_reverse_kl_and_tv
from tvopd_trl.metrics import advantage_dispersion, cumulative_energy, survival_curve


def test_dispersion_of_an_enumerated_set():
    # 100 tokens: 99 with |delta| = 1 and one with |delta| = 10. Energy 99 + 100 = 199.
    values = torch.tensor([1.0] * 99 + [10.0])
    stats = advantage_dispersion(values)
    assert stats["abs_median"] == 1.0 and stats["abs_max"] == 10.0
    assert stats["abs_p99"] == pytest.approx(1.0 + 0.01 * 9.0)  # linear interpolation at position 98.01
    assert stats["top1pct_energy"] == pytest.approx(100 / 199)  # the single largest token
    assert stats["top10pct_energy"] == pytest.approx((100 + 9) / 199)  # the ten largest


def test_dispersion_quantiles_match_torch_and_survive_large_inputs():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0)) * 7
    stats = advantage_dispersion(values)
    assert stats["abs_median"] == pytest.approx(torch.quantile(values.double(), 0.5).item(), abs=1e-12)
    assert stats["abs_p99"] == pytest.approx(torch.quantile(values.double(), 0.99).item(), abs=1e-12)
    big = torch.zeros(2**24 + 10)
    big[-1] = 3.0
    assert advantage_dispersion(big)["top1pct_energy"] == 1.0  # torch.quantile refuses this many values


def test_dispersion_of_empty_and_all_zero_sets():
    assert all(math.isnan(v) for v in advantage_dispersion(torch.zeros(0)).values())
    zeros = advantage_dispersion(torch.zeros(5))
    assert zeros["abs_max"] == 0.0 and zeros["top1pct_energy"] == 0.0


def test_exact_divergences_match_a_direct_computation_and_handle_masked_vocabulary():
    torch.manual_seed(0)
    hidden_size, vocab = 6, 9
    student_head, teacher_head = torch.nn.Linear(hidden_size, vocab), torch.nn.Linear(hidden_size, vocab)
    with torch.no_grad():
        for head in (student_head, teacher_head):
            head.bias[0] = -math.inf  # a vocabulary slot neither model can emit: 0 log 0 = 0
    student_hidden, teacher_hidden = torch.randn(2, 5, hidden_size), torch.randn(2, 5, hidden_size)
    reverse_kl, tv = exact_reverse_kl_and_tv(
        student_hidden, teacher_hidden, student_head, teacher_head, temperature=0.7, chunk_size=3
    )
    q = torch.softmax(student_head(student_hidden).double() / 0.7, -1)
    p = torch.softmax(teacher_head(teacher_hidden).double() / 0.7, -1)
    nonzero = q > 0
    expected_kl = torch.where(nonzero, q * (q.log() - p.log()), 0.0).sum(-1)
    torch.testing.assert_close(reverse_kl.double(), expected_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tv.double(), 0.5 * (q - p).abs().sum(-1), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(reverse_kl).all() and (tv >= 0).all() and (tv <= 1).all()


def test_survival_curve_and_cumulative_energy_on_enumerated_values():
    values, survival = survival_curve(torch.tensor([3.0, 1.0, 2.0]))
    assert values.tolist() == [1.0, 2.0, 3.0] and survival.tolist() == pytest.approx([1.0, 2 / 3, 1 / 3])
    fraction, share = cumulative_energy(torch.tensor([3.0, 1.0, 2.0]))
    assert fraction.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert share.tolist() == pytest.approx([9 / 14, 13 / 14, 1.0])  # 9, then 9 + 4, of 9 + 4 + 1
    assert cumulative_energy(torch.zeros(2))[1].tolist() == [0.0, 0.0]
