"""TRL's own DistillationTrainer as the main job's comparison (`trl_baseline`, `tvopd_trl.trl_baseline`): its teacher
reads each completion after the row's teacher prompt, exactly as rendered; it trains; the job runs it and reports it
like any run; what it cannot run is refused."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from tvopd_trl import tiny
from tvopd_trl.scripts import train
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny.hint_task import prompt_dataset
from tvopd_trl.trl_baseline import trl_baseline_trainer


def _trainer(tmp_path, rows=8, **overrides):
    path = tiny.hint_student_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    args = tiny_config(tmp_path, self_distillation="frozen", temperature=1.0, **overrides)
    return trl_baseline_trainer(path, None, args, prompt_dataset("opd", rows), tokenizer), tokenizer


def test_the_teacher_reads_each_completion_after_its_teacher_prompt(tmp_path):
    trainer, tokenizer = _trainer(tmp_path)
    rows = prompt_dataset("opd", 4)
    prompts = trainer._tokenize_prompts(list(rows["prompt"]))[0]
    width = max(map(len, prompts))
    completions = torch.tensor([[11, 12, 13], [14, 15, 0], [16, 0, 0], [17, 18, 19]])
    completion_mask = (completions != 0).long()
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    teacher_ids, teacher_mask = trainer.after_teacher_prompts(
        torch.cat([ids, completions], 1), torch.cat([mask, completion_mask], 1), completions.size(1)
    )
    assert torch.equal(teacher_ids[:, -3:], completions) and torch.equal(teacher_mask[:, -3:], completion_mask)
    for row, teacher_prompt in enumerate(rows["teacher_prompt"]):
        expected = tokenizer.apply_chat_template(teacher_prompt, add_generation_prompt=True, return_dict=False)
        prompt = teacher_ids[row, :-3][teacher_mask[row, :-3].bool()].tolist()
        assert prompt == list(expected) and len(prompt) > len(prompts[row])  # the hint's system turn is in it
        assert teacher_mask[row, : -3 - len(prompt)].sum() == 0  # left padding only
    other = torch.tensor([[5, 6, 7, 11]])
    with pytest.raises(KeyError, match="without a teacher prompt"):
        trainer.after_teacher_prompts(other, torch.ones_like(other), 1)


def test_trl_s_trainer_trains_the_student_against_its_frozen_self_with_the_hint(tmp_path):
    trainer, _ = _trainer(tmp_path, max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.teacher_model.parameters(), strict=True))


def test_the_main_job_runs_trl_s_trainer_and_reports_it_like_any_run(tmp_path):
    out = tmp_path / "run"
    argv = ["--config", "recipes/tiny/self_distill.yaml", "--trl_baseline", "true", "--self_distillation", "frozen"]
    argv += ["--max_steps", "3", "--eval_problems", "16", "--eval_every_steps", "2", "--output_dir", str(out)]
    assert train.run(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["advantage_mode"] == "trl" and summary["steps"] == 3 and summary["final_tv_estimate"] is None
    assert summary["student_accuracy_hinted"] > summary["student_accuracy_before"]
    assert summary["plots"] == ["accuracy.png"]  # TRL's trainer logs no TV, update or advantage metrics
    assert [step for step, _ in summary["accuracy_curve"]] == [0, 2, 3]  # the curve's evaluation logs its score
    logged = [entry for entry in json.loads((out / "log_history.json").read_text()) if "eval/tiny/mean@4" in entry]
    assert [entry["step"] for entry in logged] == [2]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--config", "tiny/self_distill"], "set `self_distillation: frozen`"),
        (["--config", "tiny/tvopd", "--teacher_model_server_url", "http://127.0.0.1:1"], "no teacher server"),
    ],
)
def test_what_trl_s_trainer_cannot_run_is_refused_before_any_model_loads(flags, message, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "load_job", None)  # refused before it is called
    argv = [*flags, "--trl_baseline", "true", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=message):
        train.run(argv)
