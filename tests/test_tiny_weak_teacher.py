"""The default pair's weak teacher (`tvopd_trl.tiny.weak_teacher_path`): an imperfect teacher of the same task, tokenizer
and architecture, and the main job's `embedded_teacher: weak`."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.job import check_job_arguments, load_job
from tvopd_trl.scripts.train import make_parser
from tvopd_trl.tiny import CHECKPOINTS_DIR, build, evaluate_accuracy, student_path, teacher_path, weak_teacher_path
from tvopd_trl.tokenizers import check_shared_vocabulary


# The weak teacher's held-out accuracy bounds (mean@4, as `tvopd_trl.tiny.build` requires them)
LOW, HIGH = 0.60, 0.75


@pytest.fixture(scope="module")
def weak_teacher():
    return AutoModelForCausalLM.from_pretrained(weak_teacher_path()), AutoTokenizer.from_pretrained(
        weak_teacher_path()
    )


def test_the_weak_teacher_shares_the_pairs_tokenizer_and_architecture(weak_teacher):
    model, tokenizer = weak_teacher
    student = AutoModelForCausalLM.from_pretrained(student_path())
    check_shared_vocabulary(AutoTokenizer.from_pretrained(student_path()), tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        with (
            open(os.path.join(student_path(), name), "rb") as a,
            open(os.path.join(weak_teacher_path(), name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    weak_config, student_config = model.config.to_dict(), student.config.to_dict()
    weak_config.pop("_name_or_path"), student_config.pop("_name_or_path")
    assert weak_config == student_config
    assert os.path.realpath(weak_teacher_path()) not in {os.path.realpath(p) for p in (student_path(), teacher_path())}


def test_the_weak_teacher_solves_60_to_75_percent_of_the_held_out_split(weak_teacher):
    with open(os.path.join(CHECKPOINTS_DIR, "build.json")) as f:
        recorded = json.load(f)["weak_teacher_heldout"]
    assert LOW <= recorded["k4"] <= HIGH, recorded
    # mean@4 at the paper's evaluation settings on all 500 problems, as the builder measures it
    accuracy = evaluate_accuracy(*weak_teacher, "test", k=4)
    assert LOW <= accuracy <= HIGH, accuracy


def search(monkeypatch, dev_by_step):
    """`build.search_student` on a few steps of a small model, with the dev accuracies of `dev_by_step`."""
    calls = []

    def scripted(model, tokenizer, split, k, seed, skill):
        calls.append((seed, k))
        return dev_by_step[seed]

    monkeypatch.setattr(build, "evaluate_accuracy", scripted)
    settings = {**build.DEFAULTS, "batch_size": 8, "warmup_steps": 2, "constant_until": 3, "total_steps": 12}
    settings |= {"transition_window": (2, 12), "checkpoint_every": 2}
    tokenizer = build.build_tokenizer()
    model = build.build_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    _, record = build.search_student(model, tokenizer, settings, None, False, lambda _: None, 0, stop_at_student=False)
    return record, calls


def test_the_builder_takes_the_first_checkpoint_after_the_student_in_the_weak_teachers_window(monkeypatch):
    # Every second step up to the first checkpoint above the student's threshold (step 6), then every step at mean@4
    dev = {2: 0.1, 4: 0.2, 6: 0.4, 7: 0.5, 8: 0.66, 9: 0.7, 10: 0.9, 12: 1.0}
    record, calls = search(monkeypatch, dev)
    assert calls == [(2, 1), (4, 1), (6, 1), (7, 4), (8, 4), (9, 4)]
    assert (record["student_step"], record["weak_teacher_step"], record["weak_teacher_dev"]) == (4, 9, 0.7)
    assert [row.get("dev_samples") for row in record["window"]] == [None, None, None, 4, 4, 4]
    with pytest.raises(RuntimeError, match="jumped past the weak teacher's window"):
        search(monkeypatch, {**dev, 9: 0.8})


def parse(*flags):
    return make_parser().parse_args_and_config(["--config", "tiny/tvopd", "--output_dir", "unused", *flags])


def test_the_job_resolves_embedded_teacher_weak_to_the_weak_teacher():
    job_args, training_args, model_args = parse("--embedded_teacher", "weak")
    check_job_arguments(job_args, training_args, model_args)
    student, teacher, _, dataset = load_job(job_args, training_args, model_args)
    assert (student, teacher) == (student_path(), weak_teacher_path())
    assert len(dataset) > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--embedded_task", "multi_teacher"], "`weak` \\(the tiny pair's imperfect teacher\\) and goes with "),
        (["--embedded_task", "long_addition"], "got 'weak' with `embedded_task: long_addition`"),
        (["--embedded_task", "addition_vllm"], "goes with `embedded_task: addition`; got 'weak'"),
        (
            ["--model_name_or_path", student_path(), "--teacher_model_name_or_path", teacher_path()],
            "picks the embedded family's teacher",
        ),
    ],
)
def test_embedded_teacher_weak_goes_with_the_addition_task_and_its_embedded_pair(flags, message):
    with pytest.raises(ValueError, match=message):
        check_job_arguments(*parse("--embedded_teacher", "weak", *flags))


def test_a_family_teacher_does_not_go_with_the_addition_task():
    with pytest.raises(ValueError, match="`embedded_teacher` names one of the multi-teacher family's teachers"):
        check_job_arguments(*parse("--embedded_teacher", "addition"))
