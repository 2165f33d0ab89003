"""The main job end to end on the embedded pair, shortened to a few steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tvopd_trl.scripts.train import run

from .timeouts import time_limit


RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "tiny"
# The long-completion task's recipes (recipes/tiny/long_*.yaml), one per method of its study
LONG_MODES = {"raw": "raw", "sign": "sign", "tvopd": "tv", "tvopd_alpha0.25": "tv", "tvopd_alpha1.0": "tv"}
LONG_MODES |= {"vopd": "vopd", "power": "power", "shuffle": "shuffle", "sequence_constant": "sequence_constant"}
PLOTS = ("accuracy.png", "tv.png", "update_norm.png", "advantage_dispersion.png")
SHORT = [
    "--max_steps",
    "4",
    "--eval_problems",
    "8",
    "--eval_k",
    "2",
    "--eval_every_steps",
    "2",
    "--logging_steps",
    "1",
]


def check_outputs(output_dir, mode, steps):
    summary = json.loads((output_dir / "summary.json").read_text())
    for key in ("student_accuracy_before", "student_accuracy_after", "teacher_accuracy", "wall_seconds"):
        assert 0 <= summary[key] and (key == "wall_seconds" or summary[key] <= 1), key
    assert summary["steps"] == steps and summary["advantage_mode"] == mode
    assert [step for step, _ in summary["accuracy_curve"]] == [0, 2, 4]
    for step, accuracy in summary["accuracy_curve"]:  # each point is backed by its records
        saved = json.loads((output_dir / "eval" / "mean@2" / f"step-{step}" / "results.json").read_text())
        assert saved["benchmarks"]["tiny"]["mean@2"] == accuracy
        assert len((output_dir / "eval" / "mean@2" / f"step-{step}" / "tiny.jsonl").read_text().splitlines()) == 16
    for name in PLOTS:
        with open(output_dir / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    assert (output_dir / "model.safetensors").exists()


@pytest.mark.parametrize("recipe, mode", [("tvopd", "tv"), ("raw", "raw")])
def test_shortened_main_job_writes_the_summary_and_the_plots(recipe, mode, tmp_path):
    run(["--config", str(RECIPES / f"{recipe}.yaml"), "--output_dir", str(tmp_path), *SHORT])
    check_outputs(tmp_path, mode, steps=4)


@pytest.mark.compat_skip
def test_the_cross_tokenizer_job_evaluates_its_teacher_with_the_teachers_own_tokenizer(tmp_path):
    run(["--config", str(RECIPES / "cross_tokenizer.yaml"), "--output_dir", str(tmp_path), *SHORT])
    check_outputs(tmp_path, "tv", steps=4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher_accuracy"] >= 0.75  # read with the student's tokenizer, the Llama teacher would be noise
    history = json.loads((tmp_path / "log_history.json").read_text())
    assert all(entry["cross_tokenizer/student_tokens_per_span"] >= 1 for entry in history if "loss" in entry)


def test_every_tiny_recipe_parses_into_its_mode():
    from tvopd_trl.scripts.train import make_parser

    modes = {}
    for recipe in sorted(RECIPES.glob("*.yaml")):
        if recipe.name.startswith("study"):  # a grid of runs (`tvopd-trl study`), not a training recipe
            continue
        _, training_args, _ = make_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", "unused"])
        modes[recipe.stem] = training_args.advantage_mode
    expected = {"clip": "clip", "power": "power", "raw": "raw", "sign": "sign", "tvopd": "tv", "vopd": "vopd"}
    long = {f"long_{name}": mode for name, mode in LONG_MODES.items()}
    weak = {"weak_tvopd": "tv", "weak_tvopd_reward": "tv", "weak_reward_only": "tv", "weak_raw_reward": "raw"}
    others = {
        "multi_teacher": "tv",
        "vllm_server": "tv",
        "cross_tokenizer": "tv",
        "tools": "tv",
        "tools_vllm_server": "tv",
        "self_distill": "tv",
    }
    assert modes == {**expected, **others, **long, **weak}


def test_the_reward_recipe_trains_on_the_accuracy_reward_beside_the_weak_teacher(tmp_path):
    run(["--config", str(RECIPES / "weak_tvopd_reward.yaml"), "--output_dir", str(tmp_path), *SHORT])
    check_outputs(tmp_path, "tv", steps=4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0.5 <= summary["teacher_accuracy"] <= 0.9  # the weak teacher's, on 8 problems x 2 samples
    steps = [entry for entry in json.loads((tmp_path / "log_history.json").read_text()) if "tv/scale" in entry]
    assert len(steps) == 4 and all(0 <= entry["rewards/accuracy_reward/mean"] <= 1 for entry in steps)
    assert any(entry["advantage/reward_abs_mean"] > 0 for entry in steps)


@pytest.mark.compat_skip
def test_console_command_launches_through_accelerate(tmp_path):
    command = [sys.executable, "-m", "tvopd_trl.cli", "train", "--config", str(RECIPES / "sign.yaml")]
    command += ["--output_dir", str(tmp_path), "--num_processes", "1", *SHORT]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=time_limit(600), env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_outputs(tmp_path, "sign", steps=4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model_name_or_path", "some/student"], "Name both `model_name_or_path` and the teacher"),
        (["--dataset_name", "prompts.jsonl"], "set `eval_benchmark`"),
        (["--eval_benchmark", "aime2024"], "Unknown benchmark .aime2024."),
    ],
)
def test_a_custom_run_must_name_what_the_embedded_default_cannot_stand_in_for(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", str(RECIPES / "tvopd.yaml"), "--output_dir", str(tmp_path), *flags])


@pytest.mark.compat_skip
def test_the_tool_job_trains_with_the_tool_and_reports_how_often_the_student_calls_it(tmp_path):
    run(["--config", str(RECIPES / "tools.yaml"), "--output_dir", str(tmp_path), *SHORT])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["teacher_accuracy"] == 1.0 and summary["steps"] == 4
    for when in ("before", "after"):  # every conversation of the evaluation, at mean@k: calls per conversation
        assert 0.5 <= summary[f"tool_call_frequency_{when}"] <= 2
        assert 0 <= summary[f"tool_failure_frequency_{when}"] <= 1
    saved = json.loads((tmp_path / "eval" / "mean@2" / "step-4" / "results.json").read_text())
    assert saved["benchmarks"]["tiny-tools"]["tools"]["call_frequency"] == summary["tool_call_frequency_after"]
    assert saved["benchmarks"]["tiny-tools"]["mean@2"] == summary["student_accuracy_after"]
    history = json.loads((tmp_path / "log_history.json").read_text())
    assert all(entry["tools/call_frequency"] > 0 for entry in history if "loss" in entry)  # TRL's loop ran


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--max_completion_length", "32"],
            r"`max_completion_length` 32 would cut them. Set `max_completion_length` to 64",
        ),
        (["--eval_max_new_tokens", "16"], r"`eval_max_new_tokens` 16 would cut them"),
        (["--eval_benchmark", "tiny"], r"set `eval_benchmark: tiny-tools`"),
    ],
)
def test_the_tool_job_refuses_budgets_that_cut_its_conversations(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", str(RECIPES / "tools.yaml"), "--output_dir", str(tmp_path), *flags])


def test_recipe_keys_for_accelerate_do_not_break_the_script(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((RECIPES / "sign.yaml").read_text() + "num_processes: 1\n")
    run(["--config", str(recipe), "--output_dir", str(tmp_path / "out"), *SHORT])
    check_outputs(tmp_path / "out", "sign", steps=4)


@pytest.mark.compat_skip
def test_the_multi_teacher_job_reports_each_skill_and_each_teacher(tmp_path):
    assert run(["--config", str(RECIPES / "multi_teacher.yaml"), "--output_dir", str(tmp_path), *SHORT]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    skills = summary["skills"]
    assert list(skills) == ["tiny", "tiny-subtraction"]
    # Each teacher masters only its own skill; a skill's teacher is the one that knows it
    teachers = summary["teachers"]
    assert teachers["addition"]["tiny"] > 0.9 > teachers["addition"]["tiny-subtraction"]
    assert teachers["subtraction"]["tiny-subtraction"] > 0.9 > teachers["subtraction"]["tiny"]
    for name, skill in skills.items():
        assert skill["teacher_accuracy"] == max(teachers["addition"][name], teachers["subtraction"][name])
        gap = (skill["student_accuracy_after"] - skill["student_accuracy_before"]) / (
            skill["teacher_accuracy"] - skill["student_accuracy_before"]
        )
        assert skill["gap_closed"] == pytest.approx(gap)
    # The top-level keys stay, over all skills
    mean = (skills["tiny"]["student_accuracy_after"] + skills["tiny-subtraction"]["student_accuracy_after"]) / 2
    assert summary["student_accuracy_after"] == pytest.approx(mean)
    assert [step for step, _ in summary["accuracy_curves"]] == [0, 2, 4]
    assert set(summary["final_tv_scales"]) == {"tv/addition/scale", "tv/subtraction/scale"}
    for name in PLOTS:
        assert (tmp_path / name).is_file()


@pytest.mark.compat_skip
def test_one_family_teacher_scores_every_skill(tmp_path):
    # The one-teacher baseline: the addition teacher scores the subtraction prompts too, with one TV scale
    flags = ["--embedded_teacher", "addition", "--output_dir", str(tmp_path), *SHORT]
    assert run(["--config", str(RECIPES / "multi_teacher.yaml"), *flags]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["skills"]) == ["tiny", "tiny-subtraction"]
    assert "final_tv_scales" not in summary and summary["final_tv_scale"] is not None  # one scheduler
    skills = summary["skills"]
    assert skills["tiny"]["teacher_accuracy"] > 0.9 > skills["tiny-subtraction"]["teacher_accuracy"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--embedded_teacher", "multiplication"], "names one of the multi-teacher family's teachers"),
        (
            ["--embedded_teacher", "addition", "--embedded_task", "addition"],
            "goes with `embedded_task: multi_teacher`",
        ),
    ],
)
def test_embedded_teacher_names_a_family_teacher(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(["--config", str(RECIPES / "multi_teacher.yaml"), "--output_dir", str(tmp_path), *flags])


def test_the_accuracy_curve_evaluates_the_named_jsonl_file_at_every_step(tmp_path):
    # A file whose stem is a registered name ("tiny") must still be the file, at every point of the curve
    problems = tmp_path / "data" / "tiny.jsonl"
    problems.parent.mkdir()
    rows = [{"id": f"sub-{i}", "problem": f"Compute {50 + i} - {10 + i}.", "answer": "40"} for i in range(8)]
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    assert (
        run(
            [
                "--config",
                str(RECIPES / "tvopd.yaml"),
                "--output_dir",
                str(out),
                "--eval_benchmark",
                str(problems),
                *SHORT,
            ]
        )
        == 0
    )
    for step in (0, 2, 4):
        records = (out / "eval" / "mean@2" / f"step-{step}" / "tiny.jsonl").read_text().splitlines()
        assert {json.loads(line)["problem_id"] for line in records} == {row["id"] for row in rows}, step


def test_a_recipes_embedded_task_is_checked(tmp_path):
    # A recipe's value does not go through the command line's choices
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        (RECIPES / "multi_teacher.yaml").read_text().replace("task: multi_teacher", "task: multi-teacher")
    )
    with pytest.raises(ValueError, match=r"Unknown `embedded_task` 'multi-teacher'; choose one of addition, multi_"):
        run(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])


def test_a_run_without_an_evaluation_draws_no_empty_accuracy_plot(tmp_path):
    from tvopd_trl.plots import plot_run

    log_history = [{"step": step, "tv/estimate": 0.3, "tv/ema": 0.3, "tv/scale": 1.0} for step in (1, 2)]
    written = [os.path.basename(path) for path in plot_run(log_history, [], str(tmp_path))]
    assert "accuracy.png" not in written and "tv.png" in written
    assert not (tmp_path / "accuracy.png").exists()
    (tmp_path / "evaluated").mkdir()
    written = plot_run(log_history, [(0, 0.2), (2, 0.5)], str(tmp_path / "evaluated"))
    assert (tmp_path / "evaluated" / "accuracy.png").is_file() and len(written) == 4


def test_the_evaluation_renders_prompts_with_training_s_chat_template_kwargs(tmp_path):
    """`chat_template_kwargs` (Qwen3's `enable_thinking`) reach the evaluation's prompts, and its records say so."""
    flags = ["--max_steps", "1", "--eval_problems", "4", "--eval_k", "1", "--eval_every_steps", "0"]
    kwargs = '{"enable_thinking": false}'
    run(
        [
            "--config",
            str(RECIPES / "tvopd.yaml"),
            "--output_dir",
            str(tmp_path),
            *flags,
            "--chat_template_kwargs",
            kwargs,
        ]
    )
    for step in (0, 1):
        results = json.loads((tmp_path / "eval" / "mean@1" / f"step-{step}" / "results.json").read_text())
        assert results["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
