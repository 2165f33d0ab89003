"""End-to-end tests of TVOPDTrainer on tiny Qwen2 models built from configs (CPU, one process)."""

import copy
import json
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, TrainerCallback

from tvopd_trl import ADVANTAGE_MODES, TVOPDConfig, TVOPDTrainer, TVScheduleCallback, compute_advantages
from tvopd_trl.callbacks import LearningRateScaleCallback, UpdateNormCallback
from tvopd_trl.checkpoints import has_optimizer_state
from tvopd_trl.testing import build_model, tiny_config


DOCUMENTED_METRICS = [
    "tv/estimate",
    "tv/ema",
    "tv/reference",
    "tv/scale",
    "update/norm",
    "advantage/abs_median",
    "advantage/abs_p99",
    "advantage/abs_max",
    "advantage/positive_fraction",
    "advantage/top1pct_energy",
    "advantage/top10pct_energy",
    "clip_ratio/low",
    "clip_ratio/high",
    "kl/reverse_estimate",
    "tv/nonfinite_tokens",
    "tv/frozen",
    "prompts/truncated",
]


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "tv/scale" in entry]


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_every_mode_trains_and_changes_the_student(make_trainer, mode, model_dirs, tmp_path):
    args = tiny_config(tmp_path, advantage_mode=mode, max_steps=2, log_exact_tv=True)
    trainer = make_trainer(args)
    before = parameters(trainer.model)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        for name in DOCUMENTED_METRICS + ["tv/exact"]:
            assert name in entry, name
        assert 0 <= entry["tv/estimate"] <= 1 and 0 <= entry["tv/exact"] <= 1
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "no parameter changed"
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"])
    for name, p in trainer.accelerator.unwrap_model(trainer.teacher_model).named_parameters():
        assert torch.equal(p, dict(teacher.named_parameters())[name]), "the teacher must stay frozen"


def test_lora_student_trains_only_the_adapter(make_trainer, tmp_path):
    args = tiny_config(tmp_path, max_steps=2, advantage_mode="sign", learning_rate=5e-2)
    trainer = make_trainer(
        args,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    before = parameters(trainer.model)
    trainer.train()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)
    assert any("lora_A" in name for name in changed) or any("lora_B" in name for name in changed)


def test_loss_matches_the_direct_formula(make_trainer, tmp_path):
    """compute_loss on one rollout equals -mean(A_t) (ratio 1) and its gradient equals that of the direct surrogate."""
    args = tiny_config(tmp_path, advantage_mode="raw", max_steps=1)
    trainer = make_trainer(args)
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(batch)
    loss = trainer.compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, [p for p in trainer.model.parameters() if p.requires_grad])

    # Direct formula with full logits: A = log p_T - log q (detached), loss = -sum(A * exp(logq - logq.detach())) / N
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    completion_len = inputs["completion_ids"].size(1)

    def sampled_logps(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_len - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)

    student = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        teacher_logps = sampled_logps(trainer.accelerator.unwrap_model(trainer.teacher_model))
    torch.testing.assert_close(inputs["teacher_logps"], teacher_logps, rtol=1e-5, atol=1e-5)
    logps = sampled_logps(student)
    mask = inputs["completion_mask"].bool()
    advantage = (teacher_logps - logps.detach()) * mask
    expected = -(advantage * torch.exp(logps - logps.detach()) * mask).sum() / mask.sum()
    expected_grads = torch.autograd.grad(expected, [p for p in student.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


class RecordingTrainer(TVOPDTrainer):
    """Records every training micro-batch's signals, to recompute the pooled statistics independently."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training:
            self.recorded.append(
                {
                    "global_step": self.state.global_step,
                    "teacher_logps": inputs["teacher_logps"].clone(),
                    "old_logps": inputs.get("old_logps"),
                    "mask": inputs["loss_mask"].clone(),
                    "prompt_len": inputs["prompt_mask"].sum(1).clone(),
                    "batch": {
                        key: inputs[key].clone()
                        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                    },
                }
            )
        return loss

    def _sampled_token_logps(self, model, *args, **kwargs):
        scores = super()._sampled_token_logps(model, *args, **kwargs)
        if model is self.model_wrapped and torch.is_grad_enabled():
            self.last_loss_logps = scores[0].detach().clone()
        return scores


def test_tv_estimate_pools_tokens_over_micro_batches(make_trainer, tmp_path):
    args = tiny_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    trainer = make_trainer(args, trainer_class=RecordingTrainer)
    logps_per_micro_batch = []
    original = trainer.compute_loss

    def compute_loss(*a, **k):
        loss = original(*a, **k)
        logps_per_micro_batch.append(trainer.last_loss_logps)
        return loss

    trainer.compute_loss = compute_loss
    trainer.train()
    logs = step_logs(trainer)
    for step in range(2):
        records = [r for r in trainer.recorded if r["global_step"] == step]
        assert len(records) == 2
        u = n = 0.0
        for record, logps in zip(records, logps_per_micro_batch[2 * step : 2 * step + 2], strict=True):
            x = (1 - torch.exp(record["teacher_logps"] - logps)).clamp(min=0) * record["mask"]
            u, n = u + x.sum().item(), n + record["mask"].sum().item()
        assert logs[step]["tv/estimate"] == pytest.approx(u / n, rel=1e-5)


class TeacherBecomesStudent(TrainerCallback):
    """After every step from the first on, the teacher is a copy of the student: the next rollout has TV = 0."""

    trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.teacher_model.load_state_dict(copy.deepcopy(self.trainer.model.state_dict()))


def converging_trainer(make_trainer, tokenizer, args):
    """A trainer on two different random models whose teacher becomes the student after the first step."""
    callback = TeacherBecomesStudent()
    trainer = make_trainer(
        args,
        model=build_model(tokenizer, seed=0),
        teacher_model=build_model(tokenizer, seed=1),
        teacher_processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.trainer = trainer
    return trainer


def test_scale_starts_at_one_and_falls_at_the_ema_rate_once_the_teacher_is_the_student(
    make_trainer, tokenizer, tmp_path
):
    args = tiny_config(tmp_path, max_steps=10, tv_ema_decay=0.5, tv_min_scale=0.1, learning_rate=1e-3)
    trainer = converging_trainer(make_trainer, tokenizer, args)
    trainer.train()
    logs = step_logs(trainer)
    reference = logs[0]["tv/estimate"]
    assert logs[0]["tv/scale"] == 1.0 and reference > 0
    assert all(entry["tv/estimate"] == 0.0 for entry in logs[1:])
    for k, entry in enumerate(logs[1:], start=1):
        ema = reference * 0.5**k
        assert entry["tv/ema"] == pytest.approx(ema, rel=1e-9)
        expected_scale = max(((reference * 0.5 ** (k - 1) + 1e-5) / (reference + 1e-5)) ** 0.5, 0.1)
        assert entry["tv/scale"] == pytest.approx(expected_scale, rel=1e-9)
    scales = [entry["tv/scale"] for entry in logs]
    assert scales == sorted(scales, reverse=True) and scales[-1] == 0.1


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_the_scale_can_target_the_learning_rate(make_trainer, tokenizer, optim, tmp_path):
    """Under plain SGD the loss is linear in A, so c_k on the advantages and c_k on the learning rate are one update;
    under AdamW they are not (it normalises the gradient's scale away)."""

    def train(target):  # TV = 0 from the second rollout on: c_k falls
        args = tiny_config(
            tmp_path / target, max_steps=6, tv_ema_decay=0.5, optim=optim, weight_decay=0.0, tv_scale_target=target
        )
        trainer = converging_trainer(make_trainer, tokenizer, args)
        trainer.train()
        return trainer, step_logs(trainer)

    by_advantage, advantage_logs = train("advantage")
    by_learning_rate, learning_rate_logs = train("learning_rate")
    scales = [entry["tv/scale"] for entry in learning_rate_logs]
    assert scales == [entry["tv/scale"] for entry in advantage_logs] and scales[0] == 1.0 and scales[-1] < 0.4
    # The logged learning rate is the schedule's, restored after each step.
    assert [e["learning_rate"] for e in learning_rate_logs] == [e["learning_rate"] for e in advantage_logs]
    weights = [dict(t.model.named_parameters()) for t in (by_advantage, by_learning_rate)]
    gaps = [(weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0]]
    if optim == "sgd":
        assert max(gaps) < 1e-6
    else:
        assert max(gaps) > 1e-4


def test_a_learning_rate_target_needs_the_tv_mode(tmp_path):
    with pytest.raises(ValueError, match="advantage_mode='tv'"):
        tiny_config(tmp_path, advantage_mode="sign", tv_scale_target="learning_rate")
    with pytest.raises(ValueError, match="tv_scale_target"):
        tiny_config(tmp_path, tv_scale_target="loss")


def test_two_iterations_reuse_rollouts_and_the_ppo_clip_bites(make_trainer, prompts, tmp_path):
    args = tiny_config(tmp_path, num_iterations=2, max_steps=4, learning_rate=3e-2, advantage_mode="sign")
    trainer = make_trainer(args, trainer_class=RecordingTrainer)
    trainer.train()
    logs = step_logs(trainer)
    # Steps 0 and 1 use rollout A, steps 2 and 3 rollout B: pi_old and the prompts are frozen per rollout.
    first, second = trainer.recorded[0], trainer.recorded[1]
    assert first["old_logps"] is not None and torch.equal(first["old_logps"], second["old_logps"])
    assert not torch.equal(trainer.recorded[1]["old_logps"], trainer.recorded[2]["old_logps"])
    for passes in (logs[0:2], logs[2:4]):
        assert passes[0]["clip_ratio/low"] == 0.0 and passes[0]["clip_ratio/high"] == 0.0  # ratio is 1 on pass one
        assert passes[1]["clip_ratio/low"] + passes[1]["clip_ratio/high"] > 0
    # The scheduler updates once per rollout, after its last step: the estimate is logged on steps 2 and 4 only.
    assert ["tv/estimate" in entry for entry in logs] == [False, True, False, True]


def test_steps_per_generation_splits_one_rollout_over_optimizer_steps(make_trainer, model_dirs, tmp_path):
    args = tiny_config(tmp_path, steps_per_generation=2, max_steps=4, per_device_train_batch_size=2)
    trainer = make_trainer(args, trainer_class=RecordingTrainer)
    initial_student = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    trainer.train()
    logs = step_logs(trainer)
    assert [entry["tv/scale"] for entry in logs][0:2] == [1.0, 1.0]
    assert ["tv/estimate" in entry for entry in logs] == [False, True, False, True]
    # Two different halves of one rollout batch, both scored by the frozen pi_old: the student before the first update,
    # although the second half is trained on after it.
    first, second = trainer.recorded[0], trainer.recorded[1]
    assert not torch.equal(first["batch"]["completion_ids"], second["batch"]["completion_ids"])
    for record in (first, second):
        mask = record["batch"]["completion_mask"].bool()
        with torch.no_grad():
            want, _ = direct_sampled_logps(initial_student, record["batch"])
        torch.testing.assert_close(record["old_logps"][mask], want[mask], rtol=1e-5, atol=1e-5)
    # The scheduler state is logged on every step (NaN, which TRL logs as None, before the first update).
    assert logs[0]["tv/ema"] is None and logs[1]["tv/ema"] == logs[2]["tv/ema"] == logs[1]["tv/estimate"]


def test_the_step_token_count_excludes_tokens_the_loss_drops(make_trainer, tmp_path):
    class CorruptedOldLogps(TVOPDTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            output["old_logps"][:, 0] = float("nan")  # the first token of every rollout has no usable pi_old
            return output

    args = tiny_config(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer = make_trainer(
        args,
        trainer_class=CorruptedOldLogps,
    )
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    micro_batches = []
    for _ in range(4):  # one rollout: 2 optimizer steps of 2 micro-batches
        micro_batches.append(trainer._prepare_inputs(batch))
        trainer._step += 1
    for step in range(2):
        window = micro_batches[2 * step : 2 * step + 2]
        active = sum(int((m["completion_mask"][:, 1:]).sum()) for m in window)  # all but the corrupted first token
        assert all(int(m["step_num_items"]) == active for m in window)


def test_nonfinite_gradient_skips_the_update_and_freezes_the_scheduler(make_trainer, tmp_path):
    class PoisonedTrainer(TVOPDTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * float("nan") if self.state.global_step == 1 else loss

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.params, self.states = [], []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.params.append(parameters(model))
            self.states.append(dict(trainer._tv_scheduler.state_dict()))

    snapshots = Snapshots()
    args = tiny_config(tmp_path, max_steps=3, max_grad_norm=0.0)
    trainer = make_trainer(
        args,
        trainer_class=PoisonedTrainer,
        callbacks=[snapshots],
    )
    trainer.train()
    logs = step_logs(trainer)
    assert math.isnan(logs[1]["grad_norm"]) and logs[1]["update/skipped"] == 1.0 and logs[1]["update/norm"] == 0.0
    assert [entry["tv/frozen"] for entry in logs] == [0.0, 1.0, 0.0]  # the freeze is logged
    for name, value in snapshots.params[1].items():
        assert torch.equal(value, snapshots.params[0][name]), name
    assert snapshots.states[1] == snapshots.states[0]
    assert snapshots.states[2]["num_updates"] == 2 and logs[2]["update/norm"] > 0


def test_update_norm_is_the_realised_parameter_change(make_trainer, tmp_path):
    class Snapshots(TrainerCallback):
        def __init__(self):
            self.params = []

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.params.append(parameters(model))

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.params.append(parameters(model))

    snapshots = Snapshots()
    trainer = make_trainer(
        tiny_config(tmp_path, max_steps=2),
        callbacks=[snapshots],
    )
    trainer.train()
    for step, entry in enumerate(step_logs(trainer)):
        before, after = snapshots.params[step], snapshots.params[step + 1]
        norm = math.sqrt(sum((after[n] - before[n]).double().square().sum().item() for n in before))
        assert entry["update/norm"] == pytest.approx(norm, rel=1e-5)


def test_evaluate_never_touches_the_scheduler(make_trainer, prompts, tmp_path):
    trainer = make_trainer(
        tiny_config(tmp_path, max_steps=2, per_device_eval_batch_size=4), eval_dataset=prompts.select(range(8))
    )
    trainer.train()
    state = dict(trainer._tv_scheduler.state_dict())
    metrics = trainer.evaluate()
    assert trainer._tv_scheduler.state_dict() == state
    assert math.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_tv/estimate"] <= 1
    assert metrics["eval_tv/acceptance"] == pytest.approx(1 - metrics["eval_tv/estimate"], abs=1e-12)
    logged = [entry for entry in trainer.state.log_history if "tv/estimate" in entry and "loss" in entry]
    assert logged and all(entry["tv/acceptance"] == pytest.approx(1 - entry["tv/estimate"]) for entry in logged)


def test_resume_reproduces_the_scheduler_and_the_logged_tv_values(make_trainer, tmp_path):
    def config():
        return tiny_config(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, tv_ema_decay=0.5)

    full = make_trainer(config())
    full.train()
    resumed = make_trainer(config())  # same output_dir: resume from its checkpoint-3
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))

    assert resumed._tv_scheduler.state_dict() == full._tv_scheduler.state_dict()
    assert resumed._tv_scheduler.num_updates == 6
    tv_keys = ["tv/scale", "tv/estimate", "tv/ema", "tv/reference"]
    full_logs = {entry["step"]: entry for entry in step_logs(full)}
    resumed_logs = [entry for entry in step_logs(resumed) if entry["step"] > 3]
    assert [entry["step"] for entry in resumed_logs] == [4, 5, 6]
    for entry in resumed_logs:
        assert {k: entry[k] for k in tv_keys} == {k: full_logs[entry["step"]][k] for k in tv_keys}


@pytest.mark.parametrize(
    "reuse, mode",
    [({"steps_per_generation": 2, "per_device_train_batch_size": 2}, "tv"), ({"num_iterations": 2}, "shuffle")],
)
def test_resume_inside_a_rollout_batch_continues_it_exactly(make_trainer, tmp_path, reuse, mode):
    """A checkpoint at step 3 falls inside the second rollout batch (steps 3 and 4): resuming from it must take the
    same steps on the same tokens (same losses, shuffle permutations included) and update the scheduler after steps 2,
    4 and 6, as the uninterrupted run does."""

    def config(output_dir):
        return tiny_config(
            output_dir,
            max_steps=6,
            save_strategy="steps",
            save_steps=3,
            tv_ema_decay=0.5,
            advantage_mode=mode,
            learning_rate=3e-2,
            **reuse,
        )

    full = make_trainer(config(tmp_path / "full"))
    full.train()
    assert (tmp_path / "full" / "checkpoint-3" / "rollout_state_0.pt").is_file()
    assert not (tmp_path / "full" / "checkpoint-6" / "rollout_state_0.pt").exists()  # a rollout boundary
    resumed = make_trainer(config(tmp_path / "full"))
    resumed.args.output_dir = str(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))

    full_logs = {entry["step"]: entry for entry in step_logs(full)}
    resumed_logs = [entry for entry in step_logs(resumed) if entry["step"] > 3]
    assert [entry["step"] for entry in resumed_logs] == [4, 5, 6]
    assert [step for step, entry in full_logs.items() if "tv/estimate" in entry] == [2, 4, 6]
    assert [entry["step"] for entry in resumed_logs if "tv/estimate" in entry] == [4, 6]
    keys = ["loss", "tv/scale", "tv/estimate", "tv/ema", "tv/reference", "update/norm"]
    for entry in resumed_logs:
        want = full_logs[entry["step"]]
        logged = [k for k in keys if want.get(k) is not None]
        assert logged == [k for k in keys if entry.get(k) is not None]
        assert {k: entry[k] for k in logged} == pytest.approx({k: want[k] for k in logged}, rel=1e-6), entry["step"]
    # The scheduler each run wrote into its last checkpoint
    saved = [
        json.loads((tmp_path / run / "checkpoint-6" / "trainer_state.json").read_text())["stateful_callbacks"][
            "TVScheduleCallback"
        ]["args"]["scheduler_state"]
        for run in ("full", "resumed")
    ]
    assert saved[0]["num_updates"] == saved[1]["num_updates"] == 3
    assert saved[1] == pytest.approx(saved[0], rel=1e-9)


def test_resume_inside_a_rollout_batch_refuses_a_checkpoint_it_cannot_continue(make_trainer, tmp_path):
    args = tiny_config(tmp_path, max_steps=3, save_strategy="steps", save_steps=3, steps_per_generation=2)
    make_trainer(args).train()
    checkpoint = tmp_path / "checkpoint-3"
    other = make_trainer(tiny_config(tmp_path, max_steps=4, steps_per_generation=2, per_device_train_batch_size=2))
    with pytest.raises(ValueError, match="Resume with the settings it was saved with"):
        other.train(resume_from_checkpoint=str(checkpoint))
    (checkpoint / "rollout_state_0.pt").unlink()  # as from an older version
    with pytest.raises(ValueError, match=r"inside a rollout batch of 2 optimizer steps .* multiple of 2 steps"):
        make_trainer(tiny_config(tmp_path, max_steps=4, steps_per_generation=2)).train(
            resume_from_checkpoint=str(checkpoint)
        )


def test_a_checkpoint_of_the_weights_only_is_refused_for_a_resume(make_trainer, tmp_path):
    """transformers would resume from it with fresh AdamW moments and the schedule back at its warmup, silently."""
    args = tiny_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    make_trainer(args).train()
    assert not has_optimizer_state(tmp_path / "checkpoint-2")
    for checkpoint in (str(tmp_path / "checkpoint-2"), True):  # named, or the last complete one
        with pytest.raises(ValueError, match=r"holds the weights only .* `save_only_model: false`"):
            make_trainer(tiny_config(tmp_path, max_steps=4)).train(resume_from_checkpoint=checkpoint)


def test_resuming_with_other_scheduler_settings_warns(make_trainer, tmp_path):
    def config(alpha, max_steps):
        return tiny_config(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=1, tv_alpha=alpha)

    make_trainer(config(0.5, 1)).train()
    resumed = make_trainer(config(0.9, 2))
    with pytest.warns(UserWarning, match="continues with the checkpoint's values"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed._tv_scheduler.alpha == 0.5


def test_resume_restores_the_callback_from_the_checkpoint(make_trainer, tmp_path):
    args = tiny_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = make_trainer(args)
    trainer.train()
    on_disk = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    saved = on_disk["TVScheduleCallback"]["args"]
    assert (
        saved["scheduler_state"] == trainer._tv_scheduler.state_dict() and saved["scheduler_state"]["num_updates"] == 2
    )
    restored = TVScheduleCallback(**saved)
    assert restored.scheduler.state_dict() == trainer._tv_scheduler.state_dict()
    assert restored.scheduler.scale == trainer._tv_scheduler.scale


def test_long_prompts_are_left_truncated_and_counted(make_trainer, prompts, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=1, max_prompt_length=5), trainer_class=RecordingTrainer)
    trainer.train()
    assert step_logs(trainer)[0]["prompts/truncated"] == 4
    assert trainer.recorded[0]["prompt_len"].max().item() == 5


def test_a_prompt_of_no_token_is_refused(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=1), train_dataset=Dataset.from_list([{"prompt": ""}] * 8))
    assert trainer.processing_class("")["input_ids"] == []  # a plain-text prompt, and no BOS token
    with pytest.raises(ValueError, match="A prompt tokenized to no token at all"):
        trainer.train()


def test_a_vocabulary_mismatch_is_refused(make_trainer, tokenizer, tmp_path):
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra>"])
    with pytest.raises(
        ValueError, match="vocabularies differ.*0 only in the student.*1 only in the teacher \\['<extra>'\\]"
    ):
        make_trainer(
            tiny_config(tmp_path),
            teacher_processing_class=other,
        )


def test_off_policy_sampling_and_dtype_mismatch_warn(make_trainer, model_dirs, tmp_path):
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"], dtype=torch.bfloat16)
    with pytest.warns(UserWarning) as record:
        make_trainer(tiny_config(tmp_path, top_p=0.9, top_k=20), teacher_model=teacher)
    messages = " ".join(str(w.message) for w in record)
    assert "top_p=0.9, top_k=20" in messages and "torch.bfloat16" in messages


def test_a_rollout_larger_than_the_dataset_is_refused_before_models_load(prompts, tmp_path):
    args = tiny_config(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=4, steps_per_generation=3)
    with pytest.raises(ValueError, match=r"One rollout batch takes 96 prompts .* the dataset has 64"):
        TVOPDTrainer(model="does/not/exist", teacher_model="also/missing", args=args, train_dataset=prompts)


def test_a_vllm_tensor_parallel_size_that_does_not_divide_the_processes_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda *args, **kwargs: True)
    args = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 does not divide the 1 training processes"):
        TVOPDTrainer(model="does/not/exist", teacher_model="also/missing", args=args)


def test_multimodal_processors_are_refused(make_trainer, tmp_path):
    from transformers import ProcessorMixin

    processor = ProcessorMixin.__new__(ProcessorMixin)
    with pytest.raises(ValueError, match="text-only"):
        make_trainer(tiny_config(tmp_path), processing_class=processor)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"advantage_mode": "bogus"}, "Unknown advantage_mode 'bogus'. Valid modes are: raw, clip"),
        ({"beta": 0.5}, "beta=0.5 selects DistillationTrainer's JSD"),
        ({"tv_alpha": -0.1}, "tv_alpha"),
        ({"tv_ema_decay": 1.0}, "tv_ema_decay"),
        ({"tv_ema_decay": -0.5}, "tv_ema_decay"),
        ({"tv_min_scale": 0.0}, "tv_min_scale"),
        ({"tv_min_scale": 1.5}, "tv_min_scale"),
        ({"tv_eps": 0.0}, "tv_eps"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"steps_per_generation": 0}, "steps_per_generation"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"advantage_mode": "clip", "advantage_clip_low": -1.0}, "advantage_clip_high"),
        ({"advantage_mode": "clip", "advantage_clip_low": 1.0, "advantage_clip_high": -1.0}, "must be <"),
        ({"advantage_mode": "power", "power_gamma": None}, "power_gamma"),
        ({"advantage_mode": "power", "power_gamma": 0.0}, "power_gamma"),
        ({"advantage_mode": "relative_power", "relative_power_beta": None}, "relative_power_beta"),
        ({"advantage_mode": "relative_power", "relative_power_beta": 1.5}, "relative_power_beta"),
    ],
)
def test_invalid_config_values_fail_at_construction(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **overrides)


def test_config_defaults(tmp_path):
    args = TVOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert args.advantage_mode == "tv" and args.epsilon_high == args.epsilon == 0.2
    assert (args.tv_alpha, args.tv_ema_decay, args.tv_min_scale, args.tv_eps) == (0.5, 0.95, 0.1, 1e-5)
    assert args.disable_dropout and args.restore_callback_states_from_checkpoint
    assert (args.num_iterations, args.steps_per_generation, args.max_prompt_length) == (1, 1, 1024)
    clip = TVOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, advantage_mode="clip")
    assert (clip.advantage_clip_low, clip.advantage_clip_high) == (-5.0, 5.0)


@pytest.mark.parametrize(("tf32", "expected"), [(None, True), (False, False), (True, True)])
def test_tf32_defaults_to_on_where_the_gpu_has_it(monkeypatch, tmp_path, tf32, expected):
    """The float32 LM head without TF32 took half of an H200 step (docs/performance.md, section 8): unset `tf32`
    becomes True on a TF32-capable GPU (faked here: this machine has none), and the user's own value stays."""
    import transformers.training_args as training_args

    from tvopd_trl import config

    enabled = []
    monkeypatch.setattr(config, "is_torch_tf32_available", lambda: True)
    monkeypatch.setattr(training_args, "is_torch_tf32_available", lambda: True)
    monkeypatch.setattr(training_args, "enable_tf32", enabled.append)
    args = TVOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, tf32=tf32)
    assert args.tf32 is expected and enabled == [expected]
    monkeypatch.setattr(config, "is_torch_tf32_available", lambda: False)
    assert TVOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).tf32 is None  # a CPU: left as it is


@pytest.mark.parametrize("per_device_train_batch_size", [4, 1])  # the rollout's 4 rows in one chunk, or in 4
def test_vopd_uses_the_exact_reverse_kl(make_trainer, tmp_path, per_device_train_batch_size):
    batches = {
        "per_device_train_batch_size": per_device_train_batch_size,
        "steps_per_generation": 4 // per_device_train_batch_size,
    }
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode="vopd", **batches))
    trainer.model.train()
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    rows = trainer._buffered_inputs  # the whole rollout, back in one piece
    inputs = {key: torch.cat([batch[key] for batch in rows]) for key, value in rows[0].items() if value.dim() > 0}
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    completion_len = inputs["completion_ids"].size(1)
    with torch.no_grad():
        log_q, log_p = (
            torch.log_softmax(
                trainer.accelerator.unwrap_model(m)(input_ids=input_ids, attention_mask=attention_mask).logits[
                    :, -completion_len - 1 : -1
                ],
                -1,
            )
            for m in (trainer.model, trainer.teacher_model)
        )
    mask = inputs["completion_mask"].bool()
    expected_rkl = (log_q.exp() * (log_q - log_p)).sum(-1)
    torch.testing.assert_close(inputs["reverse_kl"][mask], expected_rkl[mask], rtol=1e-4, atol=1e-5)
    expected_tv = 0.5 * (log_q.exp() - log_p.exp()).abs().sum(-1)
    torch.testing.assert_close(inputs["exact_tv"][mask], expected_tv[mask], rtol=1e-4, atol=1e-5)
    old = log_q.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    advantages = compute_advantages(
        "vopd", teacher_logps=inputs["teacher_logps"], old_logps=old, mask=mask, reverse_kl=inputs["reverse_kl"]
    )
    torch.testing.assert_close(
        advantages[mask], (inputs["teacher_logps"] - old + expected_rkl)[mask], rtol=1e-4, atol=1e-5
    )


def test_model_card_names_the_method_and_the_paper(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=1))
    trainer.create_model_card(model_name="tiny-tvopd")
    card = (tmp_path / "README.md").read_text()
    assert "TV-Regulated OPD: Direction Matters in On-Policy Distillation" in card
    assert "xiao2026tvopd" in card and "tv-opd" in card


def test_an_iterable_dataset_feeds_rollout_batches(make_trainer, prompts, tmp_path):
    args = tiny_config(tmp_path, max_steps=4, steps_per_generation=2, per_device_train_batch_size=2)
    trainer = make_trainer(args, trainer_class=RecordingTrainer, train_dataset=prompts.to_iterable_dataset())
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 4 and ["tv/estimate" in entry for entry in logs] == [False, True, False, True]
    assert all(record["old_logps"] is not None for record in trainer.recorded)


# ----------------------------------------------------------------------------------------------------------------------
# The teacher: evaluation mode and tokenizer checks
# ----------------------------------------------------------------------------------------------------------------------


def test_a_teacher_passed_in_train_mode_with_dropout_scores_deterministically(make_trainer, model_dirs, tmp_path):
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"], attention_dropout=0.5)
    teacher.train()
    trainer = make_trainer(tiny_config(tmp_path), teacher_model=teacher)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    generated = {key: batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    first = trainer.score_completions(dict(generated))["teacher_logps"]
    teacher.train()  # whatever happens to it between rollouts (a callback, a user's code)
    second = trainer.score_completions(dict(generated))["teacher_logps"]
    assert torch.equal(first, second) and torch.equal(first, batch["teacher_logps"])
    assert not teacher.training


def test_a_teacher_named_by_hub_id_has_its_tokenizer_compared(
    make_trainer, tokenizer, model_dirs, monkeypatch, tmp_path
):
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra>"])
    loaded = []

    def from_pretrained(source, **kwargs):
        loaded.append(source)
        if source == "some-org/teacher":
            return other
        raise OSError(f"{source} is not a local folder and the Hub is unreachable")

    monkeypatch.setattr("tvopd_trl.checks.AutoTokenizer.from_pretrained", from_pretrained)
    # A mismatch is an error, before any model loads (the id does not exist as a model anywhere)
    with pytest.raises(ValueError, match="vocabularies differ"):
        make_trainer(tiny_config(tmp_path), teacher_model="some-org/teacher")
    assert loaded == ["some-org/teacher"]
    # Only a teacher whose tokenizer cannot be loaded at all falls back to the warning
    with pytest.warns(UserWarning, match="teacher's tokenizer is unknown, so only vocab_size was compared"):
        make_trainer(tiny_config(tmp_path), teacher_model=AutoModelForCausalLM.from_pretrained(model_dirs["teacher"]))


# ----------------------------------------------------------------------------------------------------------------------
# The loss against the direct formula, with c_k != 1, and called the way TRL calls it
# ----------------------------------------------------------------------------------------------------------------------


def direct_sampled_logps(model, inputs):
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    completion_len = inputs["completion_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_len - 1 : -1]
    log_p = torch.log_softmax(logits.float(), -1)
    return log_p.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1), log_p


@pytest.mark.parametrize("mode", ["tv", "sign", "relative_power"])
def test_loss_and_gradient_match_the_direct_formula_with_a_scale_below_one(make_trainer, tmp_path, mode):
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode=mode))
    scheduler = trainer._tv_scheduler
    scheduler.load_state_dict({"ema": 0.04, "reference": 0.16, "num_updates": 5})
    assert scheduler.scale == pytest.approx(0.5, rel=1e-3)  # sqrt((0.04 + eps) / (0.16 + eps))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params)
    assert trainer.rollout_scale == scheduler.scale

    student = trainer.accelerator.unwrap_model(trainer.model)
    logps, _ = direct_sampled_logps(student, inputs)
    mask = inputs["completion_mask"].bool()
    delta = (inputs["teacher_logps"] - logps.detach()) * mask
    sign = torch.sign(delta)
    if mode == "tv":
        advantage = scheduler.scale * sign
    elif mode == "sign":
        advantage = sign
    else:  # z * S * R^beta / mean(R^beta), per sequence
        magnitude = delta.abs()
        s = magnitude.sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        r_beta = torch.where(mask, (magnitude / s) ** 0.4, 0.0)
        advantage = sign * s * r_beta / (r_beta.sum(1, keepdim=True) / mask.sum(1, keepdim=True))
    expected = -(advantage * torch.exp(logps - logps.detach()) * mask).sum() / mask.sum()
    expected_grads = torch.autograd.grad(expected, params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_compute_loss_accepts_a_generated_batch_alone_as_trl_calls_it(make_trainer, tmp_path):
    """TRL's tests and custom loops call `compute_loss(model, batch)` with the four generation keys only: the teacher
    is scored on the spot and the loss is the token mean, or the sum over `num_items_in_batch`."""
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode="raw"))
    trainer.model.train()
    full = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    batch = {key: full[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    loss = trainer.compute_loss(trainer.model, batch)

    student = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    logps, log_q = direct_sampled_logps(student, batch)
    with torch.no_grad():
        teacher_logps, _ = direct_sampled_logps(teacher, batch)
    mask = batch["completion_mask"].bool()
    per_token = -((teacher_logps - logps.detach()) * mask)
    torch.testing.assert_close(loss, per_token.sum() / mask.sum(), rtol=1e-5, atol=1e-6)
    summed = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(summed, per_token.sum() / 7, rtol=1e-5, atol=1e-6)
    # A standalone call is logged at once (like TRL), entropy included, and never touches the rollout accumulators
    metrics = trainer._metrics["train"]
    entropy = -(log_q.exp() * log_q).sum(-1)
    assert metrics["entropy"][-1] == pytest.approx(entropy[mask].mean().item(), rel=1e-5)
    assert trainer._step_statistics.sums is None and not trainer._rollout_tv.any()


def test_entropy_is_logged_over_active_completion_tokens(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=1, gradient_accumulation_steps=2, learning_rate=0.0))
    batches = []
    original = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        batches.append(inputs)
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    trainer.train()
    student = trainer.accelerator.unwrap_model(trainer.model)
    total = count = 0.0
    with torch.no_grad():
        for inputs in batches:
            _, log_q = direct_sampled_logps(student, inputs)
            mask = inputs["completion_mask"].bool()
            total += (-(log_q.exp() * log_q).sum(-1))[mask].sum().item()
            count += mask.sum().item()
    (entry,) = step_logs(trainer)
    assert entry["entropy"] == pytest.approx(total / count, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# Around the optimizer step: the update-norm copy and the learning-rate target's weight decay
# ----------------------------------------------------------------------------------------------------------------------


def test_without_log_update_norm_no_parameter_copy_is_taken(make_trainer, tmp_path, monkeypatch):
    def clone_locals(parameters):
        raise AssertionError("a parameter copy was taken")

    monkeypatch.setattr("tvopd_trl.bucketed_step.clone_locals", clone_locals)
    trainer = make_trainer(tiny_config(tmp_path, max_steps=2, log_update_norm=False))
    assert not any(isinstance(callback, UpdateNormCallback) for callback in trainer.callback_handler.callbacks)
    before = parameters(trainer.model)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2 and all("update/norm" not in entry for entry in logs)
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_the_learning_rate_target_leaves_decoupled_weight_decay_unscaled(make_trainer, tmp_path, optim):
    """With no gradient signal, one AdamW step only decays the weights: by lr * weight_decay whatever c_k is. SGD's
    weight decay is part of the gradient, so it scales with the step (documented)."""
    trainer = make_trainer(
        tiny_config(tmp_path, tv_scale_target="learning_rate", optim=optim, weight_decay=0.1, learning_rate=0.01)
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.optimizer = trainer.accelerator.prepare(trainer.optimizer)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in params]
    trainer.rollout_scale = 0.25
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, LearningRateScaleCallback)]
    callback.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control, optimizer=trainer.optimizer)
    trainer.optimizer.step()
    callback.on_optimizer_step(trainer.args, trainer.state, trainer.control, optimizer=trainer.optimizer)
    decayed = [group for group in trainer.optimizer.param_groups if group["weight_decay"] > 0]
    assert decayed and all(group["lr"] == 0.01 and group["weight_decay"] == 0.1 for group in decayed)  # restored
    decayed_params = {id(p) for group in decayed for p in group["params"]}
    factor = 1 - 0.01 * 0.1 * (1.0 if optim == "adamw_torch" else 0.25)
    for p, old in zip(params, before, strict=True):
        want = old * factor if id(p) in decayed_params else old
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------------------------------------------------
# Settings that break the estimator's assumptions warn
# ----------------------------------------------------------------------------------------------------------------------


def test_dropout_left_on_warns(tmp_path):
    with pytest.warns(UserWarning, match="disable_dropout=False: with dropout on"):
        tiny_config(tmp_path, disable_dropout=False)


def test_bf16_on_cpu_warns_and_names_the_fix(make_trainer, tmp_path):
    with pytest.warns(UserWarning, match="bf16=True on CPU.*Set bf16=False"):
        make_trainer(tiny_config(tmp_path, bf16=True))
