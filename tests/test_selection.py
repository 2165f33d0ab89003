"""Checkpoint selection, run aggregation, retention metrics and the report tables, on small synthetic runs."""

import json
import shutil
import statistics

import pytest

from tvopd_trl.cli import main as cli_main
from tvopd_trl.eval import (
    PAPER_BENCHMARKS,
    aggregate_score,
    aggregate_selections,
    align_runs,
    best_over_training,
    late_mean,
    load_run,
    peak_drop,
    select_checkpoint,
    stage_averages,
    step_dir,
    trajectory_average,
)
from tvopd_trl.eval.tables import format_table


def uniform(value, **overrides):
    """All six paper benchmarks at `value`, with `overrides`."""
    return {**dict.fromkeys(PAPER_BENCHMARKS, value), **overrides}


def write_run(run_dir, run, k=4):
    for step, scores in run.items():
        folder = step_dir(str(run_dir), step, k)
        benchmarks = {name: {"k": k, f"mean@{k}": value} for name, value in scores.items()}
        (run_dir / "eval" / f"mean@{k}" / f"step-{step}").mkdir(parents=True)
        with open(f"{folder}/results.json", "w") as f:
            json.dump({"benchmarks": benchmarks}, f)


def test_selection_picks_the_earliest_of_tied_maxima():
    run = {0: uniform(0.9), 100: uniform(0.5), 200: uniform(0.6, aime24=0.8), 300: uniform(0.6, aime25=0.8)}
    selection = select_checkpoint(run)
    # Steps 200 and 300 tie at (5 * 0.6 + 0.8) / 6; step 0 is outside 1..1000 although it scores higher.
    assert selection.step == 200 and selection.mean == pytest.approx((5 * 0.6 + 0.8) / 6)
    assert selection.scores == run[200]


def test_selection_ignores_steps_after_1000_and_steps_missing_a_benchmark():
    run = {500: uniform(0.4), 1000: uniform(0.5), 1025: uniform(0.9), 600: {"aime24": 1.0}}
    assert select_checkpoint(run).step == 1000
    assert select_checkpoint(run, max_step=2000).step == 1025
    assert select_checkpoint(run, benchmarks=["aime24"]).step == 600


def test_selection_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="missing: math500"):
        select_checkpoint({100: dict.fromkeys(PAPER_BENCHMARKS[:5], 0.5)})
    with pytest.raises(ValueError, match="No evaluation within steps 1..1000"):
        select_checkpoint({0: uniform(0.5), 1200: uniform(0.5)})


def test_aggregation_across_runs_uses_the_sample_deviation_and_per_run_averages():
    runs = [{10: uniform(0.3, aime24=0.9)}, {10: uniform(0.5)}, {10: uniform(0.4, math500=0.1)}]
    selections = [select_checkpoint(run) for run in runs]
    table = aggregate_selections(selections)
    assert table["aime24"] == pytest.approx((statistics.fmean([0.9, 0.5, 0.4]), statistics.stdev([0.9, 0.5, 0.4])))
    run_means = [(5 * 0.3 + 0.9) / 6, 0.5, (5 * 0.4 + 0.1) / 6]
    assert table["avg"] == pytest.approx((statistics.fmean(run_means), statistics.stdev(run_means)))
    assert aggregate_selections(selections[:1])["avg"] == (pytest.approx(run_means[0]), None)


def test_retention_metrics_by_hand():
    run = {
        0: {"aime24": 0.2, "aime25": 0.1},
        100: {"aime24": 0.6, "aime25": 0.5},  # S = 0.55, the peak
        200: {"aime24": 0.5, "aime25": 0.4},  # S = 0.45
        300: {"aime24": 0.4, "aime25": 0.4},  # S = 0.40
        400: {"aime24": 0.9, "aime25": 0.9},  # after the window: not part of the peak
        150: {"aime24": 0.3},  # S needs both benchmarks
    }
    series = aggregate_score(run)
    assert series == pytest.approx({0: 0.15, 100: 0.55, 200: 0.45, 300: 0.40, 400: 0.9})
    window = (200, 300)
    assert late_mean(series, window) == pytest.approx(0.425)
    assert peak_drop(series, window) == pytest.approx(0.55 - 0.425)
    stages = stage_averages(series, {"early": (0, 100), "late": (200, 300)})
    assert stages == pytest.approx({"early": 0.35, "late": 0.425})
    assert best_over_training(series) == 0.9 and trajectory_average(series) == pytest.approx(2.45 / 5)
    with pytest.raises(ValueError, match=r"needs steps \[250\]"):
        late_mean(series, (200, 250, 300))
    with pytest.raises(ValueError, match="Stage 'middle'"):
        stage_averages(series, {"middle": (110, 190)})


def test_runs_with_different_step_grids():
    runs = {"a": {0: 1.0, 25: 2.0, 50: 3.0, 75: 4.0}, "b": {0: 1.0, 50: 5.0}}
    common = align_runs(runs)
    assert common.runs == {"a": {0: 1.0, 50: 3.0}, "b": {0: 1.0, 50: 5.0}}
    assert common.missing == {"a": [], "b": [25, 75]}
    assert "common horizon: 2 steps" in common.note and "b lacks 25, 75" in common.note
    everything = align_runs(runs, "all")
    assert everything.runs == runs and everything.note.startswith("all observations kept")
    with pytest.raises(ValueError, match="share no evaluated step"):
        align_runs({"a": {0: 1.0}, "b": {10: 1.0}})


def test_load_run_reads_saved_evaluations_and_rejects_empty_ones(tmp_path):
    with pytest.raises(ValueError, match="has no evaluations"):
        load_run(str(tmp_path))
    write_run(tmp_path, {0: {"aime24": 0.25}, 50: {"aime24": 0.5}}, k=4)
    assert load_run(str(tmp_path)) == {0: {"aime24": 0.25}, 50: {"aime24": 0.5}}
    write_run(tmp_path, {50: {"aime24": 0.75}}, k=16)
    with pytest.raises(ValueError, match=r"mean@\[4, 16\]; say which k"):
        load_run(str(tmp_path))
    assert load_run(str(tmp_path), k=16) == {50: {"aime24": 0.75}}
    with pytest.raises(ValueError, match="no mean@8"):
        load_run(str(tmp_path), k=8)


def test_tables_mark_best_and_second_best():
    rows = {
        "Raw": {"a": (0.5, 0.01), "b": (0.2, None)},
        "TV": {"a": (0.6, 0.02), "b": (0.1, None)},
        "Sign": {"a": (0.4, 0.0)},
    }
    markdown = format_table(rows, ["a", "b"], header={"a": "AIME24"}, fixed_rows={"Student": {"a": 0.9, "b": 0.9}})
    lines = markdown.splitlines()
    assert lines[0] == "| Method | AIME24 | b |"
    assert lines[2] == "| Student | 90.00 | 90.00 |"  # a fixed row is never marked, even when highest
    assert lines[3] == "| Raw | <u>50.00 ± 1.00</u> | **20.00** |"
    assert lines[4] == "| TV | **60.00 ± 2.00** | <u>10.00</u> |"
    assert lines[5] == "| Sign | 40.00 ± 0.00 | – |"
    latex = format_table(rows, ["a"], fmt="latex", first_column="Method_name")
    assert "\\textbf{60.00 $\\pm$ 2.00}" in latex and "\\underline{50.00 $\\pm$ 1.00}" in latex
    assert "\\textbf{Method\\_name}" in latex and "\\begin{tabular}{lc}" in latex
    by_row = format_table({"early": {"x": 0.3, "y": 0.4}}, ["x", "y"], highlight="rows", rank_second=False)
    assert "| early | 30.00 | **40.00** |" in by_row
    lowest = format_table(rows, ["a", "b"], lower_is_better=("b",)).splitlines()
    assert (
        lowest[2] == "| Raw | <u>50.00 ± 1.00</u> | <u>20.00</u> |"
        and lowest[3] == "| TV | **60.00 ± 2.00** | **10.00** |"
    )


def test_select_and_report_commands(tmp_path, capsys):
    steps = range(0, 101, 25)
    runs = {
        "tv0": {s: uniform(0.3 + s / 1000, aime24=0.4 + s / 500) for s in steps},
        "tv1": {s: uniform(0.32 + s / 1000) for s in steps},
        "raw0": {s: uniform(0.3 + (0.05 if s == 50 else 0)) for s in steps if s != 75},
    }
    for name, run in runs.items():
        write_run(tmp_path / name, run)
    (tmp_path / "tv0" / "checkpoint-100").mkdir()
    assert cli_main(["select", str(tmp_path / "tv0"), str(tmp_path / "raw0")]) == 0
    selection = json.loads((tmp_path / "tv0" / "selection.json").read_text())
    assert selection["step"] == 100 and selection["checkpoint"] == str(tmp_path / "tv0" / "checkpoint-100")
    raw_selection = json.loads((tmp_path / "raw0" / "selection.json").read_text())
    assert raw_selection["step"] == 50 and raw_selection["checkpoint"] is None

    out = tmp_path / "report"
    argv = [
        "report",
        "--method",
        f"TV-OPD={tmp_path / 'tv0'},{tmp_path / 'tv1'}",
        "--method",
        f"Raw={tmp_path / 'raw0'}",
        "--output_dir",
        str(out),
        "--late_window",
        "50:100:50",
        "--stages",
        "early=0:25,late=50:100",
    ]
    assert cli_main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["selected_steps"] == {
        "TV-OPD": {str(tmp_path / "tv0"): 100, str(tmp_path / "tv1"): 100},
        "Raw": {str(tmp_path / "raw0"): 50},
    }
    tv_avg = [(5 * 0.4 + 0.6) / 6, 0.42]
    assert report["main_results"]["TV-OPD"]["avg"] == pytest.approx(
        [statistics.fmean(tv_avg), statistics.stdev(tv_avg)]
    )
    # Common horizon: raw0 lacks step 75, so no run contributes it.
    assert "raw0 lacks 75" in report["horizon"] and "common horizon: 4 steps" in report["horizon"]
    s_tv0 = {s: ((0.4 + s / 500) + (0.3 + s / 1000)) / 2 for s in (0, 25, 50, 100)}
    s_tv1 = {s: 0.32 + s / 1000 for s in (0, 25, 50, 100)}
    late = [statistics.fmean([s[50], s[100]]) for s in (s_tv0, s_tv1)]
    assert report["retention"]["TV-OPD"]["LateMean"] == pytest.approx([statistics.fmean(late), statistics.stdev(late)])
    drops = [max(s.values()) - m for s, m in zip((s_tv0, s_tv1), late, strict=True)]
    assert report["retention"]["TV-OPD"]["PeakDrop"][0] == pytest.approx(statistics.fmean(drops))
    assert report["stages"]["AIME24, early stage"]["TV-OPD"] == pytest.approx(
        statistics.fmean([statistics.fmean([0.4, 0.45]), 0.32 + 0.0125])
    )
    for name in (
        "main_results.md",
        "main_results.tex",
        "stages.md",
        "retention.tex",
        "curve_aggregate.png",
        "curve_aime24.png",
    ):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert "| Student | 40.00 | 30.00 | 30.00 | 30.00 | 30.00 | 30.00 | 31.67 |" in printed  # tv0 at step 0
    assert "common horizon" in printed

    # With every observation kept, step 75 of the TV runs counts.
    assert cli_main([*argv, "--horizon", "all", "--output_dir", str(tmp_path / "all")]) == 0
    assert json.loads((tmp_path / "all" / "report.json").read_text())["horizon"].startswith("all observations kept")

    # Runs without a step-0 evaluation: the Student row is left out, and the report says how to make it
    for step_0 in (tmp_path / name / "eval" / "mean@4" / "step-0" for name in runs):
        shutil.rmtree(step_0)
    assert cli_main([*argv, "--output_dir", str(tmp_path / "no_student")]) == 0
    assert "leave out the Student row" in capsys.readouterr().out
    assert "| Student |" not in (tmp_path / "no_student" / "main_results.md").read_text()


def test_report_errors_without_evaluations(tmp_path, capsys):
    assert cli_main(["select", str(tmp_path)]) == 2
    assert "has no evaluations" in capsys.readouterr().err


def test_load_run_refuses_steps_evaluated_under_different_settings(tmp_path):
    write_run(tmp_path, {10: {"aime24": 0.5}, 20: {"aime24": 0.5}})
    path = tmp_path / "eval" / "mean@4" / "step-20" / "results.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "limit": 5}))
    with pytest.raises(ValueError, match=r"mixes evaluation settings across steps.*steps \[20\]"):
        load_run(str(tmp_path))


def test_selection_warns_about_steps_missing_a_benchmark():
    with pytest.warns(UserWarning, match=r"Steps \[200\] lack some of"):
        assert select_checkpoint({100: uniform(0.5), 200: {"aime24": 1.0}}).step == 100


def test_report_leaves_out_runs_that_miss_a_window_and_says_so(tmp_path, capsys):
    write_run(tmp_path / "long", {s: uniform(0.4) for s in (0, 50, 100)})
    write_run(tmp_path / "short", {s: uniform(0.3) for s in (0, 50)})
    argv = ["report", "--method", f"A={tmp_path / 'long'}", "--method", f"B={tmp_path / 'short'}"]
    argv += [
        "--output_dir",
        str(tmp_path / "out"),
        "--late_window",
        "100:100:50",
        "--stages",
        "early=0:50,late=100:100",
    ]
    assert cli_main([*argv, "--horizon", "all"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["retention"]["B"] == {"LateMean": None, "PeakDrop": None}
    assert report["retention"]["A"]["LateMean"][0] == pytest.approx(0.4)
    assert report["stages"]["AIME24, late stage"] == {"A": pytest.approx(0.4), "B": None}
    assert "B: not every run was evaluated at every step of the late window" in report["coverage_gaps"]
    assert "Left out: B: 1 run(s) without late-stage evaluations." in capsys.readouterr().out
    assert "\\caption{Validation accuracy (mean@4, \\%)" in (tmp_path / "out" / "main_results.tex").read_text()
