"""The weight sync of `tvopd_trl.vllm_weight_sync` without a vLLM engine: what a LoRA student sends, what the sync
leaves in the student, and the construction-time patch of TRL's trainer module.

The generations here are built without `__init__` (which connects to a server or starts an engine): a sync only needs
the model, the accelerator and TRL's distributed backend. Where the weights go is a recording stand-in: an engine for
our CPU sync, a server client for TRL's (CUDA) sync, which cannot run here.
"""

import copy
import threading
import types

import pytest
import torch
import trl.trainer.distillation_trainer as distillation_trainer
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration

from tvopd_trl.tiny import student_path
from tvopd_trl.vllm_weight_sync import CPUWeightSyncGeneration, cpu_weight_sync

from .test_distributed import NUM_PROCESSES, launch
from .timeouts import time_limit


def lora_student(dtype, **lora):
    """The shipped student under a LoRA adapter with random (trained-like) B matrices, and its norms in
    `modules_to_save`, moved off the base copies. `lora`: `LoraConfig` arguments."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(student_path(), dtype=dtype)
    lora = {"target_modules": ["q_proj", "v_proj", "down_proj"], "modules_to_save": ["norm"], **lora}
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(0.01 * torch.randn_like(param))
    return model


def generation_for(model, mode="colocate"):
    """A `CPUWeightSyncGeneration` of `model`, whose engine (colocate) or server client (server) records what it
    gets."""
    generation = CPUWeightSyncGeneration.__new__(CPUWeightSyncGeneration)
    generation.model, generation.mode = model, mode
    generation.accelerator = Accelerator(cpu=True)
    generation._dist = DistributedBackend(generation.accelerator)
    generation.enable_sleep_mode, generation._weight_metadata = False, None
    generation.sent = []  # one {name: tensor} per sync

    def reload_weights(weights_iterator):
        generation.sent.append({name: tensor.clone() for name, tensor in weights_iterator})

    def update_named_params(metadata, named_params):
        generation.metadata = metadata
        generation.sent.append({name: tensor.clone() for name, tensor in named_params})

    model_runner = types.SimpleNamespace(reload_weights=reload_weights)
    driver_worker = types.SimpleNamespace(model_runner=model_runner)
    generation.llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=driver_worker)),
        reset_prefix_cache=lambda: None,
    )
    generation.vllm_client = types.SimpleNamespace(
        update_named_params=update_named_params, reset_prefix_cache=lambda: None
    )
    return generation


def snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_bit_identical(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    changed = [name for name, tensor in before.items() if not torch.equal(after[name], tensor)]
    assert not changed, changed


def peft_merge(model):
    """What PEFT's own merge gives: `merge_and_unload` of a copy, as the flat state dict vLLM loads."""
    return copy.deepcopy(model).merge_and_unload().state_dict()


def assert_equal_tensors(sent, expected):
    assert sent.keys() == expected.keys()
    different = [name for name, tensor in expected.items() if not torch.equal(sent[name], tensor)]
    assert not different, different


def test_syncs_of_a_bf16_lora_student_leave_its_weights_bit_identical():
    # TRL merged the adapter into the frozen bf16 base weights and unmerged it, two roundings per sync: the base
    # weights random-walked away from the checkpoint (8.9% of a weight's largest entry after 200 syncs).
    model = lora_student(torch.bfloat16)
    generation, before = generation_for(model), snapshot(model)
    for _ in range(20):
        generation.sync_weights()
    assert_bit_identical(model, before)
    assert all(sent.keys() == generation.sent[0].keys() for sent in generation.sent)
    assert_equal_tensors(generation.sent[-1], generation.sent[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "down_proj"], ["embed_tokens", "q_proj"]])
def test_a_sync_sends_peft_s_merge_under_vllm_s_names(dtype, targets):
    # PEFT keeps the adapters in float32 on a bf16 model, and adds a linear layer's delta before rounding, an
    # embedding's after. The embedding is tied to the LM head, which our CPU sync sends under its own name too.
    model = lora_student(dtype, target_modules=targets)
    generation, expected = generation_for(model), peft_merge(model)
    generation.sync_weights()
    assert_equal_tensors(generation.sent[0], expected)


def test_a_dora_student_keeps_trl_s_in_place_merge_with_a_warning():
    model = lora_student(torch.float32, use_dora=True)
    generation, expected = generation_for(model), peft_merge(model)
    with pytest.warns(UserWarning, match="merged into its base weights and unmerged at every weight sync, in place"):
        generation.sync_weights()
    assert_equal_tensors(generation.sent[0], expected)


def test_the_names_and_float32_values_are_those_trl_sends():
    model = lora_student(torch.float32)
    ours = dict(generation_for(model)._iter_named_params())
    trls = {name: tensor.clone() for name, tensor in VLLMGeneration._iter_named_params(generation_for(model))}
    assert list(ours) == list(trls)
    assert_equal_tensors(ours, trls)


def test_trl_s_own_sync_on_cuda_iterates_our_out_of_place_merge():
    # On a CUDA trainer `sync_weights` is TRL's (NCCL to a server): run it here with a recording client.
    model = lora_student(torch.bfloat16)
    generation, before = generation_for(model, mode="server"), snapshot(model)
    for _ in range(3):
        VLLMGeneration.sync_weights(generation)
    assert_bit_identical(model, before)
    merged = {name: tensor for name, tensor in peft_merge(model).items() if name != "lm_head.weight"}  # tied
    for sent in generation.sent:
        assert_equal_tensors(sent, merged)
    assert [name for name, _, _ in generation.metadata] == list(merged)


def test_a_sync_that_fails_midway_leaves_the_adapter_unmerged_and_active():
    model = lora_student(torch.float32)
    generation, before = generation_for(model, mode="server"), snapshot(model)
    inputs = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        output = model(inputs).logits
        with model.disable_adapter():
            assert not torch.equal(model(inputs).logits, output)  # the adapter changes the output

    def update_named_params(metadata, named_params):
        for index, _ in enumerate(named_params):
            if index == 5:
                raise ConnectionError("the server went away")  # what a broken NCCL stream or socket raises

    generation.vllm_client.update_named_params = update_named_params
    with pytest.raises(ConnectionError):
        VLLMGeneration.sync_weights(generation)
    assert_bit_identical(model, before)
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, output)


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=pytest.mark.compat_skip) for name in ("zero3", "fsdp2")]
)
def sharded_run(request, tmp_path_factory):
    config = {"zero3": "zero3_cpu.yaml", "fsdp2": "ddp_cpu.yaml"}[request.param]
    output_dir = tmp_path_factory.mktemp(f"lora_sync_{request.param}")
    return request.param, launch(config, "lora_weight_sync.py", output_dir, request.param)


def test_a_sharded_lora_student_sends_peft_s_merge_and_stays_unchanged(sharded_run):
    # 2 processes, the adapter sharded with the student: the sync gathers as TRL does (ZeRO-3: the whole model at
    # once; FSDP2: each DTensor, the adapters' deltas included), and writes nothing.
    mode, results = sharded_run
    assert len(results) == NUM_PROCESSES
    for result in results:
        assert (result["zero_stage"], result["fsdp_version"]) == {"zero3": (3, None), "fsdp2": (0, 2)}[mode]
        assert result["sharded_lora"] == 12  # A and B of q_proj, v_proj and down_proj in both layers
        assert result["unchanged"]
    main = results[0]
    assert main["not_loaded"] == ["base_model.model.lm_head.weight"]  # tied to the embedding
    sent, merged = main["tensors"]["sent"], main["tensors"]["merged"]
    del merged["lm_head.weight"]  # tied: one tensor, sent once
    assert list(sent) == list(merged)
    assert_equal_tensors(sent, merged)
    assert main["lora_B_max"] > 1e-3  # trained: the merged weights are not the base ones


def test_overlapping_constructions_restore_trl_s_class(monkeypatch):
    # Two trainers built at once in two threads, the review's interleaving: B entered while A was inside, A restored
    # TRL's class, then B restored what it had found on entering, A's patch, for good.
    original = distillation_trainer.VLLMGeneration
    monkeypatch.setattr(distillation_trainer, "VLLMGeneration", original)  # restored for the next tests if it fails
    seen = {}
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()

    def build(name, inside, wait_for, left=None):
        with cpu_weight_sync(f"/weights/{name}"):
            inside.set()
            wait_for.wait(timeout=time_limit(1))  # stands for `DistillationTrainer.__init__`
            seen[name] = distillation_trainer.VLLMGeneration
        if left is not None:
            left.set()

    a = threading.Thread(target=build, args=("A", a_inside, b_inside, a_left))
    b = threading.Thread(target=build, args=("B", b_inside, a_left))
    a.start()
    a_inside.wait()
    b.start()
    a.join()
    b.join()
    assert distillation_trainer.VLLMGeneration is original
    assert seen["A"].func is seen["B"].func is CPUWeightSyncGeneration
    assert (seen["A"].keywords, seen["B"].keywords) == ({"weights_dir": "/weights/A"}, {"weights_dir": "/weights/B"})
