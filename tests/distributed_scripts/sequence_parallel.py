"""Ulysses sequence parallelism against a run without it, on the same rollouts.

    accelerate launch --config_file recipes/accelerate_configs/zero3_sp_cpu.yaml sequence_parallel.py OUT tv
    python sequence_parallel.py OUT tv        # the reference: one process, no SP, the same global batch
    python sequence_parallel.py --references RUNS.json   # references one after another: [[OUT, mode, *options], ...]

The first argument after the output folder is the advantage mode; options follow as `name=value` (`reward=1`,
`tools=1`, `evaluate=1` (after training), `teacher=cross|two|three-heads|served|hinted|self` (`self` with `hints=half|none`: every other row or no row
hinted; `served` with `url=`: a vLLM server of the vLLM-ready pair's teacher, whose
student then trains), `checkpointing=1`, `steps=3`, `rows=8`). Completions are drawn from a generator seeded by the prompt and the sample's place in
its group, so that a process that samples half of the rollout gets exactly the reference's half; they are long enough
(16-32 tokens) for the shard boundary to fall inside them. With `tools=1`, tokens 6-12 of every completion are a tool
result (out of the loss, across the boundary in most rows). The rollout is not shuffled, so that the rows come in the
same order. The optimizer is plain SGD without clipping: each step's parameter change is -lr times the step's
gradient. Each rank saves the parameters after every step, the per-token tensors of every loss call (every process of
an SP group holds whole rows) and the log.
"""

import json
import os
import sys

import torch
from accelerate.utils import DistributedType
from common import check_launch, finish, save_rank_result, skip_deepspeed_shm_op
from transformers import AutoTokenizer, TrainerCallback

import tvopd_trl.rollout_batching
import tvopd_trl.sequence_parallel
from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import (
    cross_tokenizer_paths,
    hint_student_path,
    prompt_dataset,
    teacher_path,
    vllm_paths,
    weak_teacher_path,
)
from tvopd_trl.tiny.hint_task import prompt_dataset as hint_prompt_dataset


LEARNING_RATE = 0.1
RECORDED = (
    "prompt_mask",
    "completion_mask",
    "teacher_logps",
    "loss_mask",
    "reward_advantages",
    "span_ids",
    "tool_mask",
    "reverse_kl",
    "old_logps",
    "teacher_index",
    "self_scored",
    "step_num_items",
)


def token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def three_head_teacher():
    """A teacher of the student's vocabulary with 3 attention heads, from a fixed seed."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    vocabulary = AutoConfig.from_pretrained(teacher_path()).vocab_size
    config = Qwen2Config(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        vocab_size=vocabulary,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def full_parameters(trainer):
    """Every parameter, whole, on every rank (gathered from ZeRO-3's shards: a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    model = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
    module = getattr(model, "module", model)
    sharded = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    return {
        name: (safe_get_full_fp32_param(p) if sharded else p).detach().float().cpu().clone()
        for name, p in module.named_parameters()
    }


class RecordParameters(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(full_parameters(self.trainer))

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(full_parameters(self.trainer))


class RecordingTrainer(TVOPDTrainer):
    calls = []
    tools_stand_in = False

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        completions, seen = [], {}
        for ids in prompt_ids:
            seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
            generator = torch.Generator().manual_seed(hash((tuple(ids), seen[tuple(ids)])) % 2**31)
            length = torch.randint(16, self.args.max_completion_length + 1, (1,), generator=generator).item()
            vocabulary = len(self.processing_class)
            completions.append(torch.randint(3, vocabulary, (length,), generator=generator).tolist())
        return completions

    def generate_completions(self, prompts):
        batch = super().generate_completions(prompts)
        if self.tools_stand_in:
            batch["tool_mask"] = torch.ones_like(batch["completion_mask"])
            batch["tool_mask"][:, 5:12] = 0
        return batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        record = {key: inputs[key].detach().cpu().clone() for key in RECORDED if key in inputs}
        original = self._sampled_token_logps

        def recorded(*args, **kwargs):
            logps, entropy = original(*args, **kwargs)
            record["logps"], record["entropy"] = logps.detach().cpu().clone(), entropy.cpu().clone()
            return logps, entropy

        self._sampled_token_logps = recorded
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            del self._sampled_token_logps
        record["loss"] = loss.detach().cpu().clone()
        record["scales"] = torch.tensor(self.rollout_scales)
        if self.model.training:  # evaluation's rows are each process's own
            self.calls.append(record)
        return loss


def main(output_dir, mode, *options):
    options = dict(option.split("=", 1) for option in options)
    RecordingTrainer.calls = []
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # The rollout as generated, in process order: both runs see the same rows in the same order
    tvopd_trl.rollout_batching.shuffle_sequence_dict = tvopd_trl.sequence_parallel.shuffle_sequence_dict = dict
    overrides = dict(
        per_device_train_batch_size=int(options.get("rows", 8)),
        max_steps=int(options.get("steps", 3)),
        advantage_mode=mode,
        max_completion_length=32,
        optim="sgd",
        learning_rate=LEARNING_RATE,
        max_grad_norm=0.0,
        use_cpu=not launched,
        logging_steps=1,
    )
    kwargs = {}
    if options.get("reward"):
        overrides.update(reward_coef=0.5, num_generations=2)
        kwargs["reward_funcs"] = [token_sum]
    if options.get("checkpointing"):
        overrides["gradient_checkpointing"] = True
    if options.get("teacher") == "two":  # each prompt routed by its `teacher_id`, a TV scale per teacher
        # Not the student itself: its delta is 0 up to rounding, whose sign a split forward may flip
        kwargs["teacher_model"] = {"teacher": teacher_path(), "weak": weak_teacher_path()}
        kwargs["train_dataset"] = prompt_dataset("opd", 32).add_column("teacher_id", ["teacher", "weak"] * 16)
    if options.get("teacher") == "three-heads":  # heads that sp_size does not divide: it scores whole rows
        kwargs["teacher_model"] = three_head_teacher()
    if options.get("teacher") == "served":  # scores whole rows on the server, before the SP group gathers them
        pair = vllm_paths()
        overrides["teacher_model_server_url"] = options["url"]
        tokenizer = AutoTokenizer.from_pretrained(pair["student"], padding_side="left")
        kwargs.update(model=pair["student"], teacher_model=None, processing_class=tokenizer)
        kwargs["teacher_processing_class"] = tokenizer
    if options.get("teacher") in ("hinted", "self"):  # every row's teacher prompt shows the answer (`hint_task`)
        kwargs["train_dataset"] = hint_prompt_dataset("opd", 32)
        overrides["max_completion_length"] = 20  # the 42-token hinted prompts leave 22 of the 64 positions
    if options.get("teacher") == "self":  # the hint student, its own teacher with the hint, its current weights
        overrides["self_distillation"] = "live"
        kwargs.update(model=hint_student_path(), teacher_model=None)
        hints = kwargs["train_dataset"]["teacher_prompt"]
        if options.get("hints") == "half":  # every other row after the student's own prompt: delta exactly 0 there
            kwargs["train_dataset"] = (
                kwargs["train_dataset"]
                .remove_columns("teacher_prompt")
                .add_column("teacher_prompt", [hint if index % 2 == 0 else None for index, hint in enumerate(hints)])
            )
        if options.get("hints") == "none":  # no teacher prompt at all: nothing to learn, no gradient
            kwargs["train_dataset"] = kwargs["train_dataset"].remove_columns("teacher_prompt")
    if options.get("teacher") == "cross":
        overrides["cross_tokenizer"] = True
        kwargs["teacher_model"] = cross_tokenizer_paths()["triplets"]
    if launched:
        skip_deepspeed_shm_op()
    RecordingTrainer.tools_stand_in = bool(options.get("tools"))
    args = tiny_config(output_dir, **overrides)
    kwargs["eval_dataset"] = prompt_dataset("opd", 8)
    if options.get("teacher") == "two":
        kwargs["eval_dataset"] = kwargs["eval_dataset"].add_column("teacher_id", ["teacher", "weak"] * 4)
    trainer = tiny_pair_trainer(args, prompts=32, trainer_class=RecordingTrainer, **kwargs)
    if launched:
        check_launch(trainer.accelerator, DistributedType.DEEPSPEED, int(os.environ["WORLD_SIZE"]))
    parameters = RecordParameters(trainer)
    trainer.add_callback(parameters)
    trainer.train()
    tensors = {"parameters": parameters.steps, "calls": trainer.calls}
    # Evaluation after training: whole rows on each process (SP is off in eval mode), then a sharded forward in eval mode
    evaluation = trainer.evaluate() if options.get("evaluate") else None
    refusal = None
    if options.get("evaluate") and trainer._sp_size > 1:
        trainer.model_wrapped.eval()
        try:
            trainer._sharded_logps(
                trainer.model_wrapped,
                torch.ones(args.per_device_train_batch_size, 8, dtype=torch.long),
                torch.ones(args.per_device_train_batch_size, 8, dtype=torch.long),
                4,
                False,
            )
        except RuntimeError as error:
            refusal = str(error)
    zero = trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None
    result = {
        "sp_size": trainer._sp_size,
        "zero_stage": zero,
        "evaluation": evaluation,
        "eval_mode_refusal": refusal,
        "log": [entry for entry in trainer.state.log_history if "loss" in entry],
    }
    if not launched:
        save_rank_result(output_dir, trainer.accelerator, result, tensors)
        return
    save_rank_result(output_dir, trainer.accelerator, result, tensors)
    finish(output_dir, trainer.accelerator)


if __name__ == "__main__":
    if sys.argv[1] == "--references":
        with open(sys.argv[2]) as f:
            for run in json.load(f):
                main(*run)
    else:
        main(*sys.argv[1:])
