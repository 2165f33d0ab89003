"""`tvopd-trl vllm-serve`: the server command line per role and device (`tvopd_trl.vllm_server`), what the command
prints and runs, and the README's two-line vLLM main job. The tests marked `vllm` start the command for real (the
README's vLLM command; skipped without vLLM)."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest
import requests
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.scripts.vllm_serve import ScriptArguments, build_command

from tvopd_trl import cli
from tvopd_trl.testing import LocalVLLMServer, free_port
from tvopd_trl.tiny import vllm_paths
from tvopd_trl.vllm_server import server_command

from .test_vllm import LOGP_TOLERANCE, local_logps, prompt_ids, server_logps
from .test_vllm import pytestmark as needs_vllm
from .timeouts import time_limit


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = vllm_paths()
PYTHON = sys.executable
API_SERVER = [PYTHON, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_test(test):
    for mark in needs_vllm:
        test = mark(test)
    return test


def saved_config(path, **fields):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", **fields}, f)
    return str(path)


# ----------------------------------------------------------------------------------------------------------------------
# The command line per role and device
# ----------------------------------------------------------------------------------------------------------------------


def test_a_cpu_rollout_server_runs_in_development_mode_in_float32(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    command, env = server_command(PAIR["student"], "rollouts", "cpu", "127.0.0.1", 8123, ["--max-model-len", "48"])
    assert command == [
        *API_SERVER,
        *("--model", PAIR["student"], "--host", "127.0.0.1", "--port", "8123"),
        *("--dtype", "float32", "--gpu-memory-utilization", "0.05", "--no-use-tqdm-on-load", "--max-model-len", "48"),
    ]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


def test_a_cpu_teacher_server_has_no_development_endpoints(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # the user's size is kept
    command, env = server_command(PAIR["teacher"], "teacher", "cpu", "127.0.0.1", 8124)
    assert command == [
        *API_SERVER,
        *("--model", PAIR["teacher"], "--host", "127.0.0.1", "--port", "8124"),
        *("--dtype", "float32", "--gpu-memory-utilization", "0.05"),
    ]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4"}


@pytest.mark.parametrize(
    "fields, dtype_flags",
    [
        ({"dtype": "bfloat16"}, []),  # vLLM's `auto` serves a bf16 checkpoint in bf16
        ({"torch_dtype": "float32"}, ["--dtype", "float32"]),  # the name older transformers wrote
        ({}, ["--dtype", "float32"]),  # no dtype: transformers loads it in float32
    ],
    ids=["bfloat16", "torch_dtype float32", "no dtype"],
)
def test_the_cpu_dtype_is_the_checkpoint_s(tmp_path, fields, dtype_flags):
    model = saved_config(tmp_path / "model", **fields)
    command, _ = server_command(model, "teacher", "cpu", "127.0.0.1", 8000)
    assert command[len(API_SERVER) + 6 :] == [*dtype_flags, "--gpu-memory-utilization", "0.05"]


def test_a_cuda_rollout_server_is_trl_vllm_serve():
    extra = ["--tensor-parallel-size", "4"]
    command, env = server_command("Qwen/Qwen3-8B", "rollouts", "cuda", "0.0.0.0", 8000, extra)
    assert command == build_command(ScriptArguments(model="Qwen/Qwen3-8B", host="0.0.0.0", port=8000), extra)
    assert command[:5] == [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-8B"]
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert command[-2:] == extra
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}  # what `trl vllm-serve` sets before it runs the same command


def test_a_cuda_teacher_server_is_vllm_serve_with_trl_s_scoring_flags():
    command, env = server_command(
        "Qwen/Qwen3-32B", "teacher", "cuda", "0.0.0.0", 8001, ["--tensor-parallel-size", "8"]
    )
    assert command == [
        *(PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-32B", "--host", "0.0.0.0", "--port", "8001"),
        *("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--tensor-parallel-size", "8"),
    ]
    assert env == {}


@pytest.mark.parametrize("role, device", [("student", "cpu"), ("rollouts", "tpu")])
def test_an_unknown_role_or_device_is_refused(role, device):
    with pytest.raises(ValueError, match=f"Unknown .*'{role if role == 'student' else device}'"):
        server_command(PAIR["student"], role, device, "127.0.0.1", 8000)


# ----------------------------------------------------------------------------------------------------------------------
# The command: what it prints and runs
# ----------------------------------------------------------------------------------------------------------------------


def pretend_vllm(monkeypatch, installed):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (object() if installed else None) if name == "vllm" else find_spec(name, *args),
    )


@pytest.fixture
def executed(monkeypatch):
    """What `tvopd-trl vllm-serve` replaces itself with, `{"command": argv, "env": environment}`, with vLLM taken as
    installed, no GPU and no KV-cache size in the environment."""
    ran = {}

    def execve(path, argv, env):
        assert path == argv[0]
        ran.update(command=argv, env=env)

    pretend_vllm(monkeypatch, installed=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(os, "execve", execve)
    return ran


def test_the_command_prints_the_url_and_runs_the_role_s_server(executed, capsys):
    argv = ["vllm-serve", "--role", "teacher", "--model", PAIR["teacher"], "--port", "8401", "--max-model-len", "48"]
    assert cli.main(argv) is None  # it replaced itself with the server
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"Serving {PAIR['teacher']} (teacher, cpu) at http://127.0.0.1:8401: train with "
        "`--teacher_model_server_url http://127.0.0.1:8401` (the trainer waits for the server to come up)."
    )
    command, env = server_command(PAIR["teacher"], "teacher", "cpu", "127.0.0.1", 8401, ["--max-model-len", "48"])
    assert executed["command"] == command and command[-2:] == ["--max-model-len", "48"]
    assert {name: executed["env"][name] for name in env} == env and "VLLM_SERVER_DEV_MODE" not in executed["env"]
    assert out[1] == shlex.join(["VLLM_CPU_KVCACHE_SPACE=1", *command])  # the same command, to copy


def test_a_cuda_server_listens_on_every_interface_by_default(executed, capsys, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "trainer-node")
    # TRL asks vLLM's version for a flag of its own; `executed` only pretends that vLLM is installed
    monkeypatch.setattr("trl.scripts.vllm_serve.is_vllm_available", lambda min_version=None: False)
    assert cli.main(["vllm-serve", "--role", "rollouts", "--model", PAIR["student"], "--device", "cuda"]) is None
    assert "train with `--vllm_server_base_url http://trainer-node:8000`" in capsys.readouterr().out
    assert executed["command"] == server_command(PAIR["student"], "rollouts", "cuda", "0.0.0.0", 8000)[0]
    assert executed["env"]["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--role", "rollouts", "--model", "no/such/../folder"],
            "--model 'no/such/../folder' is neither a model folder",
        ),
        (["--role", "student", "--model", "x"], "argument --role: invalid choice: 'student'"),
        (["--model", "x"], "the following arguments are required: --role"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(executed, capsys, argv, message):
    assert_one_line_error(capsys, argv, message)
    assert executed == {}


def test_without_vllm_the_error_names_the_extra(executed, capsys, monkeypatch):
    pretend_vllm(monkeypatch, installed=False)
    assert_one_line_error(capsys, ["--role", "rollouts", "--model", PAIR["student"]], "install the `vllm` extra")
    assert executed == {}


def assert_one_line_error(capsys, argv, message):
    try:
        status = cli.main(["vllm-serve", *argv])
    except SystemExit as exit:  # argparse's errors exit from inside the parser
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("tvopd-trl vllm-serve: error: ") and message in err and len(err.splitlines()) == 1, err


# ----------------------------------------------------------------------------------------------------------------------
# The README's two-line vLLM main job
# ----------------------------------------------------------------------------------------------------------------------


def readme_vllm_main_job():
    """The two lines after README's `<!-- vllm-main-commands` marker, split as a shell splits them."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("\n<!-- vllm-main-commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    serve, train = (shlex.split(line, comments=True) for line in block.strip().splitlines())
    assert serve[:2] == ["tvopd-trl", "vllm-serve"] and serve[-1] == "&" and train[:2] == ["tvopd-trl", "train"]
    return serve[1:-1], train[1:]


def test_the_readme_serves_the_recipe_s_student_at_the_recipe_s_url(executed, capsys, monkeypatch):
    serve, train = readme_vllm_main_job()
    monkeypatch.chdir(ROOT)  # the README's paths are a checkout's
    assert cli.main(serve) is None
    with open(train[train.index("--config") + 1], encoding="utf-8") as f:
        recipe = yaml.safe_load(f)
    assert (recipe["use_vllm"], recipe["vllm_mode"], recipe["embedded_task"]) == (True, "server", "addition_vllm")
    assert f"train with `--vllm_server_base_url {recipe['vllm_server_base_url']}`" in capsys.readouterr().out
    command = executed["command"]
    assert os.path.samefile(command[command.index("--model") + 1], PAIR["student"])  # the task's student
    assert executed["env"]["VLLM_SERVER_DEV_MODE"] == "1"


class ServedByTheCommand(LocalVLLMServer):
    """`tvopd-trl vllm-serve ARGV --port PORT` on a free port, run from the checkout (the README's paths are relative)
    in its own process group, its output in `log_dir`: waited for and stopped as a `LocalVLLMServer`."""

    def __init__(self, argv, log_dir):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"vllm-serve-{self.port}.log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [PYTHON, "-m", "tvopd_trl.cli", *argv, "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )

    def first_line(self):
        with open(self.log_path) as log:
            return log.readline()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The README's rollout server and a teacher server (with a vLLM flag passed through), started at once:
    `{role: ServedByTheCommand}`."""
    log_dir = tmp_path_factory.mktemp("vllm-serve")
    serve, _ = readme_vllm_main_job()
    teacher = ["vllm-serve", "--role", "teacher", "--model", PAIR["teacher"], "--max-model-len", "48"]
    started = {"rollouts": ServedByTheCommand(serve, log_dir), "teacher": ServedByTheCommand(teacher, log_dir)}
    try:
        yield {role: server.wait_ready(time_limit(600)) for role, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def routes(server):
    return requests.get(f"{server.url}/openapi.json", timeout=time_limit(30)).json()["paths"]


def checked_sequence(tokenizer):
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Compute 12 + 34."}])
    return list(prompt) + tokenizer("\\boxed{46}<|im_end|>")["input_ids"], len(prompt)


@vllm_test
def test_the_readme_s_vllm_main_job_loads_the_student_s_weights_into_the_server(served, tmp_path):
    server = served["rollouts"]
    assert f"train with `--vllm_server_base_url {server.url}`" in server.first_line()
    assert "/collective_rpc" in routes(server)
    _, train = readme_vllm_main_job()
    # The README's job, shortened: 2 steps at a learning rate that moves the weights visibly, without evaluation
    overrides = ["--vllm_server_base_url", server.url, "--output_dir", str(tmp_path), "--max_steps", "2"]
    overrides += ["--learning_rate", "1e-2", "--per_device_train_batch_size", "16", "--logging_steps", "1"]
    overrides += ["--eval_problems", "0", "--eval_every_steps", "0"]
    result = subprocess.run(
        [PYTHON, "-m", "tvopd_trl.cli", *train, *overrides],
        capture_output=True,
        text=True,
        timeout=time_limit(900),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "log_history.json") as f:
        steps = [entry for entry in json.load(f) if "sampling/sampling_logp_difference/mean" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    # Step 2 sampled after step 1's weights were loaded into the server: its sampler agrees with the trainer's pi_old
    # (nats apart at this learning rate, had the server kept the student it started with)
    assert all(entry["sampling/sampling_logp_difference/mean"] < 1e-3 for entry in steps)
    tokenizer = AutoTokenizer.from_pretrained(PAIR["student"])
    sequence, prompt_length = checked_sequence(tokenizer)
    initial = AutoModelForCausalLM.from_pretrained(PAIR["student"], dtype=torch.float32)
    moved = server_logps(server.url, sequence, prompt_length) - local_logps(initial, sequence, prompt_length)
    assert moved.abs().max() > 0.1


@vllm_test
def test_a_teacher_server_scores_like_the_teacher_without_development_endpoints(served):
    server = served["teacher"]
    assert f"train with `--teacher_model_server_url {server.url}`" in server.first_line()
    assert "/collective_rpc" not in routes(server)
    models = requests.get(f"{server.url}/v1/models", timeout=time_limit(30)).json()["data"]
    assert [model["max_model_len"] for model in models] == [48]  # the vLLM flag passed through
    tokenizer = AutoTokenizer.from_pretrained(PAIR["teacher"])
    sequence, prompt_length = checked_sequence(tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(PAIR["teacher"], dtype=torch.float32)
    on_server = server_logps(server.url, sequence, prompt_length)
    assert (on_server - local_logps(teacher, sequence, prompt_length)).abs().max() < LOGP_TOLERANCE
