"""The benchmark evaluation sharded over the processes of a run (`BenchmarkEvalCallback` under ZeRO-3 and FSDP2):
every process generates and grades its share of the batches, and the score equals `tvopd-trl eval` of the model saved
at that step.

The launched runs are tests/distributed_scripts/zero3_eval.py and fsdp2_eval.py, started as tests/test_distributed.py
starts its runs.
"""

import json

import pytest
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl import tiny
from tvopd_trl.cli import main as cli_main
from tvopd_trl.eval import SamplingSettings, TransformersGenerator, get_benchmark, load_problems

from .test_distributed import launch


# The launch config and script of each sharded run: FSDP2 runs on the test-only CPU stand-in of tests/test_fsdp.py.
RUNS = {"zero3": ("zero3_cpu.yaml", "zero3_eval.py"), "fsdp2": ("ddp_cpu.yaml", "fsdp2_eval.py")}


# Not in the compatibility legs: the trainer's own evaluation loop over the engines (tests/test_distributed.py's ZeRO-3
# run covers transformers' side of a sharded launch there)
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.compat_skip) for name in sorted(RUNS)])
def sharded_eval_run(request, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp(f"{request.param}_eval")
    return output_dir, launch(*RUNS[request.param], output_dir)


def _offline_eval(model, run, output_dir):
    """`tvopd-trl eval` of `model` with the evaluation settings of `run` (a rank's record), and its records."""
    evaluation = run["evaluation"]
    argv = ["eval", "--model", str(model), "--output_dir", str(output_dir), "--benchmarks", *evaluation["benchmarks"]]
    argv += ["--limit", str(evaluation["limit"]), "--batch_size", str(evaluation["batch_size"])]
    argv += [f"--{key}={value}" for key, value in run["settings"].items()]
    assert cli_main(argv) == 0
    return _records(output_dir)


def _records(folder):
    """The scores (less the time taken) and the per-response records of an evaluation folder."""
    results = json.loads((folder / "results.json").read_text())
    scores = {key: value for key, value in results["benchmarks"]["tiny"].items() if key != "seconds"}
    return scores, (folder / "tiny.jsonl").read_text().splitlines()


def test_ranks_evaluate_together_and_get_the_same_scores(sharded_eval_run):
    _, (first, second) = sharded_eval_run
    steps = [step for step, _ in first["models"]]
    assert [step for step, _ in first["history"]] == [step for step, _ in second["history"]] == steps
    for (step, mine), (_, theirs) in zip(first["history"], second["history"], strict=True):
        mine, theirs = mine["benchmarks"]["tiny"], theirs["benchmarks"]["tiny"]
        assert mine["problems"] == first["evaluation"]["limit"], step
        assert {**mine, "seconds": None} == {**theirs, "seconds": None}, step


def test_ranks_log_the_scores_with_the_training_metrics(sharded_eval_run):
    _, (first, second) = sharded_eval_run
    # At the step it evaluated, by both ranks.
    for run in (first, second):
        logged = {entry["step"]: entry["eval/tiny/mean@2"] for entry in run["logs"]}
        assert logged == {step: results["benchmarks"]["tiny"]["mean@2"] for step, results in first["history"]}
        assert all("loss" in entry for entry in run["logs"] if entry["step"] > 0)


def test_in_training_scores_equal_tvopd_trl_eval_of_the_saved_models(sharded_eval_run, tmp_path):
    output_dir, (run, _) = sharded_eval_run
    # Before training the student is the shipped one; after, the model saved at that step.
    offline = {step: _offline_eval(model, run, tmp_path / f"step-{step}") for step, model in run["models"]}
    for step, (scores, records) in offline.items():
        # The same score, and the same extracted answer and grade for every (problem, sample).
        assert _records(output_dir / "eval" / "mean@2" / f"step-{step}") == (scores, records), step
        assert len(records) == run["evaluation"]["limit"] * run["settings"]["k"]
    first, last = (records for _, records in offline.values())
    assert first != last  # the evaluations saw the trained weights


@pytest.fixture
def one_process_group(tmp_path):
    """A process group of one: sharded generation keeps the shards in step (`synced_gpus`), which needs one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("temperature", [0.6, 0.0])
def test_the_shards_of_a_generation_make_up_the_unsharded_one(one_process_group, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny.student_path())
    tokenizer = AutoTokenizer.from_pretrained(tiny.student_path())
    prompts = [get_benchmark("tiny").prompt(problem) for problem in load_problems("tiny", limit=5)]
    settings = SamplingSettings(k=2, temperature=temperature, max_new_tokens=8)
    # 10 sampled sequences make 4 batches of 3 (greedy: 5 make 2) over 3 shards: uneven shards, and an empty one.
    generator = TransformersGenerator(model, tokenizer, batch_size=3)
    whole = generator(prompts, settings)
    shards = [generator(prompts, settings, shard=(index, 3)) for index in range(3)]
    for i, responses in enumerate(whole):
        for j, response in enumerate(responses):
            (generated,) = [shard[i][j] for shard in shards if shard[i][j] is not None]
            assert generated == response, (i, j)
    if temperature > 0:
        assert len({response for responses in whole for response in responses}) > 1  # really sampled
