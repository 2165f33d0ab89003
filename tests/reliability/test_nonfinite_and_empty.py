"""Non-finite teacher log-probabilities and empty rollouts: the run continues, and the scheduler only ever sees
usable tokens."""

import math
from unittest import mock

import pytest
import torch

from tvopd_trl import TVOPDTrainer
from tvopd_trl import trainer as trainer_module
from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def _steps(trainer):
    return [entry for entry in trainer.state.log_history if "tv/scale" in entry]


class CorruptTeacher(TVOPDTrainer):
    """The teacher returns NaN for every completion's first token and -inf (no mass) for its second."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.recorded = output
        output["teacher_logps"][:, 0] = float("nan")
        output["teacher_logps"][:, 1] = float("-inf")
        return output


@pytest.mark.parametrize("mode", ["tv", "raw", "relative_power"])
def test_nan_tokens_are_dropped_and_counted_and_neg_inf_tokens_count_as_full_tv(mode, tmp_path):
    args = tiny_config(tmp_path, max_steps=3, logging_steps=1, advantage_mode=mode, per_device_train_batch_size=8)
    trainer = tiny_pair_trainer(args, prompts=24, trainer_class=CorruptTeacher)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _steps(trainer)
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)  # the run continued
    mask = trainer.recorded["completion_mask"]
    last = logs[-1]
    assert last["tv/nonfinite_tokens"] == int(mask[:, 0].sum())  # every NaN token, and nothing else
    # A teacher with no mass on the token: X = 1 for it, whatever the mode. The estimate pools X over the active
    # tokens, so it is at least (number of -inf tokens) / (number of usable tokens).
    usable = int(mask.sum() - mask[:, 0].sum())
    assert last["tv/estimate"] >= int(mask[:, 1].sum()) / usable - 1e-6 and last["tv/frozen"] == 0.0
    changed = any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert changed and all(math.isfinite(p.abs().max().item()) for p in trainer.model.parameters())


class EmptyRollouts(TVOPDTrainer):
    """Every completion is masked out, as when all completions are empty."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output["completion_mask"] = torch.zeros_like(output["completion_mask"])
        output["loss_mask"] = torch.zeros_like(output["loss_mask"])
        return output


def test_an_empty_step_is_a_no_op_for_the_scheduler_with_a_zero_loss_and_a_warning(tmp_path):
    args = tiny_config(tmp_path, max_steps=2, logging_steps=1)
    trainer = tiny_pair_trainer(args, prompts=16, trainer_class=EmptyRollouts)
    with mock.patch.object(trainer_module.logger, "warning") as warning:
        trainer.train()
    logs = _steps(trainer)
    assert [entry["loss"] for entry in logs] == [0.0, 0.0]
    assert [entry["tv/frozen"] for entry in logs] == [1.0, 1.0] and all(e["tv/scale"] == 1.0 for e in logs)
    assert all(entry["tv/estimate"] is None for entry in logs)  # NaN (no token), which TRL logs as None
    assert trainer._tv_scheduler.state_dict()["num_updates"] == 0
    messages = [call.args[0] for call in warning.call_args_list]
    assert sum("no active token" in message for message in messages) == 2
