"""`tvopd-trl study`: the smoke grid end to end (runs, resume, tables, figures), and the study file's validation."""

import json
import os

import pytest
import yaml

from tvopd_trl.cli import main as cli
from tvopd_trl.study import grid, load_study, run_grid


SMOKE = "recipes/tiny/study_smoke.yaml"


def _study_file(tmp_path, **changes):
    with open(SMOKE) as f:
        raw = yaml.safe_load(f)
    raw |= {"output_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results")} | changes
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"epochs": 3}, r"unknown keys \['epochs'\]"),
        ({"methods": {"raw": {"advantage_mode": "raw"}}}, "method 'raw' needs a `name`"),
        ({"recipe": "recipes/tiny/missing.yaml"}, "does not exist"),
    ],
)
def test_a_bad_study_file_is_refused(tmp_path, change, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_study(_study_file(tmp_path, **change))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"analysis": {"skills": {"tiny": "Addition", "aime24": "AIME"}}}, r"names \['aime24'\], which method"),
        ({"overrides": {"eval_k": 4, "eval_teacher": False}}, "sets `eval_teacher: false`"),
    ],
)
def test_a_study_across_skills_is_checked_before_it_runs(tmp_path, change, message):
    with open("recipes/tiny/study_multi_teacher.yaml") as f:
        raw = yaml.safe_load(f) | change
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ValueError, match=message):
        load_study(str(path))


def test_analysis_must_name_defined_methods(tmp_path):
    study = load_study(SMOKE)
    with pytest.raises(ValueError, match=r"analysis.curve_methods names methods \['tv_lr'\]"):
        load_study(_study_file(tmp_path, analysis={**study.analysis, "curve_methods": ["raw", "tv_lr"]}))
    analysis = dict(study.analysis)
    del analysis["stages"]
    with pytest.raises(ValueError, match=r"lacks \['stages'\]"):
        load_study(_study_file(tmp_path, analysis=analysis))


@pytest.mark.long
def test_the_smoke_grid_runs_resumes_and_reports(tmp_path):
    path = _study_file(tmp_path)
    assert cli(["study", "--config", path]) == 0
    study = load_study(path)
    runs = grid(study)
    assert len(runs) == 6 and all(run.finished for run in runs)
    for run in runs:
        summary = json.loads(open(os.path.join(run.directory, "summary.json")).read())
        assert summary["steps"] == 10 and summary["advantage_mode"] == run.settings.get("advantage_mode", "tv")
        assert "teacher_accuracy" not in summary  # `eval_teacher: false`

    results = tmp_path / "results"
    for name in (
        "README.md",
        "tables.md",
        "results.json",
        "curves.png",
        "tv_scale.png",
        "update_norm.png",
        "dispersion.png",
    ):
        assert (results / name).is_file(), name
    tables = (results / "tables.md").read_text()
    for title in ("Main results", "Stage-wise accuracy", "Alpha sweep", "Magnitude ablation", "Dispersion"):
        assert title in tables
    aggregates = json.loads((results / "results.json").read_text())["aggregates"]
    selected = aggregates["Main results"]["TV-OPD"]["selected"]
    assert len(selected) == 2 and 0 <= selected[0] <= 1 and selected[1] is not None  # mean and std over 2 seeds
    dispersion = aggregates["Dispersion (first batch)"]
    assert dispersion["tokens"] > 0 and 0 < dispersion["top1pct_energy"] <= dispersion["top10pct_energy"] <= 1

    # A finished grid does no work; an interrupted run is run again, and only it.
    stamps = {run.directory: os.path.getmtime(os.path.join(run.directory, "summary.json")) for run in runs}
    assert run_grid(study) == {}
    os.remove(os.path.join(runs[0].directory, "summary.json"))
    assert set(run_grid(study)) == {(runs[0].method, runs[0].seed)}
    for run in runs[1:]:
        assert os.path.getmtime(os.path.join(run.directory, "summary.json")) == stamps[run.directory]

    # A finished run is never reused for other settings.
    changed = load_study(_study_file(tmp_path, overrides={**study.overrides, "max_steps": 30}))
    with pytest.raises(ValueError, match=r"run with other settings \(\['max_steps'\] differ\)"):
        run_grid(changed)


def _run_short_study(tmp_path, name, **changes):
    """Runs a shipped study file cut to one seed of 4 steps and a small evaluation (`changes` win); returns it."""
    with open(f"recipes/tiny/{name}.yaml") as f:
        raw = yaml.safe_load(f)
    overrides = {"max_steps": 4, "per_device_train_batch_size": 16, "logging_steps": 1, "eval_problems": 8}
    raw |= {
        "output_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
        "seeds": [0],
        "overrides": overrides | {"eval_k": 2, "eval_every_steps": 2},
    }
    raw |= {key: change(raw) if callable(change) else change for key, change in changes.items()}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert cli(["study", "--config", str(path)]) == 0
    return raw


@pytest.mark.compat_skip
def test_a_study_across_skills_reports_each_skill_and_each_scale(tmp_path):
    raw = _run_short_study(tmp_path, "study_multi_teacher")

    results = tmp_path / "results"
    for name in ("README.md", "tables.md", "accuracy_tiny.png", "accuracy_tiny-subtraction.png", "tv_scale.png"):
        assert (results / name).is_file(), name
    rows = json.loads((results / "results.json").read_text())["aggregates"]["Accuracy per skill"]
    assert list(rows) == [method["name"] for method in raw["methods"].values()]
    for method, slug in zip(rows, raw["methods"], strict=True):
        summary = json.loads((tmp_path / "runs" / slug / "seed-0" / "summary.json").read_text())
        for skill in ("tiny", "tiny-subtraction"):
            assert rows[method][f"{skill}/after"][0] == summary["skills"][skill]["student_accuracy_after"]
            if slug != "one_teacher":  # its subtraction teacher is the addition one, wrong there
                assert rows[method][f"{skill}/gap"][0] == pytest.approx(summary["skills"][skill]["gap_closed"])
    # The one-teacher baseline's subtraction gap is to the subtraction teacher, not to the wrong one it had
    one = json.loads((tmp_path / "runs" / "one_teacher" / "seed-0" / "summary.json").read_text())["skills"]
    own = json.loads((tmp_path / "runs" / "per_teacher_scale" / "seed-0" / "summary.json").read_text())["skills"]
    sub = one["tiny-subtraction"]
    expected = (sub["student_accuracy_after"] - sub["student_accuracy_before"]) / (
        own["tiny-subtraction"]["teacher_accuracy"] - sub["student_accuracy_before"]
    )
    assert rows["One teacher (addition)"]["tiny-subtraction/gap"][0] == pytest.approx(expected)
    assert sub["teacher_accuracy"] < 0.2 < own["tiny-subtraction"]["teacher_accuracy"]
    tables = (results / "tables.md").read_text()
    assert "Subtraction gap closed" in tables and "One teacher (addition)" in tables


@pytest.mark.compat_skip
def test_a_study_of_the_task_reward_reports_against_the_teacher(tmp_path):
    _run_short_study(
        tmp_path,
        "study_reward",
        methods=lambda raw: {slug: raw["methods"][slug] for slug in ("tv", "tv_reward_1")},
        analysis=lambda raw: raw["analysis"] | {"late_window": [2, 4, 2], "metric_methods": ["tv_reward_1"]},
    )

    results = tmp_path / "results"
    for name in ("README.md", "tables.md", "curves.png", "tv_scale.png", "reward.png", "reward_to_distill.png"):
        assert (results / name).is_file(), name
    aggregates = json.loads((results / "results.json").read_text())["aggregates"]
    summary = json.loads((tmp_path / "runs" / "tv_reward_1" / "seed-0" / "summary.json").read_text())
    assert aggregates["Teacher"][0] == summary["teacher_accuracy"]
    row = aggregates["Against the teacher"]["TV-OPD + reward (alpha=1)"]
    assert row["final"][0] == summary["student_accuracy_after"] and row["minutes"][0] * 6000 == pytest.approx(
        summary["wall_seconds"]
    )
    assert "| Teacher |" in (results / "tables.md").read_text()


@pytest.mark.compat_skip
def test_a_self_distillation_study_reports_against_the_students_own_hinted_accuracy(tmp_path):
    _run_short_study(
        tmp_path,
        "study_self_distill",
        methods=lambda raw: {slug: raw["methods"][slug] for slug in ("tv_live", "raw_frozen")},
        analysis=lambda raw: raw["analysis"] | {"late_window": [2, 4, 2], "metric_methods": ["tv_live", "raw_frozen"]},
    )

    results = tmp_path / "results"
    for name in ("README.md", "tables.md", "curves.png", "abs_delta.png", "tv_scale.png"):
        assert (results / name).is_file(), name
    aggregates = json.loads((results / "results.json").read_text())["aggregates"]
    for slug, name in (("tv_live", "TV-OPD (live teacher)"), ("raw_frozen", "Raw OPD (frozen teacher)")):
        summary = json.loads((tmp_path / "runs" / slug / "seed-0" / "summary.json").read_text())
        assert summary["self_distillation"] == slug.split("_")[1] and "teacher_accuracy" not in summary
        assert aggregates["Student with its teacher prompt (step 0)"][0] == summary["student_accuracy_hinted"]
        row = aggregates["Against the student with its teacher prompt"][name]
        assert row["gap_closed"][0] == pytest.approx(summary["gap_closed"])
        if slug.endswith("_live"):  # the live teacher at the end; a frozen one is the step-0 student
            assert row["student_accuracy_hinted_after"][0] == summary["student_accuracy_hinted_after"]
        else:
            assert "student_accuracy_hinted_after" not in summary
        history = json.loads((tmp_path / "runs" / slug / "seed-0" / "log_history.json").read_text())
        for metric in ("advantage/abs_mean", "tv/scale"):
            logged = [entry[metric] for entry in history if metric in entry]
            assert len(logged) == 4 and aggregates["Over training"][name][metric][0] == pytest.approx(
                sum(logged) / len(logged)
            )
    tables = (results / "tables.md").read_text()
    assert "| Student with its teacher prompt (step 0) |" in tables and "Mean abs(delta)" in tables


@pytest.mark.compat_skip
def test_a_study_across_teacher_families_reports_the_gap_and_the_spans(tmp_path):
    _run_short_study(
        tmp_path,
        "study_cross_tokenizer",
        methods=lambda raw: {slug: raw["methods"][slug] for slug in ("tv_same", "raw_digits")},
        overrides=lambda raw: raw["overrides"] | {"cross_tokenizer": True},  # the study's, which the cut replaced
        analysis={"late_window": [2, 4, 2], "span_metrics": True},
    )

    results = tmp_path / "results"
    for name in ("README.md", "tables.md", "curves.png", "tv_scale.png"):
        assert (results / name).is_file(), name
    aggregates = json.loads((results / "results.json").read_text())["aggregates"]
    summary = json.loads((tmp_path / "runs" / "raw_digits" / "seed-0" / "summary.json").read_text())
    row = aggregates["Against each teacher"]["Raw OPD - Llama digits"]
    assert row["gap_closed"][0] == pytest.approx(summary["gap_closed"])
    assert row["teacher"][0] == summary["teacher_accuracy"]
    history = json.loads((tmp_path / "runs" / "raw_digits" / "seed-0" / "log_history.json").read_text())
    logged = [
        entry["cross_tokenizer/student_tokens_per_span"]
        for entry in history
        if "cross_tokenizer/student_tokens_per_span" in entry
    ]
    spans = aggregates["Alignment"]
    assert spans["Raw OPD - Llama digits"]["student_tokens_per_span"][0] == pytest.approx(sum(logged) / len(logged))
    assert spans["Raw OPD - Llama digits"]["student_tokens_per_span"][0] >= 1
    masked = [
        entry["cross_tokenizer/masked_fraction"] for entry in history if "cross_tokenizer/masked_fraction" in entry
    ]
    assert spans["Raw OPD - Llama digits"]["masked_fraction"][0] == pytest.approx(100 * sum(masked) / len(masked))
    assert spans["TV-OPD - same family"]["student_tokens_per_span"] is None  # the token path has no spans


@pytest.mark.parametrize(
    "name",
    [
        "study",
        "study_smoke",
        "study_cross_tokenizer",
        "study_multi_teacher",
        "study_long",
        "study_reward",
        "study_async",
        "study_async_lr",
        "study_async_lr3e-4",
        "study_async_steps",
        "study_self_distill",
    ],
)
def test_every_shipped_study_file_loads(name):
    study = load_study(f"recipes/tiny/{name}.yaml")
    assert len(grid(study)) == len(study.methods) * len(study.seeds)


def test_the_long_study_holds_the_late_stage_comparison():
    study = load_study("recipes/tiny/study_long.yaml")
    modes = {(method.get("advantage_mode"), method.get("tv_alpha")) for method in study.methods.values()}
    assert {("raw", None), ("sign", None), ("vopd", None), ("power", None), ("shuffle", None)} <= modes
    assert {("sequence_constant", None), ("tv", 0.25), ("tv", 0.5), ("tv", 1.0)} <= modes
    assert study.seeds == [0, 1, 2] and study.recipe.endswith("long_tvopd.yaml")
