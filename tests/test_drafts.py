"""The main job's draft measurement (`eval_acceptance_prompts`) and the draft task (`embedded_task: smollm2_draft`)."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl import tiny
from tvopd_trl.eval import get_benchmark, load_problems
from tvopd_trl.scripts.train import run
from tvopd_trl.speculative import expected_tokens_per_verification, measure_assisted_acceptance


RECIPES = Path(__file__).resolve().parent.parent / "recipes"
MEASURED = ["--eval_acceptance_prompts", "4", "--eval_acceptance_gamma", "2", "--eval_max_new_tokens", "8"]
UNMEASURED = ["--max_steps", "2", "--eval_problems", "0", "--logging_steps", "1", "--seed", "3"]
SHORT = [*UNMEASURED, *MEASURED]


def test_the_job_measures_the_student_as_a_draft_of_its_teacher_before_and_after(tmp_path):
    run(["--config", str(RECIPES / "tiny" / "tvopd.yaml"), "--output_dir", str(tmp_path), *SHORT])
    summary = json.loads((tmp_path / "summary.json").read_text())
    # The records are what transformers' assisted generation measures of the models the run started from and saved,
    # on the first 4 held-out problems as the evaluation poses them, at the rollouts' temperature and the run's seed
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    problems = load_problems("tiny", limit=4)
    prompts = [get_benchmark("tiny").prompt(problem) for problem in problems]
    teacher = AutoModelForCausalLM.from_pretrained(tiny.teacher_path())
    for when, student in (("before", tiny.student_path()), ("after", tmp_path)):
        record = summary[f"draft_{when}"]
        measured = measure_assisted_acceptance(
            teacher, AutoModelForCausalLM.from_pretrained(student), tokenizer, prompts, gamma=2, temperature=1.0,
            max_new_tokens=8, seed=3,
        )  # fmt: skip
        assert (record["tested"], record["acceptance"]) == (measured.tested, measured.acceptance) and measured.tested
        assert record["interval"][0] <= record["acceptance"] <= record["interval"][1]
        assert record["tokens_per_forward"] == measured.tokens_per_forward
        assert record["expected_tokens_per_verification"] == expected_tokens_per_verification(record["acceptance"], 2)
        assert record["gamma"] == 2 and record["speedup"] > 0 and record["tokens_per_second"] > 0
        assert (
            0 <= record["own_state_estimate"] <= 1 and 0 < record["own_state_exact"] < 1 and record["own_states"] > 0
        )
    # Each timed against the teacher alone, timed just before it
    for record in (summary["draft_before"], summary["draft_after"]):
        assert record["tokens_per_second"] / record["speedup"] == pytest.approx(record["target_tokens_per_second"])
    history = json.loads((tmp_path / "log_history.json").read_text())
    last = [entry for entry in history if "tv/estimate" in entry][-1]
    assert summary["final_tv_acceptance"] == last["tv/acceptance"] == pytest.approx(1 - last["tv/estimate"])


def test_the_measurement_leaves_the_training_run_as_it_was(tmp_path):
    def trained(output_dir, *flags):
        run(["--config", str(RECIPES / "tiny" / "tvopd.yaml"), "--output_dir", str(output_dir), *UNMEASURED, *flags])
        history = json.loads((output_dir / "log_history.json").read_text())
        return [{k: v for k, v in entry.items() if "time" not in k and "per_second" not in k} for entry in history]

    assert trained(tmp_path / "measured", *MEASURED) == trained(tmp_path / "plain")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--teacher_model_server_url", "http://127.0.0.1:9"], "not with a served teacher"),
        (["--embedded_teacher", "cross_digits", "--cross_tokenizer", "true"], "not with a teacher of another"),
        (["--eval_acceptance_gamma", "0"], "drafts at least 1 token a verification; got 0"),
    ],
)
def test_a_draft_measurement_the_job_cannot_make_is_refused_before_training(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", str(RECIPES / "tiny" / "tvopd.yaml"), "--output_dir", str(tmp_path), *SHORT, *flags])
    assert not (tmp_path / "summary.json").exists()


def test_the_draft_task_is_the_real_models_first_layers_drafting_for_it(smollm2_dir, monkeypatch):
    from tvopd_trl.job import DRAFT_LAYERS, job_parser, load_job

    monkeypatch.setenv("TVOPD_TRL_MODELS", str(Path(smollm2_dir).parent))
    job_args, training_args, model_args = job_parser().parse_args_and_config(
        ["--config", str(RECIPES / "real" / "smollm2_draft.yaml")]
    )
    assert (job_args.embedded_task, training_args.advantage_mode, job_args.eval_acceptance_prompts) == (
        "smollm2_draft", "tv", 24,
    )  # fmt: skip
    student, teacher, tokenizer, dataset = load_job(job_args, training_args, model_args)
    assert teacher == smollm2_dir and Path(student).parent == Path(smollm2_dir).parent
    draft, target = AutoModelForCausalLM.from_pretrained(student), AutoModelForCausalLM.from_pretrained(teacher)
    assert draft.config.num_hidden_layers == DRAFT_LAYERS == 4 and target.config.num_hidden_layers == 30
    for name, weight in draft.state_dict().items():  # the target's own weights, fewer layers
        assert weight.equal(target.state_dict()[name]), name
    assert dataset.column_names == ["prompt"] and dataset[0]["prompt"][0]["role"] == "user" and len(dataset) == 572
    assert load_job(job_args, training_args, model_args)[0] == student  # built once


@pytest.mark.long  # the recipe end to end on the real model: the test command runs it, the compatibility leg does not
def test_the_draft_recipe_trains_the_cut_and_measures_it(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TVOPD_TRL_MODELS", str(Path(smollm2_dir).parent))
    flags = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "8"]
    flags += ["--eval_acceptance_prompts", "2", "--eval_max_new_tokens", "8", "--output_dir", str(tmp_path)]
    assert run(["--config", str(RECIPES / "real" / "smollm2_draft.yaml"), *flags]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher"] == smollm2_dir and summary["steps"] == 2
    assert all(summary[f"draft_{when}"]["tested"] > 0 for when in ("before", "after"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 4
