"""The batch's delta (`tvopd_trl.delta.TokenDelta`): enumerated values on both paths, and the trainer computing it once
per micro-batch for the advantage, the TV estimate and the statistics."""

import math

import pytest
import torch

from tvopd_trl.advantages import ADVANTAGE_MODE_REGISTRY, advantages_from_delta
from tvopd_trl.delta import TokenDelta
from tvopd_trl.testing import tiny_config
from tvopd_trl.tv import tv_sums


def test_nonfinite_tokens_leave_the_active_set_and_minus_infinity_stays():
    teacher = torch.tensor([[-1.0, math.nan, -math.inf, -0.5, -2.0]])
    old = torch.tensor([[-2.0, -1.0, -1.0, -math.inf, -2.0]])
    delta = TokenDelta.of(teacher, old, torch.tensor([[1, 1, 1, 1, 0]]))
    assert delta.active.tolist() == [[True, False, True, False, False]]
    assert delta.delta[0, 0].item() == 1.0 and torch.isneginf(delta.delta[0, 2])
    assert delta.where(torch.tensor([[False]])).active.sum() == 0
    assert delta.where(torch.tensor([[True, True, False, True, True]])).active.tolist() == [
        [True, False, False, False, False]
    ]


def test_spans_go_through_per_span_and_back_once_each():
    # Three spans over five tokens, span 1 over tokens 1-3; token 4 is in no span
    span_ids = torch.tensor([[0, 1, 1, 1, -1]])
    values = torch.tensor([[-0.5, 0.25, 0.25, 0.25, 9.0]])
    delta = TokenDelta(values, torch.tensor([[True, True, True, False, True]]), span_ids)
    span_values, span_active = delta.per_span(values)
    assert span_values.tolist() == [[-0.5, 0.25]] and span_active.tolist() == [[True, True]]
    assert delta.per_token(torch.tensor([[2.0, 3.0]])).tolist() == [[2.0, 3.0, 3.0, 0.0, 0.0]]
    u, n = tv_sums(delta)
    assert n == 2 and u.item() == pytest.approx(-math.expm1(-0.5))
    token_path = TokenDelta(values, delta.active)
    assert token_path.per_span(values)[0] is values and token_path.per_token(values) is values


@pytest.mark.parametrize("mode", ["sign", "tv", "sequence_constant"])
def test_advantages_from_a_span_delta_give_each_token_its_span_coefficient(mode):
    span_ids = torch.tensor([[0, 1, 1, 2]])
    delta = TokenDelta(torch.tensor([[-0.5, 0.3, 0.3, 0.1]]), torch.ones(1, 4, dtype=torch.bool), span_ids)
    coefficients = advantages_from_delta(mode, delta, scale=0.5)
    per_span = {"sign": [-1.0, 1.0, 1.0], "tv": [-0.5, 0.5, 0.5], "sequence_constant": [-0.3, 0.3, 0.3]}[mode]
    expected = torch.tensor([[per_span[0], per_span[1], per_span[1], per_span[2]]])
    torch.testing.assert_close(coefficients, expected)


def test_a_mode_that_reads_probabilities_is_refused_on_spans():
    delta = TokenDelta(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([[0, 0]]))
    assert not ADVANTAGE_MODE_REGISTRY["power"].across_tokenizers
    with pytest.raises(ValueError, match="not defined on span log-ratios"):
        advantages_from_delta("power", delta, teacher_logps=torch.zeros(1, 2), old_logps=torch.zeros(1, 2), gamma=0.5)


@pytest.mark.parametrize("mode", ["tv", "shuffle"])
def test_the_trainer_computes_the_delta_once_per_micro_batch(make_trainer, tmp_path, monkeypatch, mode):
    args = tiny_config(tmp_path, advantage_mode=mode, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer = make_trainer(args)
    computed = []
    original_of = TokenDelta.of.__func__
    monkeypatch.setattr(
        TokenDelta, "of", classmethod(lambda cls, *a, **k: computed.append(1) or original_of(cls, *a, **k))
    )
    calls = []
    original_loss = trainer.compute_loss

    def compute_loss(*a, **k):
        before = len(computed)
        loss = original_loss(*a, **k)
        calls.append(len(computed) - before)
        return loss

    trainer.compute_loss = compute_loss
    trainer.train()
    assert calls == [1] * (2 * args.max_steps)
    assert all(math.isfinite(log["tv/estimate"]) for log in trainer.state.log_history if "tv/estimate" in log)
