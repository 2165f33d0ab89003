"""The trainer on a real pretrained model: SmolLM2-135M-Instruct (`tvopd-trl models`, built once into pytest's cache by
`smollm2_dir`), with its own tokenizer, ChatML template (and default system prompt), EOS `<|im_end|>` and weights.

Its per-token log-probabilities, the student's after its prompt and the teacher's after a few-shot teacher prompt, are
checked against a plain transformers forward of each chat-templated row alone; then a few steps of context
distillation with a live self-teacher, the evaluation command and the doctor on it. Skipped, with the reason, where the model
cannot be had (no package registry, no `gguf`)."""

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl import TVOPDTrainer, cli
from tvopd_trl.testing import tiny_config


QUESTIONS = [
    "What is the capital of Italy?",
    "Which planet is known as the red planet, and why is it called that?",
    "Who wrote Hamlet?",
    "What gas do plants take in from the air to make their food during photosynthesis?",
]
# Few-shot turns: the model answers tersely after them (docs of issue 57: 83% of answers in ten words or fewer)
FEW_SHOT = [
    ("What is the capital of France?", "Paris."),
    ("How many legs does a spider have?", "Eight."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci."),
    ("What is the boiling point of water at sea level?", "100 degrees Celsius."),
]


def few_shot_dataset():
    turns = [
        message
        for q, a in FEW_SHOT
        for message in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": q}], "teacher_prompt": [*turns, {"role": "user", "content": q}]}
            for q in QUESTIONS
        ]
    )


def by_hand(model, tokenizer, prompt, completion):
    """log pi(completion token | the chat-templated prompt, tokens before it), one row alone, at temperature 1."""
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_the_trainer_scores_the_real_model_as_a_plain_forward(smollm2_dir, tmp_path):
    dataset = few_shot_dataset()
    args = tiny_config(tmp_path, temperature=1.0, max_completion_length=12, per_device_train_batch_size=4)
    trainer = TVOPDTrainer(model=smollm2_dir, teacher_model=smollm2_dir, args=args, train_dataset=dataset)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert trainer.processing_class.eos_token_id == eos and trainer.processing_class.padding_side == "left"
    rows = [dataset[i] for i in range(4)]
    torch.manual_seed(0)
    batch = trainer.score_completions(trainer.generate_completions(rows), old_logps=True)
    prompt_lengths = batch["prompt_mask"].sum(dim=1)
    assert len(set(prompt_lengths.tolist())) > 1  # rows of other lengths: left padding in the batch
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    for index, row in enumerate(rows):
        completion = batch["completion_ids"][index][batch["completion_mask"][index].bool()].tolist()
        assert eos not in completion[:-1]  # a completion ends at the real EOS, if it has one
        length = len(completion)
        student = by_hand(model, tokenizer, row["prompt"], completion)
        teacher = by_hand(model, tokenizer, row["teacher_prompt"], completion)
        torch.testing.assert_close(batch["old_logps"][index][:length].double(), student, atol=1e-4, rtol=0)
        torch.testing.assert_close(batch["teacher_logps"][index][:length].double(), teacher, atol=1e-4, rtol=0)
        assert not torch.allclose(student, teacher, atol=1e-3)  # the few-shot turns move the teacher


@pytest.mark.long  # end to end on the real model: the compatibility leg keeps the log-probability check only
def test_context_distillation_with_a_live_self_teacher_trains_the_real_model(smollm2_dir, tmp_path):
    args = tiny_config(
        tmp_path,
        self_distillation="live",
        temperature=1.0,
        max_completion_length=8,
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-5,
    )
    trainer = TVOPDTrainer(model=smollm2_dir, args=args, train_dataset=few_shot_dataset())
    assert trainer.sign_tolerance == 1e-3  # the float32 self-teacher's default
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/estimate" in entry]
    assert len(logs) == 2
    assert all(0 < entry["tv/estimate"] < 1 and entry["advantage/abs_mean"] > 0 for entry in logs)
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.long  # end to end on the real model: the compatibility leg keeps the log-probability check only
def test_the_evaluation_command_runs_on_the_real_model(smollm2_dir, tmp_path):
    output = tmp_path / "eval"
    status = cli.main(
        [
            "eval",
            "--model",
            smollm2_dir,
            "--benchmarks",
            "aime24",
            "--k",
            "1",
            "--max_new_tokens",
            "8",
            "--limit",
            "4",
            "--output_dir",
            str(output),
        ]
    )
    assert status == 0
    results = json.loads((output / "results.json").read_text())
    assert results["benchmarks"]["aime24"]["problems"] == 4


@pytest.mark.long  # end to end on the real model: the compatibility leg keeps the log-probability check only
def test_the_doctor_passes_the_real_model_as_its_own_teacher(smollm2_dir, tmp_path):
    data = tmp_path / "prompts"
    data.mkdir()
    few_shot_dataset().to_json(data / "train.jsonl")
    report = tmp_path / "doctor.json"
    status = cli.main(
        [
            "doctor",
            "--model_name_or_path",
            smollm2_dir,
            "--teacher_model_name_or_path",
            smollm2_dir,
            "--dataset_name",
            str(data),
            "--doctor_prompts",
            "4",
            "--doctor_max_completion_length",
            "8",
            "--bf16",
            "false",
            "--output_dir",
            str(tmp_path / "run"),
            "--doctor_output_json",
            str(report),
        ]
    )
    assert status == 0
    checks = {check["name"]: check for check in json.loads(report.read_text())}
    assert all(check["status"] == "PASS" for check in checks.values()), checks
    # The student against itself after its prompt is exact; the teacher, after the few-shot teacher prompt, is not
    assert checks["self-delta"]["detail"].startswith("max |delta| 0.00e+00")
    assert "TV estimate 0.000" not in checks["teacher vs student"]["detail"]


@pytest.mark.long  # the recipe end to end: the test command runs it, the compatibility leg does not
def test_the_terse_recipe_builds_on_the_real_model_and_reports_the_control_set(smollm2_dir, tmp_path, monkeypatch):
    """`recipes/real/smollm2_terse.yaml`, shortened: the job finds the model where `tvopd-trl models` puts it, teaches
    it with itself after the few-shot turns, and reports the behaviour, the reference and the control set."""
    from pathlib import Path

    from tvopd_trl.scripts import train

    monkeypatch.setenv("TVOPD_TRL_MODELS", str(Path(smollm2_dir).parent))
    out = tmp_path / "run"
    flags = {
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "max_completion_length": 8,
        "eval_problems": 3,
        "eval_k": 1,
        "eval_max_new_tokens": 12,
        "eval_every_steps": 0,
        "output_dir": out,
    }
    argv = ["--config", "recipes/real/smollm2_terse.yaml", *(f"--{k}={v}" for k, v in flags.items())]
    assert train.run(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["student"] == smollm2_dir and summary["self_distillation"] == "frozen" and summary["steps"] == 2
    for key in ("student_accuracy_before", "student_accuracy_after", "student_accuracy_hinted", "gap_closed"):
        assert key in summary
    assert {"terse-fewshot.jsonl", "results.json"} <= {p.name for p in (out / "eval" / "student-hinted").iterdir()}
    # The control set, greedy, before and after: the retention is what its records say
    records = {
        step: [json.loads(line) for line in (out / "eval" / "control" / f"step-{step}" / "facts.jsonl").open()]
        for step in (0, 2)
    }
    right = {step: {r["problem_id"] for r in rows if r["correct"]} for step, rows in records.items()}
    assert [len(rows) for rows in records.values()] == [3, 3]
    assert summary["control_accuracy_before"] == len(right[0]) / 3
    kept = len(right[0] & right[2]) / len(right[0]) if right[0] else None
    assert summary["control_retention"] == kept
    # The final student is a plain model folder
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 49152 and (out / "tokenizer.json").is_file()
