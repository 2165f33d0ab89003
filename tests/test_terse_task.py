"""The real model's terse task (`tvopd_trl.terse_task`): its questions and splits, its graders, its benchmarks, the
control set's retention, and the job's checks. The task trained on the real model: tests/test_real_model.py."""

import json

import pytest

from tvopd_trl import terse_task
from tvopd_trl.eval import SamplingSettings, evaluate, get_benchmark, load_problems, mean_at_k, retention
from tvopd_trl.job import check_job_arguments, hinted_reference, job_parser


def test_the_held_out_subjects_are_never_trained_on():
    train, test = terse_task.questions("train"), terse_task.questions("test")
    assert len(train) == 572 and len(test) == 108 and len(set(train + test)) == 680
    held_out = [s for subjects in (terse_task.TOPICS, terse_task.TASKS) for s in subjects[5::6]]
    assert len(held_out) == 16
    for subject in held_out:
        assert any(subject in q for q in test)
        assert not any(q.endswith((f" {subject}.", f" {subject}?")) or f" {subject} " in q for q in train)
    with pytest.raises(ValueError, match="train and test"):
        terse_task.questions("validation")


def test_the_teacher_prompt_is_the_prompt_after_the_four_terse_turns():
    dataset = terse_task.prompt_dataset("train")
    row = dataset[0]
    assert row["prompt"] == [{"role": "user", "content": "Tell me something about volcanoes."}]
    shots = row["teacher_prompt"][:-1]
    assert row["teacher_prompt"][-1] == row["prompt"][0] and len(shots) == 8
    assert [m["role"] for m in shots] == ["user", "assistant"] * 4
    assert shots[1] == {"role": "assistant", "content": "Rome."}
    benchmark = get_benchmark("terse-fewshot")
    problem = load_problems("terse", limit=1)[0]
    assert benchmark.prompt(problem) == [*shots, {"role": "user", "content": problem.problem}]
    assert get_benchmark("terse").prompt(problem) == [{"role": "user", "content": problem.problem}]


@pytest.mark.parametrize(
    "response, right",
    [
        ("Rome.", True),
        ("  one two three four five six seven eight nine ten  ", True),
        ("one two three four five six seven eight nine ten eleven", False),
        ("", False),
        ("   \n", False),
    ],
)
def test_terse_means_one_to_ten_words(response, right):
    answer, status = terse_task.grade_terse(response, "10")
    assert answer == response.strip() and status == ("correct" if right else "incorrect")


@pytest.mark.parametrize(
    "response, gold, right",
    [
        ("The capital of France is Paris.", "Paris", True),
        ("PARIS", "Paris", True),
        ("Parisian food is great.", "Paris", False),
        ("A spider has eight legs.", "8|eight", True),
        ("It has 8.", "8|eight", True),
        ("Eighteen, or 18.", "8|eight", False),
        ("Leonardo da Vinci painted it.", "Leonardo|da Vinci", True),
        ("Plants take in CO2.", "carbon dioxide|CO2", True),
        ("It is 24 hours long.", "24|twenty-four|twenty four", True),
        ("H2O.", "H2O", True),
    ],
)
def test_a_control_answer_is_right_when_it_names_the_known_one_as_a_whole_word(response, gold, right):
    assert terse_task.grade_presence(response, gold)[1] == ("correct" if right else "incorrect")


class Answers:
    """Plays a model's generation with fixed answers: the evaluation's grading and records are under test here."""

    def __init__(self, answers):
        self.answers = answers

    def __call__(self, prompts, settings, shard=None):
        return [[self.answers[prompt[-1]["content"]]] * settings.k for prompt in prompts]


def test_the_control_retention_is_the_share_of_right_answers_kept(tmp_path):
    facts = load_problems("facts", limit=4)
    assert [p.answer for p in facts] == ["Paris", "Tokyo", "Berlin", "Madrid"]
    greedy = SamplingSettings(k=1, temperature=0)
    before = {
        facts[0].problem: "Paris.",
        facts[1].problem: "Tokyo.",
        facts[2].problem: "Bonn.",
        facts[3].problem: "Madrid",
    }
    after = {
        facts[0].problem: "Paris.",
        facts[1].problem: "Kyoto.",
        facts[2].problem: "Berlin.",
        facts[3].problem: "It is Madrid.",
    }
    scores = {}
    for name, answers in (("before", before), ("after", after)):
        results = evaluate(Answers(answers), ["facts"], greedy, tmp_path / name, limit=4, model="m")
        scores[name] = mean_at_k(results["benchmarks"]["facts"])
    assert scores == {"before": 0.75, "after": 0.75}
    # Right before: Paris, Tokyo, Madrid; kept: Paris and Madrid
    assert retention(tmp_path / "before", tmp_path / "after", "facts") == pytest.approx(2 / 3)
    records = [json.loads(line) for line in (tmp_path / "after" / "facts.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records] == ["Paris.", "Kyoto.", "Berlin.", "It is Madrid."]
    wrong = dict.fromkeys(after, "No idea.")
    evaluate(Answers(wrong), ["facts"], greedy, tmp_path / "none", limit=4, model="m")
    assert retention(tmp_path / "none", tmp_path / "after", "facts") is None  # nothing right before: nothing to keep


def _job(*flags):
    return job_parser().parse_args_and_config(["--config", "recipes/real/smollm2_terse.yaml", *flags])


def test_the_recipe_runs_the_terse_task_against_the_student_with_its_few_shot_turns():
    job_args, training_args, model_args = _job()
    assert (job_args.embedded_task, training_args.self_distillation) == ("smollm2_terse", "frozen")
    assert (job_args.eval_benchmark, job_args.eval_control_benchmark) == ("terse", "facts")
    check_job_arguments(job_args, training_args, model_args)
    assert hinted_reference(job_args, training_args) == "terse-fewshot"


def test_the_terse_task_needs_self_distillation_and_its_own_benchmark():
    job_args, training_args, model_args = _job()
    training_args.self_distillation = None
    with pytest.raises(ValueError, match=r"ships one model.*recipes/real/smollm2_terse.yaml"):
        check_job_arguments(job_args, training_args, model_args)
    job_args, training_args, model_args = _job("--eval_benchmark", "facts")
    with pytest.raises(ValueError, match=r"without its teacher prompt, `eval_benchmark: terse`.*terse-fewshot"):
        check_job_arguments(job_args, training_args, model_args)
