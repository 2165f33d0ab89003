"""A run killed with SIGKILL resumes through the CLI onto the trajectory of an uninterrupted run, and a checkpoint
half-written by a killed process never poisons the resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tvopd_trl.testing import tiny_config, tiny_pair_trainer

from ..timeouts import time_limit


FLAGS = [
    "--config", "recipes/tiny/tvopd.yaml", "--max_steps", "40", "--per_device_train_batch_size", "16",
    "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "10",
    "--eval_problems", "16", "--eval_k", "2", "--eval_every_steps", "5", "--eval_teacher", "false",
]  # fmt: skip
# With two teachers (the multi-teacher family), each teacher's scheduler must resume exactly too.
MULTI_TEACHER = ["--embedded_task", "multi_teacher", "--eval_benchmark", "tiny,tiny-subtraction"]
TV_KEYS = ("tv/estimate", "tv/frozen", "loss", "update/norm", "kl/reverse_estimate")
SCALE_KEYS = ("scale", "ema", "reference")


def _job(output_dir, *extra):
    return [sys.executable, "-m", "tvopd_trl.scripts.train", *FLAGS, "--output_dir", str(output_dir), *extra]


def _steps(output_dir):
    history = json.loads((output_dir / "log_history.json").read_text())
    # A teacher's ema and reference appear from the step that fixes its reference on (`tv_reference_min_tokens`)
    scales = sorted({key for entry in history for key in entry if key.startswith("tv/") and key.endswith(SCALE_KEYS)})
    return {
        entry["step"]: {key: entry.get(key) for key in (*TV_KEYS, *scales)} for entry in history if "loss" in entry
    }


@pytest.mark.long
@pytest.mark.parametrize("teachers", [[], MULTI_TEACHER], ids=["one_teacher", "two_teachers"])
def test_a_killed_run_resumes_onto_the_uninterrupted_trajectory(teachers, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = tmp_path / "reference"
    subprocess.run(_job(reference, *teachers), env=env, check=True, capture_output=True, timeout=time_limit(900))
    uninterrupted = _steps(reference)
    per_teacher = [key for key in uninterrupted[40] if key.count("/") == 2 and uninterrupted[40][key] is not None]
    assert len(per_teacher) == (6 if teachers else 0)  # tv/<teacher>/{scale,ema,reference}, for each teacher

    killed = tmp_path / "killed"
    process = subprocess.Popen(_job(killed, *teachers), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + time_limit(600)
    while not (killed / "checkpoint-10" / "trainer_state.json").is_file():
        assert process.poll() is None, "the run ended before its first checkpoint"
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"no checkpoint-10 within {time_limit(600):g} s")
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoint-40").exists() and not (killed / "summary.json").exists()

    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "tvopd-trl"), "train", *FLAGS[2:], "--config", FLAGS[1],
         "--output_dir", str(killed), "--resume_from_checkpoint", "last", *teachers],
        env=env, capture_output=True, text=True, timeout=time_limit(900),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = _steps(killed)
    resumed_from = max(
        int(name.split("-")[1])
        for name in os.listdir(killed)
        if name.startswith("checkpoint-") and name != "checkpoint-40"
    )
    assert resumed_from >= 10
    for step in range(resumed_from + 1, 41):
        assert resumed[step] == uninterrupted[step], step  # the scheduler state and every logged value, exactly
    # The killed run's evaluations past its checkpoint were redone and the old records kept aside.
    evaluated = sorted(int(name.split("-")[1]) for name in os.listdir(killed / "eval" / "mean@2"))
    assert evaluated == list(range(0, 41, 5))


def test_a_half_written_checkpoint_is_skipped_with_a_warning(tmp_path):
    args = tiny_config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    first = tiny_pair_trainer(args, prompts=16)
    first.train()
    uninterrupted = [e for e in first.state.log_history if "tv/scale" in e]
    # A process killed while saving step 4: the weights are cut short and trainer_state.json was never written.
    checkpoint = tmp_path / "checkpoint-4"
    (checkpoint / "trainer_state.json").unlink()
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])

    second = tiny_pair_trainer(
        tiny_config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1), prompts=16
    )
    with pytest.warns(UserWarning, match=r"checkpoint-4 is incomplete \(it lacks a readable trainer_state.json"):
        second.train(resume_from_checkpoint=True)
    resumed = [e for e in second.state.log_history if "tv/scale" in e]
    assert [e["step"] for e in resumed] == [1, 2, 3, 4]  # steps 1-2 come from checkpoint-2's state
    for before, after in zip(uninterrupted[2:], resumed[2:], strict=True):
        assert {k: before[k] for k in ("tv/scale", "tv/estimate", "loss")} == {
            k: after[k] for k in ("tv/scale", "tv/estimate", "loss")
        }
    assert checkpoint.is_dir()  # left in place for the user to inspect


def test_resuming_from_an_incomplete_checkpoint_by_path_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    torch.save({}, checkpoint / "optimizer.pt")
    trainer = tiny_pair_trainer(tiny_config(tmp_path, max_steps=2), prompts=16)
    with pytest.raises(ValueError, match=r"lacks a readable trainer_state.json, model weights\. Resume with"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    with pytest.raises(ValueError, match="No complete checkpoint-N"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.parametrize(
    "layout, missing",
    [
        ({"model.safetensors": ""}, []),
        ({"global_step4/mp_rank_00_model_states.pt": ""}, []),  # DeepSpeed
        ({"pytorch_model_fsdp_0/__0_0.distcp": ""}, []),  # FSDP's sharded state dict
        ({"pytorch_model.bin.index.json": '{"weight_map": {"a": "pytorch_model-00001-of-00002.bin",'
          ' "b": "pytorch_model-00002-of-00002.bin"}}', "pytorch_model-00001-of-00002.bin": ""},
         ["pytorch_model-00002-of-00002.bin"]),
        ({"model.safetensors.index.json": "{"}, ["a readable model.safetensors.index.json"]),  # cut short
        ({"optimizer.pt": ""}, ["model weights"]),
    ],
)  # fmt: skip
def test_every_weights_layout_counts_as_complete_when_whole(tmp_path, layout, missing):
    from tvopd_trl.checkpoints import missing_parts

    (tmp_path / "trainer_state.json").write_text("{}")
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert missing_parts(str(tmp_path)) == missing
