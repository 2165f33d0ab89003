"""Several teachers: routing by `teacher_id`, each row scored once by its own teacher, one TV scale per teacher."""

import copy
import itertools
import math
import types
from pathlib import Path

import pytest
import torch

from tvopd_trl import TVOPDTrainer, TVScheduleCallback
from tvopd_trl.advantages import ADVANTAGE_MODES
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import prompt_dataset
from tvopd_trl.tv import TVScheduler


def routed(n, names=("wide", "self"), pattern=None):
    """The first `n` OPD prompts; row i goes to `names[pattern[i]]` (alternating by default)."""
    dataset = prompt_dataset("opd", n)
    pattern = pattern or [i % len(names) for i in range(n)]
    return dataset.add_column("teacher_id", [names[k] for k in pattern])


@pytest.fixture
def two_teachers(model_dirs):
    # "self" is the student's own checkpoint: on its rows, the first rollout's delta is 0 up to rounding
    return {"wide": model_dirs["teacher"], "self": model_dirs["student"]}


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "tv/estimate" in entry and "loss" in entry]


def test_each_row_is_scored_once_by_its_own_teacher(make_trainer, two_teachers, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_config(tmp_path), teacher_model=two_teachers, train_dataset=routed(8))
    assert list(trainer.teachers) == ["wide", "self"] and trainer.per_teacher_scale
    scored = []
    original = TVOPDTrainer._sampled_token_logps

    def counting(self, model, input_ids, *args, **kwargs):
        names = [name for name, t in self.teachers.items() if t.model is model]
        scored.append((names[0] if names else "student", input_ids.size(0)))
        return original(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(TVOPDTrainer, "_sampled_token_logps", counting)
    prompts = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(prompts))
    assert sorted(scored) == [("self", 4), ("wide", 4)]
    assert batch["teacher_index"].tolist() == [0, 1] * 4

    monkeypatch.setattr(TVOPDTrainer, "_sampled_token_logps", original)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    for index, teacher in enumerate(trainer.teachers.values()):
        rows = batch["teacher_index"] == index
        alone = trainer._sampled_token_logps(teacher.model, ids[rows], mask[rows], keep)
        torch.testing.assert_close(batch["teacher_logps"][rows], alone, rtol=0, atol=0)
    student = trainer._sampled_token_logps(trainer.model, ids, mask, keep)
    own = batch["teacher_index"] == 1
    torch.testing.assert_close(batch["teacher_logps"][own], student[own], rtol=0, atol=1e-6)
    assert not torch.allclose(batch["teacher_logps"][~own], student[~own])


@pytest.mark.parametrize(
    ("teachers", "dataset", "message"),
    [
        ({"wide": "T", "self": "S"}, lambda: prompt_dataset("opd", 8), "lacks"),
        ({"wide": "T", "self": "S"}, lambda: routed(8, names=("wide", "other")), r"unknown teachers \['other'\]"),
        ({"wide": "T", "self": "S"}, lambda: routed(8, pattern=[0] * 8), "No prompt names teacher 'self'"),
        ({"wide": "T", "self": ""}, lambda: routed(8), "Teacher 'self' is empty"),
    ],
)
def test_routing_errors_come_before_any_model_loads(teachers, dataset, message, tmp_path):
    # The model paths do not exist: the routing error must come first
    with pytest.raises(ValueError, match=message):
        TVOPDTrainer(
            model="/missing/student", teacher_model=teachers, args=tiny_config(tmp_path), train_dataset=dataset()
        )


@pytest.mark.parametrize(
    ("eval_dataset", "message"),
    [
        (lambda: prompt_dataset("test", 4), "lacks"),
        (lambda: {"held_out": routed(4, names=("wide", "other"))}, r"unknown teachers \['other'\]"),
    ],
)
def test_an_eval_dataset_is_routed_too(eval_dataset, message, tmp_path):
    teachers = {"wide": "T", "self": "S"}
    kwargs = dict(model="/missing/student", teacher_model=teachers, args=tiny_config(tmp_path))
    with pytest.raises(ValueError, match=message):
        TVOPDTrainer(**kwargs, train_dataset=routed(8), eval_dataset=eval_dataset())
    # An evaluation set may hold one teacher's prompts only: past the routing checks, to the missing student
    with pytest.raises(OSError):
        TVOPDTrainer(**kwargs, train_dataset=routed(8), eval_dataset=routed(4, pattern=[0] * 4))


def test_a_name_both_local_and_served_is_refused(tmp_path):
    args = tiny_config(tmp_path, teacher_model_server_url='{"wide": "http://localhost:1"}')
    assert args.teacher_model_server_url == {"wide": "http://localhost:1"}  # JSON from the command line
    with pytest.raises(ValueError, match="both a local model and a server"):
        TVOPDTrainer(model="/missing", teacher_model={"wide": "T"}, args=args, train_dataset=routed(8))


def test_teacher_tokenizers_are_given_by_name(make_trainer, two_teachers, tokenizer, tmp_path):
    kwargs = dict(teacher_model=two_teachers, train_dataset=routed(8))
    with pytest.raises(ValueError, match=r"unknown teachers \['other'\]"):
        make_trainer(tiny_config(tmp_path), teacher_processing_class={"other": tokenizer}, **kwargs)
    trainer = make_trainer(tiny_config(tmp_path), teacher_processing_class={"wide": tokenizer}, **kwargs)
    assert list(trainer.teachers) == ["wide", "self"]


def test_one_tokenizer_is_every_teachers(make_trainer, two_teachers, tokenizer, tmp_path, monkeypatch):
    import tvopd_trl.checks
    import tvopd_trl.trainer

    compared = []
    check = tvopd_trl.checks.check_shared_vocabulary

    def recording(student, teacher, cross_tokenizer=False):
        compared.append(teacher)
        return check(student, teacher, cross_tokenizer)

    for module in (tvopd_trl.checks, tvopd_trl.trainer):
        monkeypatch.setattr(module, "check_shared_vocabulary", recording)
    kwargs = dict(teacher_model=two_teachers, train_dataset=routed(8))
    trainer = make_trainer(tiny_config(tmp_path), teacher_processing_class=tokenizer, **kwargs)
    assert list(trainer.teachers) == ["wide", "self"]
    # Once per teacher (each call reads both vocabularies), with the given tokenizer, not one loaded from its folder
    assert len(compared) == 2 and all(teacher is tokenizer for teacher in compared)
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"vocabularies differ.*1 only in the teacher \['<extra>'\]"):
        make_trainer(tiny_config(tmp_path), teacher_processing_class=other, **kwargs)


def test_learning_rate_target_needs_one_pooled_scale(tmp_path):
    args = tiny_config(tmp_path, tv_scale_target="learning_rate")
    with pytest.raises(ValueError, match="tv_scale_per_teacher=False"):
        TVOPDTrainer(model="/missing", teacher_model={"wide": "T", "self": "S"}, args=args, train_dataset=routed(8))


def test_each_teacher_has_its_own_scale_fed_by_its_own_rows(make_trainer, two_teachers, tmp_path):
    # Rollouts of 4 in dataset order: steps 1 and 3 see only "self", steps 2 and 4 only "wide". Each reference is its
    # first rollout's (the paper's rule; `test_a_rarely_routed_teachers_reference_pools_several_rollouts` has the default)
    args = tiny_config(tmp_path, max_steps=4, shuffle_dataset=False, tv_ema_decay=0.5, tv_reference_min_tokens=0)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(8, pattern=[1] * 4 + [0] * 4))
    trainer.train()
    logs = step_logs(trainer)
    wide, own = [[entry[f"tv/{name}/estimate"] for entry in logs] for name in ("wide", "self")]
    # Frozen without rows: no estimate (logged as None, JSON's NaN)
    assert all(value is None or math.isnan(value) for value in (wide[0], own[1], wide[2], own[3]))
    assert own[0] == pytest.approx(0.0, abs=1e-6) and wide[1] > 0.05  # before its first update the student is "self"
    # Each scheduler folded exactly its own estimates, in order
    wide_scheduler, own_scheduler = trainer._tv_schedulers
    assert wide_scheduler.num_updates == own_scheduler.num_updates == 2
    assert wide_scheduler.reference == pytest.approx(wide[1]) and own_scheduler.reference == pytest.approx(own[0])
    assert wide_scheduler.ema == pytest.approx(0.5 * wide[1] + 0.5 * wide[3])
    assert logs[2]["tv/self/scale"] == pytest.approx(1.0)  # EMA = reference after one update
    # Each teacher's reverse-KL estimate is over its own rows: about 0 for "self" before the first update
    assert (
        logs[0]["kl/self/reverse_estimate"] == pytest.approx(0.0, abs=1e-5)
        and abs(logs[1]["kl/wide/reverse_estimate"]) > 1e-3
    )
    assert logs[0]["kl/reverse_estimate"] == pytest.approx(logs[0]["kl/self/reverse_estimate"])
    # The pooled estimate is every row's; there is no pooled scale
    assert logs[1]["tv/estimate"] == pytest.approx(wide[1]) and "tv/scale" not in logs[0]


def test_a_rows_advantage_uses_its_teachers_scale(make_trainer, two_teachers, tmp_path):
    args = tiny_config(tmp_path, max_steps=1, gradient_accumulation_steps=2)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(8))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    seen = {}
    original = TVOPDTrainer.compute_loss

    def capture(mode, delta, **kwargs):
        seen["scale"] = kwargs["scale"]
        return torch.zeros_like(delta.delta)

    import tvopd_trl.trainer as trainer_module

    trainer.rollout_scales = [0.25, 0.5]
    trainer._step = 1  # inside the rollout batch: the held scales are used
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "advantages_from_delta", capture)
        original(trainer, trainer.model, inputs)
    expected = torch.tensor([0.25, 0.5])[inputs["teacher_index"]].unsqueeze(1)
    torch.testing.assert_close(seen["scale"], expected)


def test_every_logged_per_teacher_metric_is_documented(make_trainer, two_teachers, tmp_path):
    args = tiny_config(tmp_path, max_steps=1, tv_reference_min_tokens=0)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(8))
    trainer.train()
    table = (Path(__file__).parent.parent / "docs" / "method.md").read_text().split("## 5. Metrics")[1]
    per_teacher = {key for key in step_logs(trainer)[0] if "/wide/" in key or "/self/" in key}
    assert len(per_teacher) == 10  # tv/<teacher>/{estimate,ema,reference,scale}, kl/<teacher>/reverse_estimate
    for key in per_teacher:
        assert f"`{key.replace('/wide/', '/<teacher>/').replace('/self/', '/<teacher>/')}`" in table, key


def test_pooled_scale_over_several_teachers(make_trainer, two_teachers, tmp_path):
    args = tiny_config(tmp_path, max_steps=2, tv_scale_per_teacher=False)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(8))
    trainer.train()
    assert not trainer.per_teacher_scale and len(trainer._tv_schedulers) == 1
    logs = step_logs(trainer)
    assert all("tv/scale" in entry and "tv/wide/scale" not in entry for entry in logs)
    assert trainer._tv_scheduler.num_updates == 2


def test_resume_restores_every_teachers_scheduler(make_trainer, two_teachers, tmp_path):
    def run(resume=None):
        # Each teacher has at most 2 x 8 tokens a rollout: the checkpoint at step 2 is taken while both pool theirs
        args = tiny_config(
            tmp_path, max_steps=4, save_strategy="steps", save_steps=2, tv_ema_decay=0.5, tv_reference_min_tokens=33
        )
        trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(16))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run()
    resumed = run(str(tmp_path / "checkpoint-2"))
    for a, b in zip(full._tv_schedulers, resumed._tv_schedulers, strict=True):
        assert a.state_dict() == b.state_dict() and a.num_updates == 4 and a.reference is not None
    full_logs = {entry["step"]: entry for entry in step_logs(full)}
    assert not any(f"tv/{name}/reference" in full_logs[2] for name in ("wide", "self"))
    for entry in step_logs(resumed):
        want = full_logs[entry["step"]]
        for key in ("tv/wide/scale", "tv/self/scale", "tv/wide/estimate", "tv/self/ema", "tv/wide/reference"):
            assert (key in entry) == (key in want), (entry["step"], key)
            assert entry.get(key) == pytest.approx(want.get(key), nan_ok=True), (entry["step"], key)


def test_a_rarely_routed_teachers_reference_pools_several_rollouts(make_trainer, two_teachers, tmp_path, monkeypatch):
    # One "self" row in each rollout of 4: at most 8 of its tokens a rollout, against up to 24 of "wide"'s
    args = tiny_config(tmp_path, max_steps=8, shuffle_dataset=False, tv_reference_min_tokens=20)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(32, pattern=[1, 0, 0, 0] * 8))
    totals = {"wide": [], "self": []}
    update = TVScheduler.update

    def recording(scheduler, u, n, grad_norm=None):
        name = list(trainer.teachers)[trainer._tv_schedulers.index(scheduler)]
        totals[name].append((float(u), float(n)))
        return update(scheduler, u, n, grad_norm=grad_norm)

    monkeypatch.setattr(TVScheduler, "update", recording)
    trainer.train()
    logs = step_logs(trainer)
    fixed_at = {}
    for name, rollouts in totals.items():
        tokens = itertools.accumulate(n for _, n in rollouts)
        fixed = fixed_at[name] = next(k for k, count in enumerate(tokens) if count >= 20)
        reference = sum(u for u, _ in rollouts[: fixed + 1]) / sum(n for _, n in rollouts[: fixed + 1])
        assert trainer._tv_schedulers[list(totals).index(name)].reference == reference  # their token mean
        for k, entry in enumerate(logs):
            assert (f"tv/{name}/reference" in entry) == (k >= fixed), (name, k)
            assert (f"tv/{name}/ema" in entry) == (k >= fixed), (name, k)
            if k <= fixed + 1:  # 1 until the rollout after the one that fixes the reference has read it
                assert entry[f"tv/{name}/scale"] == 1.0, (name, k)
        assert logs[fixed][f"tv/{name}/reference"] == pytest.approx(reference)
    assert fixed_at["self"] >= 2 > fixed_at["wide"]  # "self" needed at least 3 rollouts


def test_a_checkpoint_from_before_the_minimum_resumes_as_it_ran():
    # An earlier version's callback state has no `reference_min_tokens`: its teachers keep the first-rollout rule
    saved = {"wide": {"ema": 0.2, "reference": 0.3, "num_updates": 1}, "self": None}
    callback = TVScheduleCallback(teacher_states=saved)
    assert [s.reference_min_tokens for s in callback.teacher_schedulers.values()] == [0, 0]
    callback.teacher_schedulers["self"].update(1.0, 10)
    assert callback.teacher_schedulers["self"].reference == 0.1
    stored = r"tv_reference_min_tokens\) = \(0\.5, 0\.95, 0\.1, 1e-05, 0\), but the config"
    with pytest.warns(UserWarning, match=stored):
        callback.on_train_begin(types.SimpleNamespace(tv_reference_min_tokens=1000), None, None)
    assert "reference_min_tokens" in callback.state()["args"]


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_every_mode_trains_with_two_teachers(mode, make_trainer, two_teachers, tmp_path):
    args = tiny_config(tmp_path, advantage_mode=mode, max_steps=1, log_exact_tv=True)
    trainer = make_trainer(args, teacher_model=two_teachers, train_dataset=routed(8))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    (entry,) = step_logs(trainer)
    assert math.isfinite(entry["loss"]) and 0 <= entry["tv/exact"] <= 1


# ----------------------------------------------------------------------------------------------------------------------
# Padded-vocabulary siblings: one tokenizer, output layers of different sizes
# ----------------------------------------------------------------------------------------------------------------------


def padded_copy(path, tmp_path, name, multiple=64):
    """The checkpoint at `path` with its output layer padded to a multiple of `multiple` rows (300 -> 320)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(model.config.vocab_size, pad_to_multiple_of=multiple)
    model.save_pretrained(tmp_path / name)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / name)
    return str(tmp_path / name), model.config.vocab_size


def test_a_padded_student_never_samples_a_padded_id(make_trainer, model_dirs, tokenizer, tmp_path):
    student, rows = padded_copy(model_dirs["student"], tmp_path, "student", multiple=128)
    assert rows == 384 > len(tokenizer) == 300
    trainer = make_trainer(tiny_config(tmp_path / "run", max_steps=4, per_device_train_batch_size=16), model=student)
    sampled = []
    original = trainer.score_completions

    def record(batch, *args, **kwargs):
        sampled.append(batch["completion_ids"][batch["completion_mask"].bool()])
        return original(batch, *args, **kwargs)

    trainer.score_completions = record
    # Push the padded rows' mass up, so that an unsuppressed sampler would draw them
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight[300:] = trainer.model.get_output_embeddings().weight[300:] * 50
    trainer.train()
    ids = torch.cat(sampled)
    assert ids.numel() > 100 and int(ids.max()) < len(tokenizer)


def test_a_padded_teacher_scores_up_to_its_padded_mass(make_trainer, model_dirs, tmp_path):
    teacher, rows = padded_copy(model_dirs["teacher"], tmp_path, "teacher")
    padded = make_trainer(tiny_config(tmp_path / "padded", max_steps=2), teacher_model=teacher)
    plain = make_trainer(tiny_config(tmp_path / "plain", max_steps=2))
    prompts = [padded.train_dataset[i] for i in range(4)]
    batch = padded.score_completions(padded.generate_completions(prompts))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    unpadded = plain._sampled_token_logps(plain.teacher_model, ids, mask, keep)
    # The padded head's softmax spends mass m on the padded rows: log p_padded = log p - log(1 / (1 - m)) exactly
    with torch.no_grad():
        logits = padded.teacher_model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1 : -1].float()
    mass = logits.softmax(-1)[..., 300:].sum(-1)
    active = batch["completion_mask"].bool()
    assert mass[active].max() > 1e-4  # the padded rows do hold mass
    torch.testing.assert_close(
        batch["teacher_logps"][active], (unpadded + torch.log1p(-mass))[active], rtol=0, atol=1e-5
    )
    padded.train()
    assert all(math.isfinite(entry["loss"]) for entry in step_logs(padded))


def test_exact_divergences_need_output_layers_of_one_size(make_trainer, model_dirs, tmp_path):
    teacher, _ = padded_copy(model_dirs["teacher"], tmp_path, "teacher")
    with pytest.raises(ValueError, match=r"output layers of one size; these have \[300, 320\]"):
        make_trainer(tiny_config(tmp_path / "run", log_exact_tv=True), teacher_model=teacher)


def test_resuming_with_the_other_scale_layout_is_refused(make_trainer, two_teachers, tmp_path):
    def trainer(per_teacher, max_steps):
        args = tiny_config(
            tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, tv_scale_per_teacher=per_teacher
        )
        return make_trainer(args, teacher_model=two_teachers, train_dataset=routed(16))

    trainer(True, 2).train()
    with pytest.raises(
        ValueError, match=r"holds a TV scheduler per teacher, .* resume with tv_scale_per_teacher=True"
    ):
        trainer(False, 4).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
