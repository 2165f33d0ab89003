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

On every trainer, CUDA included, a LoRA student's adapters are merged out of place for the sync
([`CPUWeightSyncGeneration._iter_named_params`]): TRL merges them into the frozen base weights and unmerges them, in
place. That is the only change to TRL's path on a CUDA trainer."""

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import threading
import warnings

import trl.trainer.distillation_trainer as distillation_trainer
from accelerate.utils import is_peft_model
from peft.tuners import lora
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.tensor import DTensor
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration


class CPUWeightSyncGeneration(VLLMGeneration):
    """
    TRL's `VLLMGeneration`, whose weight sync on a trainer without CUDA is vLLM's in-place `reload_weights`.

    After each optimizer step, [`~CPUWeightSyncGeneration.sync_weights`] gathers the student's parameters as TRL
    gathers them (ZeRO-3, FSDP), with a LoRA student's adapters merged out of place, and
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

    def _iter_named_params(self):
        """
        TRL's `_iter_named_params` (the student's parameters, gathered one by one or, with PEFT under ZeRO-3, all at
        once, under the names vLLM expects), except that a LoRA student's adapters are merged out of place: each LoRA
        layer's weight is a new tensor, the base weight plus PEFT's `get_delta_weight` of each active adapter, added as
        PEFT's `merge` adds it, and the model is never written.

        TRL merges the adapters into the base weights and unmerges them, in place: in bf16 that rounds the frozen base
        weights twice per sync, and they drift sync after sync (docs/troubleshooting.md); an exception while the
        weights are read (a broken connection) leaves the adapters merged. TRL's own `sync_weights`, which a CUDA
        trainer runs, iterates this method too.

        Adapters whose merge is more than a sum (DoRA, LoRA biases, other PEFT methods) and FSDP1 (whose parameters
        TRL summons module by module) keep TRL's in-place merge, with a warning.
        """
        model = self.model
        if not is_peft_model(model):
            yield from super()._iter_named_params()
            return
        lora_layers = None if self._dist.fsdp_version == 1 else _plain_lora_layers(model)
        if lora_layers is None:
            warnings.warn(
                "This PEFT student's adapters are merged into its base weights and unmerged at every weight sync, "
                "in place (TRL's path): in bf16 its frozen base weights drift a little with each sync. Only LoRA "
                "without DoRA or a LoRA bias, outside FSDP1, is merged out of place (docs/troubleshooting.md).",
                stacklevel=2,
            )
            yield from super()._iter_named_params()
            return
        # As TRL gathers them: under ZeRO-3 the whole model at once, since a LoRA layer's weights are read together;
        # a no-op otherwise (FSDP2's parameters are DTensors, made whole one by one below)
        with self._dist.gather_params(list(model.parameters())):
            for name, param in model.named_parameters():
                # TRL's names: PEFT's layers are not in vLLM, nor the frozen originals of `modules_to_save`
                vllm_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                if model.prefix in vllm_name or "original_module" in vllm_name:
                    continue
                tensor = self._whole(param.data)
                if name in lora_layers:
                    tensor = _merged_weight(lora_layers[name], tensor, self._whole)
                yield self._fix_param_name_to_vllm(vllm_name, extra_prefixes=["modules_to_save.default."]), tensor

    def _whole(self, tensor):
        """`tensor`, or the whole tensor of an FSDP2 shard, as TRL's `_iter_fsdp2_params` makes it."""
        if not isinstance(tensor, DTensor):
            return tensor
        return tensor.to(self.accelerator.device).full_tensor()

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
        base_url = self.vllm_client.base_url
        # No timeout of its own: the trainer bounds every request to the rollout server by vllm_server_request_timeout
        # (`bound_request_time`), which its error names. `server_timeout` (vllm_server_timeout) is TRL's wait for the
        # server to start.
        response = self.vllm_client.session.post(
            f"{base_url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}},
        )
        if response.status_code == 404:  # it served it at construction: it was restarted since
            raise RuntimeError(
                f"The vLLM server at {base_url} no longer serves `/collective_rpc` (HTTP 404), through which a "
                "trainer without CUDA loads the student's weights into it: it was restarted without "
                "VLLM_SERVER_DEV_MODE=1. Restart it with VLLM_SERVER_DEV_MODE=1 in its environment and resume the run "
                "from its last checkpoint (`--resume_from_checkpoint last`; docs/vllm.md)."
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
        # Under vLLM's names: a LoRA layer's base weight is its weight
        names = [
            name.replace(".base_layer", "")
            for name, param in model.named_parameters(remove_duplicate=False)
            if param is head.weight
        ]
        return [(alias, names[0]) for alias in names[1:]]


def _plain_lora_layers(model):
    """`{name of a base weight: its LoRA layer}` when PEFT merges each adapter layer of the PEFT model `model` as its
    base weight plus `get_delta_weight` (LoRA on linear and embedding layers, without DoRA or a LoRA bias); `None`
    otherwise."""
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        plain = type(module) in (lora.Linear, lora.Embedding) and not getattr(module, "lora_variant", None)
        if not plain or any(module.lora_bias.values()):
            return None
        layers[f"{name}.base_layer.weight"] = module
    return layers


def _merged_weight(layer, weight, whole):
    """A new tensor: `weight`, the base weight of the LoRA layer `layer`, with its active adapters that are not merged
    yet added as PEFT's `merge` adds them. `whole` makes a delta whole as `weight` is."""
    merged = weight.clone()
    for adapter in layer.active_adapters:
        if adapter in layer.merged_adapters or not (adapter in layer.lora_A or adapter in layer.lora_embedding_A):
            continue
        delta = whole(layer.get_delta_weight(adapter))
        # PEFT adds a linear layer's delta in the delta's dtype (float32 adapters on a bf16 model: one rounding), an
        # embedding's cast to the weight's dtype first
        merged += delta.to(merged.dtype) if isinstance(layer, lora.Embedding) else delta
    return merged


# Held through each construction inside `cpu_weight_sync`: two that overlapped (two threads) restored TRL's class in
# the wrong order and left it swapped for good. Reentrant, for a trainer built inside another's construction.
_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def cpu_weight_sync(weights_dir=None):
    """While TRL's `DistillationTrainer.__init__` runs inside it, the `VLLMGeneration` it builds is a
    [`CPUWeightSyncGeneration`] (server mode writing into `weights_dir`).

    TRL builds its generation inline in `__init__`, with no hook for another class, so the module attribute it reads
    is swapped meanwhile. The swap is visible to the whole process: it is made under a lock, so that trainers built in
    several threads at once are built one after the other and each restores TRL's class. A plain TRL trainer built in
    another thread during such a construction would still get ours."""
    with _SWAP_LOCK:
        original = distillation_trainer.VLLMGeneration
        distillation_trainer.VLLMGeneration = functools.partial(CPUWeightSyncGeneration, weights_dir=weights_dir)
        try:
            yield
        finally:
            distillation_trainer.VLLMGeneration = original
