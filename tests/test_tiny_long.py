"""The embedded long-completion pair (`tvopd_trl.tiny`): three-digit addition worked out column by column, its splits,
the shipped student and teacher, and the main job's checks of its budget."""

import json
import os
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.eval import BENCHMARKS, grade_responses, load_problems
from tvopd_trl.scripts.train import run
from tvopd_trl.tiny import (
    LONG_ADDITION_DIR,
    SPLITS,
    evaluate_accuracy,
    long_addition_paths,
    problems,
    prompt_dataset,
    student_path,
)
from tvopd_trl.tiny.task import max_new_tokens


RECIPE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny", "long_tvopd.yaml"
)
STEP = re.compile(r"(\d)\+(\d)\+(\d)=(\d+)")


@pytest.fixture(scope="module")
def pair():
    paths = long_addition_paths()
    return {
        name: (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        for name, path in paths.items()
    }


def test_splits_are_disjoint_sized_and_deterministic():
    splits = {split: problems(split, "long_addition") for split in SPLITS}
    assert {split: len(rows) for split, rows in splits.items()} == {
        "test": 500,
        "dev": 500,
        "opd": 2000,
        "sft": 50_000,
    }
    pairs = [(row["a"], row["b"]) for rows in splits.values() for row in rows]
    assert len(set(pairs)) == len(pairs)
    assert all(100 <= a <= 999 and 100 <= b <= 999 for a, b in pairs)
    assert problems("test", "long_addition") == splits["test"]
    assert prompt_dataset("opd", n=2, skill="long_addition")["prompt"][0][0]["content"] == splits["opd"][0]["question"]


def test_each_response_adds_column_by_column_and_boxes_the_sum():
    for row in problems("test", "long_addition"):
        a, b = row["a"], row["b"]
        steps = STEP.findall(row["response"])
        assert len(steps) == 3, row
        carry = 0
        for column, (x, y, c, total) in enumerate(steps):
            assert (int(x), int(y), int(c)) == (a // 10**column % 10, b // 10**column % 10, carry), row
            assert int(total) == int(x) + int(y) + carry
            carry = int(total) // 10
        assert row["response"].endswith(f". The answer is \\boxed{{{a + b}}}") and row["answer"] == str(a + b)
    assert problems("test", "long_addition")[0]["question"].startswith("Compute ")


def test_completions_are_long_and_fit_the_budget_and_the_positions(pair):
    model, tokenizer = pair["student"]
    lengths = [
        len(tokenizer(row["response"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
        for row in problems("test", "long_addition")
    ]
    assert 30 <= min(lengths) and max(lengths) <= max_new_tokens("long_addition") <= 80
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 999 + 999."}], tokenize=True, add_generation_prompt=True
    )
    assert len(prompt["input_ids"]) + max_new_tokens("long_addition") <= model.config.max_position_embeddings
    assert max_new_tokens() == max_new_tokens("subtraction") == 16  # the short skills' budget is unchanged


def test_the_held_out_split_is_a_benchmark_the_reference_answers_pass():
    assert "tiny-long-addition" in BENCHMARKS
    rows = load_problems("tiny-long-addition")
    reference = {f"{p['a']}+{p['b']}": p["response"] for p in problems("test", "long_addition")}
    assert len(rows) == 500
    answers, statuses = grade_responses([reference[row.id] for row in rows], [row.answer for row in rows])
    assert statuses == ["correct"] * 500 and answers == [row.answer for row in rows]
    # A trace that is right column by column but boxes a wrong sum is wrong: only the boxed answer counts
    wrong = reference[rows[0].id].replace(f"{{{rows[0].answer}}}", "{1}")
    assert grade_responses([wrong], [rows[0].answer])[1] == ["incorrect"]


def test_shipped_pair_shares_the_default_tokenizer_and_meets_the_accuracy_bounds(pair):
    with open(os.path.join(student_path(), "tokenizer.json")) as f:
        default_tokenizer = f.read()
    for name in pair:
        with open(os.path.join(LONG_ADDITION_DIR, name, "tokenizer.json")) as f:
            assert f.read() == default_tokenizer, name
    (student, tokenizer), (teacher, _) = pair["student"], pair["teacher"]
    assert student.config.max_position_embeddings == teacher.config.max_position_embeddings == 128
    # Greedy on the whole held-out split (build.json has mean@4 too)
    assert evaluate_accuracy(teacher, tokenizer, greedy=True, skill="long_addition") >= 0.9
    assert evaluate_accuracy(student, tokenizer, greedy=True, skill="long_addition") <= 0.4
    with open(os.path.join(LONG_ADDITION_DIR, "build.json")) as f:
        build = json.load(f)
    assert build["teacher_heldout"]["k4"] >= 0.9 and build["student_heldout"]["k4"] <= 0.4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_completion_length", "16"], r"`max_completion_length` 16 would cut them"),
        (["--eval_max_new_tokens", "32"], r"`eval_max_new_tokens` 32 would cut them"),
        (["--eval_benchmark", "tiny"], r"set `eval_benchmark: tiny-long-addition`"),
    ],
)
def test_the_job_refuses_a_budget_that_cuts_the_traces(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", RECIPE, "--output_dir", str(tmp_path), *flags])


@pytest.mark.compat_skip
def test_the_long_recipe_trains_the_long_pair(tmp_path):
    short = ["--max_steps", "2", "--eval_problems", "8", "--eval_k", "1", "--eval_every_steps", "0"]
    assert run(["--config", RECIPE, "--output_dir", str(tmp_path), *short]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher_accuracy"] >= 0.9  # the long teacher, graded on its own split
    records = (tmp_path / "eval" / "mean@1" / "step-2" / "tiny-long-addition.jsonl").read_text().splitlines()
    assert len(records) == 8
    # The budget holds the traces: the student's responses reach their boxed answer
    assert sum(json.loads(line)["status"] != "no_answer" for line in records) >= 6
