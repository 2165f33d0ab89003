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
"""vLLM rollouts from a trainer without CUDA. TRL's weight sync pushes the student's weights to a server through vLLM's
NCCL weight-transfer engine, which needs a CUDA device, and into a colocated engine parameter by parameter through
`load_weights`, which vLLM's CPU model runner does not support once it has repacked its layers. Both go through vLLM's
in-place `reload_weights` here instead.

On a CUDA trainer nothing here changes TRL's path."""

import atexit
import contextlib
import functools
import os
import shutil
import tempfile

import trl.trainer.distillation_trainer as distillation_trainer
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration


class CPUWeightSyncGeneration(VLLMGeneration):
    """
    TRL's `VLLMGeneration`, whose weight sync on a trainer without CUDA is vLLM's in-place `reload_weights`.

    After each optimizer step, [`~CPUWeightSyncGeneration.sync_weights`] gathers the student's parameters as TRL
    gathers them (ZeRO-3, FSDP, PEFT) and
    - in server mode, writes them as one safetensors file into `weights_dir`, asks the server to reload them (through
      its development endpoint `POST /collective_rpc`) and resets its prefix cache. The server must run with
      `VLLM_SERVER_DEV_MODE=1` and read `weights_dir`: the trainer's own disk for a server on the same machine, a
      shared file system otherwise;
    - in colocate mode, hands them to the process's own engine, in memory.
    Generation itself is TRL's.

    Args:
        weights_dir (`str`, *optional*):
            Server mode's folder; by default a temporary one, removed at exit.
        *args, **kwargs:
            TRL's `VLLMGeneration` arguments.
    """

    def __init__(self, *args, weights_dir=None, **kwargs):
        self.weights_dir = weights_dir
        super().__init__(*args, **kwargs)

    @property
    def _reloads_in_place(self):
        return self.accelerator.device.type != "cuda"

    def _init_vllm(self):
        if self.mode != "server" or not self._reloads_in_place:
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
            routes = self.vllm_client.session.get(f"{base_url}/openapi.json", timeout=30).json()["paths"]
            if "/collective_rpc" not in routes:
                raise RuntimeError(
                    f"The vLLM server at {base_url} does not serve `/collective_rpc`, through which a trainer without "
                    "CUDA loads the student's weights into it: restart it with VLLM_SERVER_DEV_MODE=1 in its "
                    "environment (docs/vllm.md)."
                )
            if self.weights_dir is None:
                self.weights_dir = tempfile.mkdtemp(prefix="tvopd-vllm-weights-")
                atexit.register(shutil.rmtree, self.weights_dir, ignore_errors=True)
            os.makedirs(self.weights_dir, exist_ok=True)
        self.accelerator.wait_for_everyone()

    def sync_weights(self):
        if not self._reloads_in_place:
            return super().sync_weights()
        # Every process walks the parameters: under ZeRO-3 and FSDP each gather is a collective. In server mode only
        # the main process talks to the server; in colocate mode each process has its own engine.
        keep = self.mode == "colocate" or self.accelerator.is_main_process
        state = {name: param.detach().to("cpu", copy=True) for name, param in self._iter_named_params() if keep}
        if not keep:
            return
        # vLLM's in-place reload leaves a tied LM head out unless the weights name it, and then serves the old head
        # with the new body
        for alias, source in self._tied_names():
            if source in state:
                state[alias] = state[source].clone()
        if self.mode == "colocate":
            model_runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
            model_runner.reload_weights(weights_iterator=iter(state.items()))
            self.llm.reset_prefix_cache()
            return
        from safetensors.torch import save_file

        path = os.path.join(self.weights_dir, "model.safetensors")
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, f"{path}.partial")
        os.replace(f"{path}.partial", path)  # the server never reads a half-written file
        response = self.vllm_client.session.post(
            f"{self.vllm_client.base_url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}},
            timeout=self.server_timeout,
        )
        response.raise_for_status()
        self.vllm_client.reset_prefix_cache()

    def _tied_names(self):
        """`(alias, name)` of each output-embedding name that shares its tensor with an earlier parameter's name."""
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = model.get_output_embeddings()
        if head is None:
            return []
        names = [name for name, param in model.named_parameters(remove_duplicate=False) if param is head.weight]
        return [(alias, names[0]) for alias in names[1:]]


@contextlib.contextmanager
def cpu_weight_sync(weights_dir=None):
    """While TRL's `DistillationTrainer.__init__` runs inside it, the `VLLMGeneration` it builds is a
    [`CPUWeightSyncGeneration`] (server mode writing into `weights_dir`): TRL builds its generation inline, with no
    hook."""
    original = distillation_trainer.VLLMGeneration
    distillation_trainer.VLLMGeneration = functools.partial(CPUWeightSyncGeneration, weights_dir=weights_dir)
    try:
        yield
    finally:
        distillation_trainer.VLLMGeneration = original
