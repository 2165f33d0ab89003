"""`report_to`: wandb (offline), TensorBoard and trackio record the TV-OPD metrics, evaluation scores and completions.

Each backend runs in its own process (they read their directories from the environment at import) on the shipped tiny
pair, and the test reads the backend's own files back and compares them with the trainer's `log_history`.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from .timeouts import time_limit


TRAIN = """
import json, sys
from tvopd_trl.eval import BenchmarkEvalCallback, SamplingSettings
from tvopd_trl.testing import tiny_config, tiny_pair_trainer

backend, output_dir = sys.argv[1], sys.argv[2]
args = tiny_config(output_dir, max_steps=2, logging_steps=1, report_to=[backend], log_completions=True)
trainer = tiny_pair_trainer(args, prompts=16)
settings = SamplingSettings(k=1, max_new_tokens=8)
trainer.add_callback(BenchmarkEvalCallback(trainer, ["tiny"], 2, settings=settings, limit=4, at_start=False))
trainer.train()
json.dump(trainer.state.log_history, open(f"{output_dir}/log_history.json", "w"))
"""
CHECKED = ("tv/scale", "tv/estimate", "tv/ema", "eval/tiny/mean@1")


def _train(backend, tmp_path, **env):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    subprocess.run(
        [sys.executable, "-c", TRAIN, backend, str(tmp_path / "run")],
        env=environment,
        check=True,
        timeout=time_limit(600),
    )
    history = json.loads((tmp_path / "run" / "log_history.json").read_text())
    expected = {(e["step"], key): e[key] for e in history for key in CHECKED if key in e}
    assert {key for _, key in expected} == set(CHECKED)  # the run logged every checked metric
    return expected


def _assert_recorded(expected, recorded):
    """`recorded` maps (step, metric name as the backend spells it) to a value; the trainer adds a `train/` prefix."""
    for (step, key), value in expected.items():
        assert recorded[(step, f"train/{key}")] == pytest.approx(value, rel=1e-6), (step, key)


def test_wandb_offline_records_metrics_and_the_completions_table(tmp_path):
    env = {
        name: str(tmp_path / "wandb")
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR")
    }
    expected = _train("wandb", tmp_path, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="tvopd-test", **env)
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's own reader of its transaction log, one JSON record per line.
    dump = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "wandb"), "leet", "inspect", "--json", run_file],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    records = [json.loads(line) for line in dump.splitlines() if line.startswith("{")]
    recorded = {}
    for record in records:
        if record.get("type") == "history":
            items = record["history"]["item"]
            recorded |= {(items.get("train/global_step"), key): value for key, value in items.items()}
    _assert_recorded(expected, recorded)
    # TRL's completions table: logged as a wandb Table of (step, prompt, completion) rows.
    tables = glob.glob(
        str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "completions_*.json")
    )
    assert tables
    table = json.loads(open(sorted(tables)[0]).read())
    assert table["columns"] == ["step", "prompt", "completion"] and len(table["data"]) == 4  # 4 prompts per step
    assert all("Compute" in row[1] for row in table["data"])
    assert len(glob.glob(str(tmp_path / "run" / "completions" / "completions_*.parquet"))) == 2  # one per logged step


def test_tensorboard_records_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = _train("tensorboard", tmp_path, TENSORBOARD_LOGGING_DIR=str(tmp_path / "tb"))
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    recorded = {
        (event.step, tag): event.value for tag in accumulator.Tags()["scalars"] for event in accumulator.Scalars(tag)
    }
    _assert_recorded(expected, recorded)


def test_trackio_records_metrics(tmp_path):
    expected = _train("trackio", tmp_path, TRACKIO_DIR=str(tmp_path / "trackio"), HF_HOME=str(tmp_path / "hf"))
    (database,) = glob.glob(str(tmp_path / "trackio" / "*.db"))
    read = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "project = sys.argv[1]; (run,) = S.get_runs(project); print(json.dumps(S.get_logs(project, run)))"
    )
    project = os.path.basename(database).removesuffix(".db")
    logs = subprocess.run(
        [sys.executable, "-c", read, project],
        env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    recorded = {}
    for entry in json.loads(logs):
        recorded |= {(entry.get("train/global_step", entry["step"]), key): value for key, value in entry.items()}
    _assert_recorded(expected, recorded)
