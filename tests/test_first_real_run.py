"""docs/first-real-run.md, command by command, in its CPU form: each `tvopd-trl train` up to `accelerate launch` with
the GPUs the command assumes pretended (the recipe parsed and checked, the launch it would start compared with the
page's words), the server's command line as it would start on CUDA, and the doctor, the evaluation, the selection, the
report and the push run for real on CPU stand-ins (the embedded tiny pair for the doctor; the tiny student's
checkpoints, and a LoRA adapter of it, for the runs; a local stand-in of the Hub)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tvopd_trl.cli import main as cli
from tvopd_trl.tiny import student_path

from .hub_stand_in import local_hub


PAGE = Path(__file__).resolve().parents[1] / "docs" / "first-real-run.md"
DAPO_SAMPLE = Path(__file__).resolve().parent / "data" / "train" / "dapo_math_17k_sample.jsonl"
STUDENT = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"


def block(name):
    """The commands of the page's block `<!-- first-run: NAME -->`: continuation lines joined, one string each."""
    text = PAGE.read_text(encoding="utf-8")
    after = text[text.index(f"<!-- first-run: {name} -->") :]
    code = re.search(r"```bash\n(.*?)```", after, flags=re.DOTALL).group(1)
    return [line.strip() for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def tvopd_trl_args(command, **variables):
    """`tvopd-trl ...` of a shell line: its arguments with `$NAME` expanded, without the `CUDA_VISIBLE_DEVICES=`
    prefix, a redirection or a trailing `&`; and the number of GPUs that prefix makes visible (None without one)."""
    for name, value in variables.items():
        command = command.replace(f"${name}", str(value))
    words = shlex.split(command.split(">")[0].rstrip(" &"))
    gpus = None
    if words[0].startswith("CUDA_VISIBLE_DEVICES="):
        gpus = len(words.pop(0).split("=", 1)[1].split(","))
    assert words[0] == "tvopd-trl", command
    return words[1:], gpus


@pytest.fixture
def launches(monkeypatch):
    import accelerate.commands.launch
    import torch

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)

    def pretend(gpus):
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: gpus)

    return launched, pretend


# The recipes' `bf16: true` is refused at config construction on a machine without a GPU unless `use_cpu` is set
CPU = ["--use_cpu", "true"]


def test_the_install_names_the_extras_setup_cfg_defines():
    (_, install) = block("install")
    extras = re.search(r'pip install -e "\.\[([\w,-]+)\]"', install).group(1).split(",")
    setup = (PAGE.parents[1] / "setup.cfg").read_text()
    assert all(re.search(rf"^{extra} =$", setup, flags=re.M) for extra in extras), extras


def test_the_trainers_launch_as_the_page_says(launches, tmp_path):
    launched, pretend = launches
    (train,) = block("train")
    (resume,) = block("resume")
    for command in (train, resume):
        args, gpus = tvopd_trl_args(command)
        pretend(gpus)
        assert gpus == 4 and cli([*args, *CPU, "--output_dir", str(tmp_path)]) == 0
        launch = launched[-1]
        # 4 processes under our zero3 config, 16 accumulation steps: 4 x 1 x 16 = 64 prompts a step
        assert launch.num_processes == 4 and launch.config_file.endswith("recipes/accelerate_configs/zero3.yaml")
        script = launch.training_script_args
        assert script[script.index("--config") + 1].endswith("tvopd_vllm_server.yaml")
        assert "--save_only_model" in script and "--report_to" in script
    script = launched[-1].training_script_args
    assert script[script.index("--resume_from_checkpoint") + 1] == "last"
    # Where the node shows 4 GPUs and the recipe's 8-process config is kept, the launch is refused
    args, _ = tvopd_trl_args(train.replace("tvopd_vllm_server.yaml", "tvopd.yaml"))
    assert cli([*args, *CPU, "--output_dir", str(tmp_path)]) == 2


def test_the_server_command_is_tensor_parallel_over_four_gpus():
    from tvopd_trl.scripts.vllm_serve import make_parser
    from tvopd_trl.vllm_server import server_command

    (server,) = block("server")
    args, gpus = tvopd_trl_args(server)
    assert args[0] == "vllm-serve" and gpus == 4
    parsed, vllm_args = make_parser().parse_known_args(args[1:])
    assert (parsed.role, parsed.model, parsed.port) == ("rollouts", STUDENT, 8000)
    command, env = server_command(parsed.model, parsed.role, "cuda", "0.0.0.0", parsed.port, vllm_args)
    # vLLM keeps an option's last value: the page's, after TRL's defaults
    last = len(command) - 1 - command[::-1].index("--tensor-parallel-size")
    assert command[last + 1] == "4" and "--max-model-len" in command
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_the_doctor_checks_the_pair_before_any_gpu_hour():
    """On the embedded pair (one tokenizer, as the paper's): the recipe's checks pass with the page's dtype."""
    from tvopd_trl.tiny import teacher_path

    (doctor,) = block("doctor")
    args, _ = tvopd_trl_args(doctor)
    stand_in = ["--model_name_or_path", student_path(), "--teacher_model_name_or_path", teacher_path()]
    stand_in += ["--dataset_name", str(DAPO_SAMPLE), "--doctor_prompts", "4", "--doctor_max_completion_length", "8"]
    assert cli([*args, *stand_in, *CPU]) == 0


def _run_with_checkpoints(folder, adapter=False):
    """A run folder with checkpoints 25 and 50 of the tiny student (or of a LoRA adapter on it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(student_path())
    tokenizer = AutoTokenizer.from_pretrained(student_path())
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    for step in (25, 50):
        model.save_pretrained(folder / f"checkpoint-{step}")
        tokenizer.save_pretrained(folder / f"checkpoint-{step}")
    return folder


# The stand-ins' evaluation: the tiny student's benchmark, a few problems and tokens
SMALL_EVAL = ["--benchmarks", "tiny", "--limit", "2", "--max_new_tokens", "4"]


def test_the_evaluation_over_eight_gpus_then_selection_report_and_push(tmp_path, monkeypatch):
    run = _run_with_checkpoints(tmp_path / "run")
    setup, loop, *_ = block("eval")
    assert setup.startswith("RUN=") and "for i in 0 1 2 3 4 5 6 7" in loop
    (command,) = re.findall(r"CUDA_VISIBLE_DEVICES=\$i tvopd-trl eval [^&]*", " ".join(block("eval")))
    for shard in range(8):  # the loop's commands, one after another
        args, gpus = tvopd_trl_args(command.replace(STUDENT, student_path()), RUN=run, i=shard)
        assert gpus == 1 and cli([*args, *SMALL_EVAL]) == 0
    evaluated = sorted(path.name for path in (run / "eval" / "mean@16").iterdir())
    assert evaluated == ["step-0", "step-25", "step-50"]  # step 0: the model the run started from

    select, report = block("report")
    assert cli([*tvopd_trl_args(select, RUN=run)[0], "--benchmarks", "tiny"]) == 0
    monkeypatch.chdir(tmp_path)
    assert cli([*tvopd_trl_args(report, RUN=run)[0], "--benchmarks", "tiny", "--min_step", "1"]) == 0
    assert "| Student |" in (tmp_path / "report" / "main_results.md").read_text()

    (push,) = block("push")
    args, _ = tvopd_trl_args(push, RUN=run)
    with local_hub() as hub, hub.as_default():
        assert cli([*args, "--token", "hf_test"]) == 0
    selected = json.loads((run / "selection.json").read_text())["step"]
    (repo,) = hub.repos
    assert hub.repos[repo]["model.safetensors"] == (run / f"checkpoint-{selected}" / "model.safetensors").read_bytes()


def test_the_lora_run_on_one_gpu(launches, tmp_path, monkeypatch):
    launched, pretend = launches
    train, setup, evaluate, select, push = block("lora")
    pretend(1)
    args, _ = tvopd_trl_args(train)
    assert cli([*args, *CPU, "--output_dir", str(tmp_path / "launched")]) == 0
    launch = launched[-1]
    assert launch.config_file.endswith("recipes/accelerate_configs/single_gpu.yaml") and launch.num_processes is None
    assert setup.startswith("RUN=")

    run = _run_with_checkpoints(tmp_path / "lora", adapter=True)
    args, _ = tvopd_trl_args(evaluate.replace(STUDENT, student_path()), RUN=run)
    assert cli([*args, *SMALL_EVAL]) == 0  # each adapter merged into its base model
    assert sorted(path.name for path in (run / "eval" / "mean@16").iterdir()) == ["step-0", "step-25", "step-50"]
    assert cli([*tvopd_trl_args(select, RUN=run)[0], "--benchmarks", "tiny"]) == 0
    with local_hub() as hub, hub.as_default():
        assert cli([*tvopd_trl_args(push, RUN=run)[0], "--token", "hf_test"]) == 0
    (repo,) = hub.repos
    assert "adapter_model.safetensors" in hub.repos[repo]
