"""The embedded hint family (`tvopd_trl.tiny.hint_task`): its prompts (bare, and hinted as the teacher's), the shipped
student within its bounds, its rebuild record, and the main job's self-distillation on it: argument checks, and the
summary's reference, the student's own accuracy with the hint."""

import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.eval import get_benchmark, load_problems
from tvopd_trl.job import check_job_arguments, load_job
from tvopd_trl.scripts.train import make_parser, run
from tvopd_trl.tiny import HINT_DIR, evaluate_accuracy, hint_student_path, problems, prompt_dataset, student_path
from tvopd_trl.tiny.build import encode_conversations, encode_sft
from tvopd_trl.tiny.hint_task import HINT, conversation, hint_turn
from tvopd_trl.tiny.hint_task import evaluate_accuracy as hinted_accuracy
from tvopd_trl.tiny.hint_task import prompt_dataset as hint_prompt_dataset


ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny" / "self_distill.yaml"
OPTIONS = {"seed": 0, "student_max_dev_accuracy": None, "total_steps": None, "keep_checkpoints": False}
SHORT = [
    "--max_steps",
    "2",
    "--eval_problems",
    "8",
    "--eval_k",
    "2",
    "--eval_every_steps",
    "0",
    "--logging_steps",
    "1",
]


@pytest.fixture(scope="module")
def student():
    return AutoModelForCausalLM.from_pretrained(hint_student_path()), AutoTokenizer.from_pretrained(
        hint_student_path()
    )


def parse(*flags):
    job_args, training_args, model_args = make_parser().parse_args_and_config(
        ["--config", str(RECIPE), "--output_dir", "unused", *flags]
    )
    return job_args, training_args, model_args


def test_the_prompts_are_the_bare_ones_and_the_teacher_prompts_the_same_after_the_hint():
    dataset = hint_prompt_dataset("opd", n=50)
    assert dataset.column_names == ["prompt", "teacher_prompt", "answer"]
    bare = prompt_dataset("opd", n=50)  # the default pair's prompts: the same problems, in the same order
    assert dataset["prompt"] == bare["prompt"] and dataset["answer"] == bare["answer"]
    for row in dataset:
        assert row["teacher_prompt"] == [hint_turn(row["answer"]), *row["prompt"]]
        assert row["teacher_prompt"][0] == {"role": "system", "content": f"Hint: the answer is {row['answer']}."}
        assert "Hint" not in json.dumps(row["prompt"])
    assert len(hint_prompt_dataset("opd")) == 1600
    assert conversation("Compute 1 + 2.", "3", hinted=False) == [{"role": "user", "content": "Compute 1 + 2."}]


def test_the_hinted_benchmark_is_the_held_out_split_with_the_hint_shown():
    hinted, bare = get_benchmark("tiny-hinted"), get_benchmark("tiny")
    assert load_problems(hinted) == load_problems(bare)  # the same 500 problems: only the prompt differs
    problem = load_problems(hinted, limit=1)[0]
    assert hinted.prompt(problem) == [hint_turn(problem.answer), *bare.prompt(problem)]
    assert HINT.format(answer=problem.answer) in hinted.prompt(problem)[0]["content"]


def test_the_bare_sft_rows_encode_as_the_default_pairs(student):
    _, tokenizer = student
    rows = problems("sft")[:4]
    bare = encode_conversations(
        tokenizer, [conversation(r["question"], r["answer"], False) for r in rows], [r["response"] for r in rows]
    )
    for mine, default in zip(bare, encode_sft(tokenizer, rows), strict=True):
        assert mine.tolist() == default.tolist()


def test_the_shipped_student_reads_the_hint_and_seldom_adds_without_it(student):
    model, tokenizer = student
    with (
        open(os.path.join(student_path(), "tokenizer.json")) as f,
        open(os.path.join(HINT_DIR, "student", "tokenizer.json")) as g,
    ):
        assert f.read() == g.read()  # the default pair's tokenizer, byte for byte
    build = json.loads(Path(HINT_DIR, "build.json").read_text())
    heldout = build["heldout"]
    assert heldout["hinted"]["k4"] >= 0.9 and heldout["bare"]["k4"] <= 0.6, heldout  # .ci/run's bounds
    assert build["longest_sequence_tokens"] + 8 <= model.config.max_position_embeddings  # a hinted prompt and 8 tokens
    # Greedy on the whole held-out split, with the hint and without
    assert hinted_accuracy(model, tokenizer, "test", hinted=True, greedy=True) >= 0.9
    assert evaluate_accuracy(model, tokenizer, "test", greedy=True) <= 0.6


def test_the_amd_rebuild_record_is_a_whole_build_with_the_default_options():
    record = json.loads((ROOT / ".ci" / "rebuilds" / "AuthenticAMD" / "hint.json").read_text())
    assert record["inputs"]["family"] == "hint" and record["inputs"]["overrides"] == OPTIONS
    assert "tvopd_trl.tiny.hint_task" in record["inputs"]["sources"]
    assert os.path.join("student", "model.safetensors") in record["outputs"]
    assert record["heldout"]["hinted"]["k4"] >= 0.9 and record["heldout"]["bare"]["k4"] <= 0.6


# ----------------------------------------------------------------------------------------------------------------------
# The main job
# ----------------------------------------------------------------------------------------------------------------------


def test_self_distillation_on_the_hint_task_resolves_no_teacher():
    job_args, training_args, model_args = parse()
    assert (job_args.embedded_task, training_args.self_distillation) == ("hint", "live")
    check_job_arguments(job_args, training_args, model_args)
    student, teacher, _, dataset = load_job(job_args, training_args, model_args)
    assert student == hint_student_path() and teacher is None
    assert dataset.column_names == ["prompt", "teacher_prompt", "answer"] and len(dataset) == 1600


def test_a_named_student_may_teach_itself_without_a_teacher():
    job_args, training_args, model_args = parse("--model_name_or_path", hint_student_path(), "--eval_problems", "0")
    check_job_arguments(job_args, training_args, model_args)
    _, teacher, _, _ = load_job(job_args, training_args, model_args)
    assert teacher is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--embedded_task", "addition"],
            r"`embedded_task: addition`'s prompts carry none.*Use `embedded_task: hint or smollm2_terse`",
        ),
        (["--embedded_task", "multi_teacher"], r"`embedded_task: multi_teacher`'s prompts carry none"),
        (
            ["--eval_benchmark", "tiny-hinted"],
            r"graded on its held-out split without its teacher prompt, `eval_benchmark: tiny`",
        ),
    ],
)
def test_self_distillation_needs_a_task_with_hints(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", str(RECIPE), "--output_dir", str(tmp_path), *flags])


def test_the_hint_task_without_self_distillation_names_the_fix(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text().replace("self_distillation: live\n", ""))
    with pytest.raises(ValueError, match=r"ships one model.*set `self_distillation: live`"):
        run(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])


def test_the_summary_measures_the_gap_to_the_students_own_accuracy_with_the_hint(tmp_path):
    assert run(["--config", str(RECIPE), "--output_dir", str(tmp_path), *SHORT]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["self_distillation"] == "live" and summary["teacher"] is None and summary["steps"] == 2
    assert "teacher_accuracy" not in summary
    hinted, before = summary["student_accuracy_hinted"], summary["student_accuracy_before"]
    assert hinted >= 0.75 and hinted > before, summary  # 8 problems x 2 samples; 0.99 on the whole split
    gap = (summary["student_accuracy_after"] - before) / (hinted - before)
    assert summary["gap_closed"] == pytest.approx(gap)
    for key in (
        "student_accuracy_hinted_greedy",
        "student_accuracy_hinted_after",
        "student_accuracy_hinted_after_greedy",
    ):
        assert 0 <= summary[key] <= 1, key
    saved = json.loads((tmp_path / "eval" / "student-hinted" / "results.json").read_text())
    assert saved["benchmarks"]["tiny-hinted"]["mean@2"] == hinted


@pytest.mark.long
def test_the_self_distill_recipe_closes_half_the_gap_to_the_students_own_hinted_accuracy(tmp_path):
    """The recipe as shipped (150 steps, about 2 minutes on one core): the student taught by itself with the hint
    closes at least half the gap to its hinted accuracy (0.79 measured, docs/self-distillation.md)."""
    assert run(["--config", str(RECIPE), "--output_dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 150 and summary["student_accuracy_hinted"] >= 0.9, summary
    assert summary["gap_closed"] >= 0.5, summary
