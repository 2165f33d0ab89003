"""Precision as the paper runs: bf16 module weights with float32 master weights held by the engine.

The GPU recipes (recipes/justrl-1.5b_to_ds-distill-qwen-1.5b, recipes/qwen3-8b_to_qwen3-8b-sft) load the student
without a dtype (TRL loads it in float32), set `bf16: true`, `optim: adamw_torch_fused` and launch under
`accelerate_configs/zero3.yaml` (`mixed_precision: bf16`). A real 2-process DeepSpeed ZeRO-3 run of that on CPU
(tests/distributed_scripts/zero3_bf16.py, launched as tests/test_distributed.py launches, on the recipes' own
zero3.yaml) shows what that is: DeepSpeed's `bf16` partitions the float32 load in bf16, computes in bf16 without
autocast, and keeps float32 master weights and float32 AdamW moments in its ZeRO-3 optimizer, which steps the
Trainer's fused AdamW on them. FSDP2 (`accelerate_configs/fsdp2.yaml`) turns on only with GPUs; on the CPU stand-in
of tests/test_fsdp.py (tests/distributed_scripts/fsdp2_bf16.py) it keeps float32 sharded parameters as the master
weights, gathers them in bf16 to compute, and autocasts too. Without an engine (one process), `bf16: true` is autocast
over float32 weights, and a student loaded in bf16 has no float32 master weights at all (docs/scaling.md, "Precision
as the paper runs").
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tvopd_trl import tiny
from tvopd_trl.testing import tiny_config, tiny_pair_trainer

from .test_distributed import NUM_PROCESSES, POOLED, launch


# The engines' own precision handling (DeepSpeed's, accelerate's FSDP2): not in the compatibility legs
pytestmark = pytest.mark.compat_skip


@pytest.fixture(scope="module")
def zero3_bf16_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("zero3_bf16")
    results = launch("zero3.yaml", "zero3_bf16.py", output_dir, launch_args=["--num_processes", str(NUM_PROCESSES)])
    return output_dir, results


def test_deepspeed_bf16_holds_bf16_module_weights_and_float32_master_weights(zero3_bf16_run):
    _, results = zero3_bf16_run
    for result in results:
        assert result["engine"] == "DeepSpeedEngine" and result["ds_bf16_enabled"] is True
        assert result["native_amp"] is False  # no autocast: the module itself is bf16
        # TRL's float32 load, partitioned by ZeRO-3's `zero.Init` straight into bf16 shards
        assert result["loaded_shard_dtypes"] == ["torch.bfloat16"]
        assert result["param_dtypes"] == result["shard_dtypes"] == result["module_shard_dtypes"] == ["torch.bfloat16"]
        # The master weights: one float32 element per bf16 element of this rank's shards, and float32 moments
        assert result["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert result["master_dtypes"] == result["moment_dtypes"] == ["torch.float32"]
        assert result["master_numel"] == result["module_numel"] > 0
        # The recipes' `optim: adamw_torch_fused` is the optimizer that ZeRO-3 steps (no `optimizer` section in the
        # DeepSpeed config that accelerate builds, so transformers hands DeepSpeed the Trainer's own)
        assert result["inner_optimizer"] == "AdamW" and all(result["inner_fused"]), result["inner_fused"]
        # DeepSpeed's defaults under bf16 (docs/scaling.md): gradients reduced and accumulated in bf16
        assert result["grad_accum_dtype"] == result["communication_dtype"] == "torch.bfloat16"


def test_the_module_weights_are_the_master_weights_rounded_to_bf16(zero3_bf16_run):
    _, results = zero3_bf16_run
    for result in results:
        assert result["master_equals_module_before"]  # the masters start as the loaded bf16 values
        assert result["module_is_rounded_master"]  # after each step the module gets the masters in bf16
        # The masters keep what bf16 cannot hold: updates below a bf16 step accumulate there. Every master moved;
        # about a tenth of the bf16 weights never did (their updates so far sum to less than half a bf16 step).
        assert result["master_finer_than_bf16"] > 0.99 and result["master_moved"] > 0.99, result
        assert result["module_moved"] < result["master_moved"], result


def test_the_bf16_run_trains_the_student_towards_the_teacher(zero3_bf16_run):
    output_dir, results = zero3_bf16_run
    first, second = (result["logs"] for result in results)
    assert [entry["step"] for entry in first] == list(range(1, 21))
    for a, b in zip(first, second, strict=True):
        assert math.isfinite(a["loss"]) and a["update/skipped"] == 0.0 and a["update/norm"] > 0, a
        assert [a.get(name) for name in POOLED] == [b.get(name) for name in POOLED], a["step"]
    # The saved student (ZeRO-3 gathers its bf16 weights) against the shipped one: the exact reverse KL to the
    # teacher, per completion token, on held-out problems and the teacher's greedy answers, falls.
    trained = AutoModelForCausalLM.from_pretrained(output_dir / "student")
    assert trained.dtype == torch.bfloat16
    shipped = AutoModelForCausalLM.from_pretrained(tiny.student_path())
    teacher = AutoModelForCausalLM.from_pretrained(tiny.teacher_path())
    before, after = (reverse_kl(model.float(), teacher) for model in (shipped, trained))
    assert after < 0.97 * before, (before, after)


def reverse_kl(student, teacher, problems=64, new_tokens=8):
    """Mean KL(student || teacher) over the vocabulary, per completion token of the teacher's greedy answers to the
    first `problems` test problems."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.student_path(), padding_side="left")
    prompts = tiny.prompt_dataset("test", problems)["prompt"]
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = batch["input_ids"].shape[1]
    student.eval(), teacher.eval()
    with torch.no_grad():
        ids = teacher.generate(
            **batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        completion = (ids[:, width:] != tokenizer.pad_token_id).long()
        mask = torch.cat([batch["attention_mask"], completion], dim=1)
        s, t = (
            torch.log_softmax(m(ids, attention_mask=mask).logits[:, width - 1 : -1].float(), -1)
            for m in (student, teacher)
        )
        kl = (s.exp() * (s - t)).sum(-1)
    return ((kl * completion).sum() / completion.sum()).item()


@pytest.fixture(scope="module")
def fsdp2_bf16_run(tmp_path_factory):
    return launch("ddp_cpu.yaml", "fsdp2_bf16.py", tmp_path_factory.mktemp("fsdp2_bf16"))


def test_fsdp2_bf16_keeps_float32_sharded_master_weights_and_computes_in_bf16(fsdp2_bf16_run):
    for result in fsdp2_bf16_run:
        # accelerate's policy for `mixed_precision: bf16`: weights gathered and gradients reduce-scattered in bf16. Up to
        # 1.15 it also cast the outputs to bf16; 1.16 leaves them as computed, which from bf16 weights is bf16 too.
        policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype="
        assert result["policy"].startswith(policy), result["policy"]
        assert result["policy"][len(policy) :].split(",")[0] in ("torch.bfloat16", "None"), result["policy"]
        # The sharded parameters are float32 DTensors: the master weights, stepped by fused AdamW, float32 moments
        assert result["param_dtypes"] == ["torch.float32"] and result["all_dtensor"]
        assert result["optimizer"] == "AdamW" and all(result["fused"]) and result["moment_dtypes"] == ["torch.float32"]
        # A forward multiplies the gathered bf16 weights; the training forward also runs under accelerate's autocast
        assert ["torch.bfloat16", False, True] in result["compute"], result["compute"]
        assert all(dtype == "torch.bfloat16" and not sharded for dtype, sharded, _ in result["compute"])
        assert result["native_amp"] and result["mixed_precision"] == "bf16"
        assert all(math.isfinite(entry["loss"]) for entry in result["logs"]) and len(result["logs"]) == 3


@pytest.mark.filterwarnings("ignore:bf16=True on CPU", "ignore:The student is in torch.bfloat16")
def test_without_an_engine_bf16_is_autocast_over_float32_weights(tmp_path):
    """One process, no engine: `bf16=True` wraps the student's forward in autocast; the weights, and so what the
    optimizer updates, stay float32. A student loaded in bf16 is updated in bf16: no float32 master weights."""
    float32_load = tiny_pair_trainer(tiny_config(tmp_path / "fp32", bf16=True), prompts=4)
    assert float32_load.accelerator.native_amp and float32_load.accelerator.mixed_precision == "bf16"
    assert {p.dtype for p in float32_load.model.parameters()} == {torch.float32}
    bf16_load = tiny_pair_trainer(
        tiny_config(tmp_path / "bf16", bf16=True, model_init_kwargs={"dtype": "bfloat16"}), prompts=4
    )
    bf16_load.create_optimizer()
    optimized = [p for group in bf16_load.optimizer.param_groups for p in group["params"]]
    assert optimized and {p.dtype for p in optimized} == {torch.bfloat16}
