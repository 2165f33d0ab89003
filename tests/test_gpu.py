"""Checks that need a CUDA device: bf16 autocast, TRL's Triton fused log-prob head, and DeepSpeed ZeRO-3 on one GPU.
Skipped on CPU-only machines."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from tvopd_trl import tiny
from tvopd_trl.testing import tiny_config

from .timeouts import time_limit


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_bf16_training_keeps_float32_log_probs(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, bf16=True, use_cpu=False, max_steps=3, log_exact_tv=True))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert inputs["teacher_logps"].is_cuda and inputs["teacher_logps"].dtype == torch.float32
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)
    # The on-policy estimate tracks the exact TV it estimates (both computed in float32 on device).
    assert all(abs(entry["tv/estimate"] - entry["tv/exact"]) < 0.1 for entry in logs)


def test_bf16_autocast_generation_keeps_the_teacher_accurate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tvopd_trl.eval import SamplingSettings, TransformersGenerator, evaluate, mean_at_k

    tokenizer = AutoTokenizer.from_pretrained(tiny.teacher_path())
    teacher = AutoModelForCausalLM.from_pretrained(tiny.teacher_path()).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # bf16 matmuls reach `generate`: the logits of one forward come out in bf16 under autocast.
        probe = tokenizer("Compute 12 + 34.", return_tensors="pt").to("cuda")
        assert teacher(**probe).logits.dtype == torch.bfloat16
        results = evaluate(
            TransformersGenerator(teacher, tokenizer, batch_size=512),
            ["tiny"],
            SamplingSettings(k=4, max_new_tokens=16),
            limit=200,
        )
    # The teacher scores 100% mean@4 in float32 on CPU; bf16 rounding may cost a few samples, not the skill.
    assert mean_at_k(results["benchmarks"]["tiny"]) >= 0.95


class _LaunchCounter:
    """Stands in for a Triton kernel: counts its launches (`kernel[grid](...)`) and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _torch_fallback(*args, **kwargs):
    raise AssertionError("TRL's torch fallback ran instead of its Triton kernel")


def test_fused_lm_head_runs_trls_triton_kernels_and_matches_float32_log_softmax(make_trainer, tmp_path, monkeypatch):
    import trl.kernels.chunked_logprob as chunked_logprob

    trainer = make_trainer(tiny_config(tmp_path, bf16=True, use_cpu=False, temperature=0.7))
    student = trainer.accelerator.unwrap_model(trainer.model)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))  # real on-policy completions
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits_to_keep = batch["completion_ids"].size(1)
    assert input_ids.is_cuda and chunked_logprob._use_triton(input_ids.device)

    forward_kernel = _LaunchCounter(chunked_logprob._forward_kernel)
    backward_kernel = _LaunchCounter(chunked_logprob._backward_kernel)
    monkeypatch.setattr(chunked_logprob, "_forward_kernel", forward_kernel)
    monkeypatch.setattr(chunked_logprob, "_backward_kernel", backward_kernel)
    monkeypatch.setattr(chunked_logprob, "_forward_tile", _torch_fallback)
    monkeypatch.setattr(chunked_logprob, "_backward_tile", _torch_fallback)

    # The fused head: the trainer's own scoring path, the backbone under bf16 autocast, the head in float32.
    captured = []

    def keep_hidden(module, args, output):
        output.last_hidden_state.retain_grad()
        captured.append(output.last_hidden_state)

    handle = student.base_model.register_forward_hook(keep_hidden)
    try:
        logps = trainer._sampled_token_logps(trainer.model, input_ids, attention_mask, logits_to_keep)
    finally:
        handle.remove()
    assert len(captured) == 1 and forward_kernel.launches > 0
    (hidden,) = captured
    labels = input_ids.masked_fill(attention_mask == 0, -100)[:, 1:]
    mask = (labels != -100)[:, -logits_to_keep:] & batch["completion_mask"].bool()
    assert mask.sum() > 0
    head = student.get_output_embeddings()

    def plain_log_probs(hidden_states):
        # The reference head: a float32 projection, `log_softmax` and a gather, with (B, T, V) logits.
        logits = hidden_states[:, :-1].float() @ head.weight.float().T
        if head.bias is not None:
            logits = logits + head.bias.float()
        log_probs = torch.log_softmax(logits / trainer.temperature, dim=-1)
        return log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[:, -logits_to_keep:]

    with torch.no_grad():
        same_hidden_logps = plain_log_probs(hidden.detach())
    logp_max_diff = (logps.detach() - same_hidden_logps)[mask].abs().max().item()

    generator = torch.Generator(device=logps.device).manual_seed(0)
    weights = torch.randn(logps.shape, device=logps.device, generator=generator) * mask
    (logps * weights).sum().backward()
    assert backward_kernel.launches > 0
    fused_grads = {name: p.grad.detach().clone() for name, p in student.named_parameters()}
    fused_hidden_grad = hidden.grad.detach().clone()
    student.zero_grad(set_to_none=True)

    # The gradient reference: the same backbone forward again, the plain head, the same weighted sum.
    with trainer.accelerator.autocast():
        ref_hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    ref_hidden = ref_hidden.last_hidden_state
    ref_hidden.retain_grad()
    ref_logps = plain_log_probs(ref_hidden)
    (ref_logps * weights).sum().backward()

    hidden_max_diff = (hidden.detach() - ref_hidden.detach()).abs().max().item()
    hidden_grad_rel = ((fused_hidden_grad - ref_hidden.grad).norm() / ref_hidden.grad.norm()).item()
    param_grad_rel = {
        name: ((fused_grads[name] - p.grad).norm() / p.grad.norm().clamp(min=1e-30)).item()
        for name, p in student.named_parameters()
    }
    print(
        json.dumps(
            {
                "forward_kernel_launches": forward_kernel.launches,
                "backward_kernel_launches": backward_kernel.launches,
                "hidden_dtype": str(hidden.dtype),
                "head_weight_dtype": str(head.weight.dtype),
                "scored_tokens": int(mask.sum()),
                "logp_max_abs_diff": logp_max_diff,
                "logp_range": [same_hidden_logps[mask].min().item(), same_hidden_logps[mask].max().item()],
                "rerun_hidden_max_abs_diff": hidden_max_diff,
                "hidden_grad_rel_err": hidden_grad_rel,
                "param_grad_rel_err": param_grad_rel,
            }
        )
    )
    assert logp_max_diff < 1e-4
    assert torch.isfinite(fused_hidden_grad).all() and hidden_grad_rel < 1e-4
    assert all(p.grad.norm() > 0 for p in student.parameters())  # every parameter has a gradient to compare
    assert max(param_grad_rel.values()) < 1e-3, param_grad_rel
    assert hidden_max_diff < 1e-5  # the backbone is deterministic: both heads saw the same hidden states


# A standard ZeRO-3 DeepSpeed config, "auto" values filled by the Trainer, except the persistence threshold: below it a
# parameter is never released. DeepSpeed's default, 1e5 elements, covers every tensor of the tiny models, and TRL's
# `prepare_deepspeed` does not fill an "auto" one for the teacher; 640 (10 x hidden size, what "auto" gives the student)
# keeps only norms and biases whole.
_DEEPSPEED_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": 640,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

# With `deepspeed_config_file`, accelerate refuses `mixed_precision` and the ZeRO keys here: the JSON sets them.
_ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: {deepspeed_config_file}
  zero3_init_flag: true
distributed_type: DEEPSPEED
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""

_ZERO3_SCRIPT = """\
import json
import os
import sys
import time

from accelerate.utils import DistributedType
from transformers import AutoTokenizer

from tvopd_trl import TVOPDConfig, TVOPDTrainer, tiny

output_dir, result_path = sys.argv[1], sys.argv[2]
args = TVOPDConfig(
    output_dir=output_dir,
    bf16=True,
    use_cpu=False,
    per_device_train_batch_size=8,
    max_steps=3,
    max_completion_length=8,
    learning_rate=1e-3,
    log_exact_tv=True,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    seed=0,
    disable_tqdm=True,
    dataloader_num_workers=0,
)
tokenizer = AutoTokenizer.from_pretrained(tiny.student_path(), padding_side="left")
trainer = TVOPDTrainer(
    model=tiny.student_path(),
    teacher_model=tiny.teacher_path(),
    args=args,
    train_dataset=tiny.prompt_dataset("opd", 32),
    processing_class=tokenizer,
)
assert trainer.accelerator.distributed_type == DistributedType.DEEPSPEED, trainer.accelerator.distributed_type
assert trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
assert trainer.accelerator.num_processes == 1
start = time.perf_counter()
trainer.train()
train_seconds = time.perf_counter() - start


def partition(model):
    params = list(model.parameters())
    released = [p for p in params if p.numel() == 0]
    return {
        "params": len(params),
        "zero3_params": sum(hasattr(p, "ds_tensor") for p in params),
        "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in params),
        "released": len(released),
        "ds_numel": sum(getattr(p, "ds_numel", 0) for p in params),
        "released_ds_numel": sum(p.ds_numel for p in released),
        "local_numel": sum(p.numel() for p in params),  # what is held in full now: the persistent parameters
        "partition_numel": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
        "dtype": str(params[0].dtype),
    }


result = {
    "distributed_type": str(trainer.accelerator.distributed_type),
    "plugin_zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
    "engine": type(trainer.model_wrapped).__name__,
    "engine_zero_stage": trainer.model_wrapped.zero_optimization_stage(),
    "teacher_engine": type(trainer.teacher_model).__name__,
    "num_processes": trainer.accelerator.num_processes,
    "persistence_threshold": trainer.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].get(
        "stage3_param_persistence_threshold"
    ),
    "steps": trainer.state.global_step,
    "s_per_step": train_seconds / max(trainer.state.global_step, 1),
    "student": partition(trainer.accelerator.unwrap_model(trainer.model)),
    "teacher": partition(trainer.accelerator.unwrap_model(trainer.teacher_model)),
    "logs": [entry for entry in trainer.state.log_history if "tv/scale" in entry],
}
trainer.save_model(output_dir)
with open(result_path, "w") as f:
    json.dump(result, f)
print(json.dumps({key: value for key, value in result.items() if key != "logs"}), flush=True)
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_gpu_deepspeed_zero3_trains_partitions_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    deepspeed_config, config, script = tmp_path / "zero3.json", tmp_path / "zero3.yaml", tmp_path / "zero3_run.py"
    deepspeed_config.write_text(json.dumps(_DEEPSPEED_ZERO3))
    config.write_text(_ACCELERATE_CONFIG.format(deepspeed_config_file=deepspeed_config))
    script.write_text(_ZERO3_SCRIPT)
    output_dir, result_path = tmp_path / "out", tmp_path / "result.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(_free_port()), str(script), str(output_dir), str(result_path)]
    process = subprocess.run(
        command, capture_output=True, text=True, timeout=time_limit(240), env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert process.returncode == 0 and result_path.exists(), process.stderr[-6000:]
    result = json.loads(result_path.read_text())
    print(json.dumps(result, indent=1))

    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["num_processes"] == 1
    assert result["plugin_zero_stage"] == 3 and result["engine_zero_stage"] == 3
    assert result["engine"] == "DeepSpeedEngine" and result["teacher_engine"] == "DeepSpeedEngine"
    for name in ("student", "teacher"):
        partition = result[name]
        # Every parameter is a ZeRO-3 one, its shard (here, with one process, all of it) in `ds_tensor`; outside a
        # forward only those under the persistence threshold (norms, biases) are held in full, the rest is released.
        assert partition["zero3_params"] == partition["params"] > 0, (name, partition)
        assert partition["released"] + partition["persistent"] == partition["params"], (name, partition)
        assert partition["released_ds_numel"] > 0.9 * partition["ds_numel"], (name, partition)
        assert partition["partition_numel"] >= partition["ds_numel"], (name, partition)

    logs = result["logs"]
    assert result["steps"] == 3 and len(logs) == 3
    for entry in logs:
        assert all(
            math.isfinite(entry[key]) for key in ("loss", "tv/scale", "tv/estimate", "tv/exact", "update/norm")
        ), entry
        assert entry["update/skipped"] == 0.0 and entry["update/norm"] > 0, entry

    reloaded, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert sum(p.numel() for p in reloaded.parameters()) == result["student"]["ds_numel"]
    original = AutoModelForCausalLM.from_pretrained(tiny.student_path())
    new = torch.cat([p.detach().float().flatten() for p in reloaded.parameters()])
    old = torch.cat([p.detach().float().flatten() for p in original.parameters()])
    assert torch.isfinite(new).all()
    # Trained: most weights differ from the shipped student's, rounded to the saved (16-bit) dtype as DeepSpeed did.
    changed = (new != old.to(reloaded.dtype).float()).float().mean().item()
    print(json.dumps({"reloaded_dtype": str(reloaded.dtype), "changed_fraction": changed}))
    assert changed > 0.25
