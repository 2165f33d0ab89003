"""`tvopd-trl rehearse`: the paper's recipes, each as written with only flags changed, on SmolLM2-135M-Instruct.

Every recipe's command is checked here up to its launch; the long test rehearses the SFT and the ZeRO-3 TV-OPD recipe for real.
`tvopd-trl rehearse --data_dir tests/data/train` rehearses all of them (results/rehearsal/, about 35 minutes)."""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from tvopd_trl import rehearsal
from tvopd_trl.cli import main as cli

from .test_first_real_run import block


DATA = Path(__file__).resolve().parent / "data" / "train"


def test_every_paper_recipe_is_rehearsed_and_none_lacks_a_cpu_form():
    names = rehearsal.paper_recipes()
    assert names[0] == rehearsal.SFT_RECIPE and len(names) == 30
    for name in names:
        assert rehearsal.why_not(rehearsal.read_recipe(name), has_vllm=True) == "", name
    vllm = [name for name in names if rehearsal.why_not(rehearsal.read_recipe(name), has_vllm=False)]
    assert len(vllm) == 7 and all("vllm" in name or "teacher_pool" in name for name in vllm), vllm
    assert "README's vLLM command" in rehearsal.why_not(rehearsal.read_recipe(vllm[0]), has_vllm=False)


def test_a_model_that_is_not_a_folder_or_a_hub_id_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="The rehearsal's model '/no/such/model' is neither"):
        rehearsal.rehearse("/no/such/model", tmp_path)
    assert not (tmp_path / "logs").exists()


def test_an_unknown_recipe_is_refused_with_the_names(tmp_path):
    with pytest.raises(ValueError, match=r"tiny/tvopd: not a paper recipe.*`tvopd-trl recipes` lists them"):
        rehearsal.rehearse("model", tmp_path, recipes=["tiny/tvopd"])


@pytest.fixture
def launches(monkeypatch):
    import accelerate.commands.launch

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    return launched


def test_each_training_command_parses_and_launches_its_cpu_form(launches, tmp_path):
    """Each recipe's command, as the rehearsal runs it, up to `accelerate launch`: its flags are the main job's, and the
    launch is the CPU form of the recipe's (processes, config)."""
    model = str(tmp_path / "model")
    for name in rehearsal.paper_recipes()[1:]:
        recipe = rehearsal.read_recipe(name)
        command = rehearsal.train_command(name, recipe, model, model, str(tmp_path / name), str(DATA), "http://h:1")
        assert command[1:4] == ["-m", "tvopd_trl.cli", "train"]
        assert cli(command[3:]) == 0, name
        launch = launches[-1]
        config = recipe.get("accelerate_config")
        expected = {
            "zero3": ("zero3_cpu.yaml", 1),
            "zero3_sp": ("zero3_sp_cpu.yaml", 3),
            "single_gpu": ("single_gpu.yaml", None),
        }
        assert launch.config_file.endswith(expected[config][0]) and launch.num_processes == expected[config][1], name
        script = launch.training_script_args
        assert script[script.index("--max_steps") + 1] == "2" and script[script.index("--bf16") + 1] == "false"
        assert script[script.index("--dataset_name") + 1].startswith(str(DATA)), name
        if "teacher_model_server_url" in recipe:  # a pool of two replicas
            assert json.loads(script[script.index("--teacher_model_server_url") + 1]) == ["http://h:1"] * 2


def check_runs(output, results, names):
    for name in names:
        assert results[name]["status"] == "passed", results[name]
        state = json.loads((output / name / "checkpoint-2" / "trainer_state.json").read_text())
        logged = [entry for entry in state["log_history"] if "tv/estimate" in entry]
        assert [entry["step"] for entry in logged] == [1, 2], name
        # The student (SmolLM2 after the SFT's steps) differs from its teacher (SmolLM2), and the second step updates it
        assert all(entry["tv/estimate"] > 0 for entry in logged) and logged[1]["update/norm"] > 0, (name, logged)
    for pair in {name.split("/")[0] for name in names}:
        assert results[f"{pair}/report"]["status"] == "passed", results[f"{pair}/report"]
        table = (output / "report" / pair / "main_results.md").read_text()
        assert "| Student |" in table and all(
            f"| {name.split('/')[1]} |" in table for name in names if name.startswith(pair)
        )


@pytest.mark.long
def test_the_first_run_page_s_rehearsal_trains_evaluates_and_reports(smollm2_dir, tmp_path):
    """docs/first-real-run.md's command on the SFT that makes the student (always run) and the paper's TV-OPD recipe
    under ZeRO-3 (one process: the SP recipes' 3 processes took 5 minutes of CI's 2 cores; results/rehearsal/ has them);
    a vLLM recipe where vLLM is missing is listed as not run."""
    (command,) = block("rehearse")
    args = shlex.split(command)
    assert args[:2] == ["tvopd-trl", "rehearse"] and args[args.index("--data_dir") + 1] == "tests/data/train"
    names = ["justrl-1.5b_to_ds-distill-qwen-1.5b/tvopd", "qwen3-8b_to_qwen3-8b-sft/tvopd_vllm_server"]
    output = tmp_path / "rehearsal"
    args[args.index("--data_dir") + 1] = str(DATA)
    assert cli([*args[1:], "--model", smollm2_dir, "--output_dir", str(output), "--recipes", *names]) == 0
    results = {r["recipe"]: r for r in json.loads((output / "rehearsal.json").read_text())}
    assert results[rehearsal.SFT_RECIPE]["status"] == "passed"
    assert (output / rehearsal.SFT_RECIPE / "model" / "model.safetensors").is_file()
    if importlib.util.find_spec("vllm") is None:
        assert results[names[-1]]["status"] == "not run" and "vLLM" in results[names[-1]]["reason"]
        names = names[:-1]
    check_runs(output, results, names)
    # Evaluated, each run keeps its records and loses its weights (30 runs would take about 33 GB)
    run = output / names[0]
    assert (run / "checkpoint-2" / "trainer_state.json").is_file() and not list(run.rglob("*.safetensors"))
    # A DeepSpeed launch on a CPU does not compile DeepSpeed's shared-memory all-reduce, which training never calls
    assert "shm_comm_op" not in (output / "logs" / "justrl-1.5b_to_ds-distill-qwen-1.5b__tvopd.log").read_text()
    assert "| qwen3-8b_to_qwen3-8b-sft/tvopd_vllm_server |" in (output / "rehearsal.md").read_text()


def test_a_rehearsed_run_loses_its_weights_and_optimizer_states_and_keeps_its_records(tmp_path):
    run = tmp_path / "run"
    kept = ["config.json", "summary.json", "checkpoint-2/trainer_state.json", "checkpoint-2/config.json"]
    kept += ["checkpoint-2/training_args.bin", "eval/mean@1/step-2/results.json"]
    heavy = ["model.safetensors", "checkpoint-2/model.safetensors", "checkpoint-2/adapter_model.safetensors"]
    heavy += ["checkpoint-2/global_step2/mp_rank_00_model_states.pt", "checkpoint-2/optimizer.pt"]
    heavy += ["checkpoint-2/model-00001-of-00002.safetensors", "checkpoint-2/pytorch_model_fsdp_0/0.distcp"]
    for name in kept + heavy:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    rehearsal.delete_weights(str(run))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == sorted(kept)
    assert not (run / "checkpoint-2" / "global_step2").exists()
