"""Rollout paths other than plain transformers generation: vLLM (against a local stand-in) and bf16 autocast."""

import math

import pytest
import torch

from tvopd_trl.testing import tiny_config


class StandInVLLMGeneration:
    """Answers `generate` like TRL's `VLLMGeneration` with `logprobs=0`: it samples with the student through
    transformers and reports each sampled token's log-probability shifted by `offset`, a known sampler mismatch."""

    def __init__(self, model, tokenizer, offset, max_new_tokens=6, missing_first=False):
        self.model, self.tokenizer, self.offset, self.max_new_tokens = model, tokenizer, offset, max_new_tokens
        self.missing_first = missing_first  # report the first token's log-probability as None (vLLM's NaN)
        self.syncs = 0
        self.logprobs = None

    def sync_weights(self):
        self.syncs += 1

    @torch.no_grad()
    def generate(self, prompts, images, num_generations):
        assert images is None and num_generations == 1 and self.logprobs == 0
        eos = self.tokenizer.eos_token_id
        completion_ids, logprobs = [], []
        for ids in prompts:
            output = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                max_new_tokens=self.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            completion = output[0, len(ids) :].tolist()
            if eos in completion:
                completion = completion[: completion.index(eos) + 1]
            logits = self.model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
            token_logps = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])
            completion_ids.append(completion)
            logprobs.append([[value - self.offset] for value in token_logps.squeeze(-1).tolist()])
            if self.missing_first:
                logprobs[-1][0] = [None]
        return prompts, completion_ids, logprobs, None


def vllm_trainer(make_trainer, tokenizer, output_dir, offset, missing_first=False, **overrides):
    trainer = make_trainer(
        tiny_config(output_dir, **overrides),
    )
    # What `use_vllm=True` sets up when vLLM is installed, with the engine replaced by the stand-in.
    trainer.use_vllm = True
    trainer._last_loaded_step = -1
    trainer.vllm_generation = StandInVLLMGeneration(
        trainer.accelerator.unwrap_model(trainer.model), tokenizer, offset, missing_first=missing_first
    )
    trainer.vllm_generation.logprobs = 0
    return trainer


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_vllm_rollouts_keep_sampler_logprobs_and_log_the_gap(make_trainer, tokenizer, tmp_path, pad_to_multiple_of):
    trainer = vllm_trainer(
        make_trainer, tokenizer, tmp_path, offset=0.25, max_steps=2, pad_to_multiple_of=pad_to_multiple_of
    )
    trainer.train()
    assert trainer.vllm_generation.syncs == 2  # weights pushed once per optimizer step
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    for entry in logs:
        for stat in ("mean", "max"):
            assert entry[f"sampling/sampling_logp_difference/{stat}"] == pytest.approx(0.25, abs=1e-4)
        for stat in ("min", "mean", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(math.exp(0.25), rel=1e-4)
        assert math.isfinite(entry["loss"])


@pytest.mark.parametrize("offset, expected_weight", [(0.25, math.exp(0.25)), (2.0, 3.0)])
def test_vllm_importance_correction_weights_the_loss(make_trainer, tokenizer, tmp_path, offset, expected_weight):
    trainer = vllm_trainer(make_trainer, tokenizer, tmp_path, offset=offset, advantage_mode="sign")
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert inputs["sampler_logps"].shape == inputs["completion_ids"].shape
    corrected = trainer.compute_loss(trainer.model, inputs)
    trainer.args.vllm_importance_sampling_correction = False
    plain = trainer.compute_loss(trainer.model, inputs)
    assert plain.abs() > 0
    # pi_old / pi_vllm = exp(offset) on every token, truncated at vllm_importance_sampling_cap = 3.
    assert (corrected / plain).item() == pytest.approx(expected_weight, rel=1e-4)


def test_a_sampler_log_probability_vllm_did_not_give_drops_its_token(make_trainer, tokenizer, tmp_path):
    trainer = vllm_trainer(make_trainer, tokenizer, tmp_path, offset=0.25, missing_first=True, max_steps=2)
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert torch.isnan(inputs["sampler_logps"][:, 0]).all() and torch.isfinite(inputs["sampler_logps"][:, 1:]).all()
    trainer.train()
    for entry in [entry for entry in trainer.state.log_history if "tv/scale" in entry]:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["tv/estimate"])
        assert entry["tv/nonfinite_tokens"] == 4  # one per completion, dropped and counted
        assert entry["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.25), rel=1e-4)


def test_vllm_tv_estimate_is_weighted_by_the_truncated_importance_ratio(make_trainer, tokenizer, tmp_path):
    """The sampler's log-probabilities are log pi_old - log 2: each X_t counts twice, and the count is unchanged."""
    trainer = vllm_trainer(make_trainer, tokenizer, tmp_path, offset=math.log(2.0))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    sums = []
    for correction in (True, False):
        trainer.args.vllm_importance_sampling_correction = correction
        trainer._rollout_tv.zero_()
        trainer.compute_loss(trainer.model, inputs)
        sums.append(trainer._rollout_tv[0, :2].tolist())
    (weighted, count), (plain, plain_count) = sums
    assert count == plain_count > 0 and plain > 0
    assert weighted == pytest.approx(2.0 * plain, rel=1e-5)


def test_bf16_autocast_reaches_the_loss_and_log_probs_stay_float32(make_trainer, tmp_path):
    trainer = make_trainer(
        tiny_config(tmp_path, bf16=True, max_steps=1),
    )
    seen = []
    projection = trainer.accelerator.unwrap_model(trainer.model).model.layers[0].self_attn.q_proj
    projection.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    seen.clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    assert seen == [torch.bfloat16]  # the loss forward runs under autocast, not silently in fp32
    assert inputs["teacher_logps"].dtype == torch.float32 and loss.dtype == torch.float32
    assert next(projection.parameters()).dtype == torch.float32  # master weights stay fp32
