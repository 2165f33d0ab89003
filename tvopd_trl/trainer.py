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

import contextlib
import math
import textwrap

import torch
from transformers import PreTrainedTokenizerBase, TrainerCallback
from transformers.utils import logging
from trl import DistillationTrainer
from trl.trainer import add_fused_lm_head
from trl.trainer.utils import pad

from .advantages import ADVANTAGE_MODE_REGISTRY, advantages_from_delta, run_sign_tolerance
from .async_rollouts import AsyncRolloutMixin, bound_request_time
from .callbacks import LearningRateScaleCallback, TVScheduleCallback, UpdateNormCallback
from .checkpoints import RolloutCheckpointMixin
from .checks import (
    check_inputs,
    check_loaded_trainer,
    check_paths,
    check_reward_setup,
    check_teacher_pools,
    load_tokenizer,
    wait_for_server,
)
from .config import TVOPDConfig
from .delta import TokenDelta
from .metrics import StepStatistics, log_tv_estimate
from .model_card import add_run_section
from .rewards import RewardScoringMixin, resolve_reward_funcs
from .rollout_batching import RolloutBatchingMixin
from .scoring import CompletionScoringMixin, self_scored_teacher_logps
from .sequence_parallel import SequenceParallelMixin
from .served_teacher import connect_teacher_pool
from .spans import align_teacher_logps, broadcast_spans, span_sums
from .teacher_prompts import has_teacher_prompts, teacher_prompt_batch
from .teachers import Teacher, local_teachers_of, self_teacher, teacher_index, teacher_processing_classes
from .tokenizers import check_shared_vocabulary, restrict_sampling_to_tokenizer
from .tools import ToolLoopMixin
from .tv import tv_sums_by_scale


logger = logging.get_logger(__name__)


def nan_if_none(value):
    return float("nan") if value is None else value


class _OptimizerStepHooks(TrainerCallback):
    """Runs the trainer's post-update bookkeeping right after `optimizer.step()`, before any `on_step_end`, logging or
    checkpoint, so that all of them see the scheduler state of the finished step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._finish_optimizer_step()


class TVOPDTrainer(
    RolloutBatchingMixin,
    CompletionScoringMixin,
    RewardScoringMixin,
    ToolLoopMixin,
    AsyncRolloutMixin,
    RolloutCheckpointMixin,
    SequenceParallelMixin,
    DistillationTrainer,
):
    """
    Trainer for TV-Regulated On-Policy Distillation (TV-OPD) and the sampled-token OPD baselines it is compared with.

    The student samples completions; each sampled token y_t gets the log-ratio delta_t = log pi_T(y_t) - log
    pi_old(y_t) against the teacher, and the student is updated with the PPO-clipped policy-gradient loss
    -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t), averaged over the optimizer step's active tokens. The
    detached coefficient A_t is set by `args.advantage_mode` (see [`~tvopd_trl.advantages.compute_advantages`]); with
    `"tv"` it is c_k * sign(delta_t), where c_k is set by the TV-EMA scheduler from the pooled on-policy TV estimate
    [1 - exp(delta_t)]_+. Only the sampled token's log-probability is needed from either model, so unlike
    [`~trl.DistillationTrainer`] no full-vocabulary divergence is computed.

    Example:

    ```python
    >>> from tvopd_trl import TVOPDConfig, TVOPDTrainer

    >>> trainer = TVOPDTrainer(
    ...     model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    ...     teacher_model="hbx/JustRL-DeepSeek-1.5B",
    ...     args=TVOPDConfig(output_dir="tvopd", advantage_mode="tv"),
    ...     train_dataset=dataset,
    ... )
    >>> trainer.train()
    ```

    Args:
        model, teacher_model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers,
        quantization_config, peft_config, tools:
            As in [`~trl.DistillationTrainer`]. `args` must be a [`TVOPDConfig`]. Vision-language processors are
            refused: the method is text-only.
        reward_funcs (`Callable`, `str` or `list`, *optional*):
            Task rewards beside the teacher, as [`~trl.GRPOTrainer`] takes them: callables with its signature, or
            names in `tvopd_trl.rewards.REWARD_FUNCS`. Defaults to `args.reward_funcs`. Weighted into the advantage by
            `args.reward_coef` (docs/method.md, section 9).
        teacher_processing_class ([`~transformers.PreTrainedTokenizerBase`] or `dict`, *optional*):
            The teacher's tokenizer, compared with the student's at construction. With several teachers, one
            tokenizer is every teacher's (teachers of one family share theirs), and a mapping by name gives each its
            own. When `None` (or a teacher the mapping leaves out), it is loaded from the teacher's local directory if
            there is one; otherwise only `vocab_size` can be compared (a warning says so).

    Several teachers are a mapping `{name: model or path}` in `teacher_model` (and `{name: URL}` in
    `args.teacher_model_server_url`), each prompt routed by its `teacher_id` (docs/multi-teacher.md).

    With `args.teacher_model_server_url`, the teacher is a vLLM server instead: pass no `teacher_model`, and each
    sampled token's teacher log-probability comes from one prefill request per rollout batch.

    Under DeepSpeed, `parallelism_config.sp_size > 1` splits loss-phase rows over processes (docs/scaling.md, 10).
    """

    _tag_names = ["trl", "distillation", "on-policy-distillation", "tv-opd"]
    _name = "TV-OPD"
    _paper = {
        "title": "TV-Regulated OPD: Direction Matters in On-Policy Distillation",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @misc{xiao2026tvopd,
                title        = {{TV-Regulated OPD: Direction Matters in On-Policy Distillation}},
                author       = {Han Xiao and Yifan Niu and Dongyi Liu and Chang Luo and Jia Li},
                year         = 2026,
                note         = {Preprint},
            }"""),
    }

    def __init__(
        self,
        model,
        teacher_model=None,
        args: TVOPDConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        teacher_processing_class: PreTrainedTokenizerBase | None = None,
        reward_funcs=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = TVOPDConfig(f"{name.split('/')[-1]}-TVOPD")
        if not isinstance(args, TVOPDConfig):
            raise TypeError(f"`args` must be a TVOPDConfig, got {type(args).__name__}.")
        teacher_model = self_teacher(args, model, teacher_model)  # `self_distillation`: the student's own weights
        local_teachers, served_teachers = check_inputs(
            args, train_dataset, processing_class, tools, teacher_model, eval_dataset
        )
        reward_funcs, reward_func_names = resolve_reward_funcs(
            args.reward_funcs if reward_funcs is None else reward_funcs
        )
        check_reward_setup(args, reward_funcs)
        # Servers are checked before any model loads, so that an unreachable one fails at once.
        if args.use_vllm and args.vllm_mode == "server":
            url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            wait_for_server(url, args.vllm_server_timeout, "the rollout server (vllm_server_base_url)")
        pools = {
            name: connect_teacher_pool(
                urls,
                args.teacher_model_server_timeout,
                f"the teacher server {name!r}",
                chunk_rows=args.teacher_model_server_chunk_rows,
                max_in_flight=args.teacher_model_server_max_in_flight,
                request_timeout=args.teacher_model_server_request_timeout,
                retries=args.teacher_model_server_retries,
            )
            for name, urls in served_teachers.items()
        }
        check_teacher_pools(args, pools)
        check_paths(model, local_teachers)
        teacher_tokenizers = teacher_processing_classes(teacher_processing_class, [*local_teachers, *served_teachers])
        # name -> whether the teacher shares the student's vocabulary, checked once: each check reads both vocabularies
        shared_vocabulary = {}
        for name, source in local_teachers.items():
            tokenizer = teacher_tokenizers[name]
            if tokenizer is None and isinstance(source, str):
                tokenizer = teacher_tokenizers[name] = load_tokenizer(source, args.trust_remote_code)
            if tokenizer is not None and isinstance(processing_class, PreTrainedTokenizerBase):  # before models load
                shared_vocabulary[name] = check_shared_vocabulary(processing_class, tokenizer, args.cross_tokenizer)

        # The teachers are loaded afterwards (`local_teachers_of`), without the base trainer's output-size check
        if args.use_vllm:
            from .vllm_weight_sync import cpu_weight_sync

            building = cpu_weight_sync(args.vllm_server_weights_dir)
        else:
            building = contextlib.nullcontext()
        with building:
            super().__init__(
                model=model,
                teacher_model=None,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
            )
        self.dataset_name = None  # the prompts' dataset id, for the model card (the main job sets it)
        self.student_quantization_config = quantization_config  # a frozen self-teacher loads as the student did
        # name -> Teacher, in the order `teacher_id` indexes (see `tvopd_trl.teachers`)
        self.teachers = local_teachers_of(self, local_teachers, teacher_tokenizers)
        if self.teachers and not next(iter(self.teachers.values())).live:
            self.teacher_model = next(iter(self.teachers.values())).model  # the base trainer's name for the first one
        self.teachers.update({name: Teacher(name, client=pool) for name, pool in pools.items()})
        self.per_teacher_scale = len(self.teachers) > 1 and args.tv_scale_per_teacher is not False
        self.reward_funcs, self.reward_func_names = reward_funcs, reward_func_names
        self.reward_weights = torch.tensor(args.reward_weights or [1.0] * len(reward_funcs))
        restrict_sampling_to_tokenizer(self)
        # |delta| at or below it is a tie in the sign-based modes (`args.sign_tolerance`)
        self.sign_tolerance = run_sign_tolerance(args, self.accelerator.unwrap_model(self.model))
        # name -> TokenizerAlignment of each teacher with another tokenizer (`cross_tokenizer`)
        self.alignments = check_loaded_trainer(self, teacher_tokenizers, shared_vocabulary)

        # TRL's head (sharded models, `lm_head_precision="float32"` on a GPU): float32 logits without (B, T, V) of them,
        # so that sign(delta) is never decided by bf16 rounding of the logits (`chunked_logprob` otherwise).
        student = self.accelerator.unwrap_model(self.model)
        add_fused_lm_head(
            student.get_base_model() if hasattr(student, "get_base_model") else student,
            temperature=self.temperature,
            cast_lm_head_to_fp32=True,
            outputs=("log_probs", "entropy"),
        )

        # First in line, so that every other callback's `on_optimizer_step` sees the finished step.
        self.callback_handler.callbacks.insert(0, _OptimizerStepHooks(self))
        if args.log_update_norm:
            self.add_callback(UpdateNormCallback(self))
        if args.tv_scale_target == "learning_rate":
            self.add_callback(LearningRateScaleCallback(self))
        self.add_callback(
            TVScheduleCallback(
                alpha=args.tv_alpha,
                ema_decay=args.tv_ema_decay,
                min_scale=args.tv_min_scale,
                eps=args.tv_eps,
                teacher_states=dict.fromkeys(self.teachers) if self.per_teacher_scale else None,
                reference_min_tokens=args.tv_reference_min_tokens,
            )
        )

        if self.use_vllm:
            # Keep the sampler's log-probability of each sampled token (see `_generate_single_turn`)
            self.vllm_generation.logprobs = 0
            if args.vllm_mode == "server" and self.accelerator.is_main_process:
                bound_request_time(self.vllm_generation.vllm_client, args.vllm_server_request_timeout)
        self._truncated_prompts = 0
        # Per-rollout and per-step accumulators (see `compute_loss` and `_finish_optimizer_step`)
        # The c_k of each scale (one per teacher, or one), read at the first step of a rollout batch and held for it
        # (`LearningRateScaleCallback` reads it too)
        self.rollout_scales = [1.0] * (len(self.teachers) if self.per_teacher_scale else 1)
        # Per scale: (U, N, sum of the exact TV) of the rollout's first pass
        self._rollout_tv = torch.zeros(len(self.rollout_scales), 3, device=self.accelerator.device)
        self._rollout_grad_norm_finite = True
        self._step_statistics = StepStatistics()
        self._step_grad_norm = None

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, with a section on the TV-OPD run: mode and hyperparameters, teacher, dataset, and the
        last `tv/scale`, `tv/estimate` and evaluation scores. `dataset_name` defaults to `self.dataset_name`."""
        dataset_name = dataset_name or self.dataset_name
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            add_run_section(self, dataset_name)

    @property
    def _tv_schedule(self):
        # Looked up on every use: resuming rebuilds the callback from the checkpoint (a new instance).
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, TVScheduleCallback):
                return callback
        raise RuntimeError("The TVScheduleCallback was removed from the trainer; TV-OPD cannot run without it.")

    @property
    def _tv_scheduler(self):
        """The pooled scheduler (the one in use unless each teacher has its own)."""
        return self._tv_schedule.scheduler

    @property
    def _tv_schedulers(self):
        """The schedulers in use, in the order of `rollout_scales`: one per teacher, or the pooled one."""
        schedulers = self._tv_schedule.teacher_schedulers
        if bool(schedulers) != self.per_teacher_scale:  # a resume that changed `tv_scale_per_teacher`
            held = "a TV scheduler per teacher" if schedulers else "one pooled TV scheduler"
            raise ValueError(
                f"The checkpoint holds {held}, but this run sets tv_scale_per_teacher={self.per_teacher_scale}: "
                f"resume with tv_scale_per_teacher={bool(schedulers)}, or start a fresh run."
            )
        if not self.per_teacher_scale:
            return [self._tv_scheduler]
        if set(schedulers) != set(self.teachers):
            raise ValueError(
                f"The checkpoint holds TV schedulers for teachers {sorted(schedulers)}, but this run's teachers are "
                f"{sorted(self.teachers)}: resume with the same teachers."
            )
        return [schedulers[name] for name in self.teachers]

    @property
    def rollout_scale(self) -> float:
        """The c_k of the rollout batch being trained on (`LearningRateScaleCallback` reads it); with a scale per
        teacher, see `rollout_scales`."""
        if self.per_teacher_scale:
            raise AttributeError("Each teacher has its own scale: read `rollout_scales`.")
        return self.rollout_scales[0]

    @rollout_scale.setter
    def rollout_scale(self, value):
        self.rollout_scales = [float(value)] * len(self.rollout_scales)

    def _scale_index(self, batch):
        """The `(B,)` index of each row's scale in `rollout_scales`: its teacher's, or the one pooled scale."""
        rows = batch["completion_ids"].size(0)
        if self.per_teacher_scale:
            return batch["teacher_index"]
        return torch.zeros(rows, dtype=torch.long, device=batch["completion_ids"].device)

    # ----------------------------------------------------------------------------------------------------------------
    # Rollouts and their per-token signals
    # ----------------------------------------------------------------------------------------------------------------

    def _tokenize_prompts(self, prompts):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        prompt_ids, self._truncated_prompts = self._truncate_prompts(prompt_ids)
        return prompt_ids, images, multimodal_fields

    def _truncate_prompts(self, prompt_ids):
        """`prompt_ids` cut to `max_prompt_length` on the left, and how many were cut. A prompt of no token is refused:
        nothing of its own would predict its completion's first token."""
        if not all(len(ids) for ids in prompt_ids):
            raise ValueError(
                "A prompt tokenized to no token at all (an empty plain-text prompt, with a tokenizer that adds no BOS "
                "token). Drop empty prompts from the dataset, or give them a chat template."
            )
        limit = self.args.max_prompt_length
        if limit is None:
            return prompt_ids, 0
        return [list(ids[-limit:]) for ids in prompt_ids], sum(len(ids) > limit for ids in prompt_ids)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        if not self.use_vllm:
            with self._whole_rows():
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        if self._taken_rollout is not None:  # this step's rollout batch, sampled ahead
            completion_ids, logprobs = self._taken_completions(prompt_ids)
        else:
            # The base path discards vLLM's log-probabilities; keep the sampled token's for the importance correction.
            # With asynchronous rollouts, the sync after each optimizer step has already loaded the weights, under the
            # producer's lock; in a callback's `on_optimizer_step`, `global_step` does not count that step yet.
            if self._rollout_stream is None and self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            with self._rollout_lock():
                if self.tools:
                    completion_ids, logprobs = self._sample_tool_turn(prompt_ids)
                else:
                    _, completion_ids, logprobs, _ = self.vllm_generation.generate(
                        prompts=prompt_ids, images=images, num_generations=1
                    )
        self._sampler_turns.append([[token[0] for token in sequence] for sequence in logprobs])
        return completion_ids

    def _generate_and_score_completions(self, inputs):
        # With several optimizer steps per rollout, pi_old must be frozen before the first update; otherwise the loss
        # pass's own detached log-probabilities are pi_old, and that extra forward is skipped.
        freeze_old_logps = (
            self.model.training and self._micro_steps_per_rollout > self.args.gradient_accumulation_steps
        )
        batch = self.generate_completions(inputs)
        if self.reward_funcs and self.model.training:
            batch["reward_advantages"] = self.reward_advantages(inputs, batch)
        sharded = self._shards_sequences(self.model)  # pi_old is then scored on the SP group's gathered rows
        batch = self.score_completions(
            batch, old_logps=freeze_old_logps and not sharded, exact_divergences=self._needs_exact_divergences
        )
        if sharded:
            batch = self._sequence_parallel.gather(batch)
            if freeze_old_logps:
                self.add_old_logps(batch)
        return batch

    def generate_completions(self, prompts):
        """Completions of `prompts` (dataset rows with a `prompt`, and a `teacher_id` with several teachers) sampled by
        the student as a rollout samples them, as TRL's generation returns them (with `sampler_logps` under vLLM, and
        `teacher_index` with several teachers), not scored yet: see [`~TVOPDTrainer.score_completions`]."""
        output = super()._generate_and_score_completions(prompts)
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        truncated = torch.tensor(self._truncated_prompts, device=device, dtype=torch.float32)
        self._metrics[mode]["prompts/truncated"].append(self.accelerator.reduce(truncated, reduction="sum").item())
        if len(self.teachers) > 1:
            output["teacher_index"] = teacher_index(prompts, list(self.teachers), device)
        if self.alignments or has_teacher_prompts(prompts):
            routing = output.get("teacher_index", torch.zeros(len(prompts), dtype=torch.long)).tolist()
            names = [list(self.teachers)[index] for index in routing]
            output.update(teacher_prompt_batch(self, prompts, names, output["prompt_ids"], output["prompt_mask"]))
        if self.use_vllm:
            # A log-probability the sampler failed to give (TRL's `extract_logprobs` turns NaN into None) is missing:
            # NaN here, and the loss drops the token.
            sampler_logps = [
                torch.tensor([math.nan if value is None else value for value in logps], dtype=torch.float32)
                for logps in self._sampler_logps
            ]
            sampler_logps = pad(sampler_logps, padding_value=0.0, padding_side="right").to(device)
            width = output["completion_ids"].size(1)  # completions may be padded to `pad_to_multiple_of`
            output["sampler_logps"] = torch.nn.functional.pad(sampler_logps, (0, width - sampler_logps.size(1)))
        return output

    def generate_and_score(self, prompts):
        """[`~TVOPDTrainer.generate_completions`] with `teacher_logps` and `loss_mask` (see
        [`~TVOPDTrainer.score_completions`]), as a rollout batch has them."""
        return self._generate_and_score_completions(prompts)

    def record_metric(self, name, value, mode="train"):
        """Adds `value` to the metrics of the step being logged, averaged over the logging window like the trainer's
        own (`BenchmarkEvalCallback` records its scores this way)."""
        self._metrics[mode][name].append(float(value))

    @property
    def _needs_exact_divergences(self):
        return ADVANTAGE_MODE_REGISTRY[self.args.advantage_mode].needs_exact_divergence or self.args.log_exact_tv

    # ----------------------------------------------------------------------------------------------------------------
    # The loss
    # ----------------------------------------------------------------------------------------------------------------

    def _shuffle_generator(self):
        # Seeded by (seed, process, rollout, micro-batch): each pass over a rollout sees the same permutation.
        rollout_index = self.state.global_step // (self.args.steps_per_generation * self.args.num_iterations)
        micro_index = self._step % self._micro_batches_per_rollout
        replica = self.accelerator.process_index // self._sp_size  # an SP group shuffles its rows alike
        seed = hash((self.args.seed, replica, rollout_index, micro_index)) % (2**63)
        return torch.Generator().manual_seed(seed)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        mode = "train" if self.model.training else "eval"
        if "teacher_logps" not in inputs:
            # Called the way TRL's trainers are (custom loops, TRL's tests): a generated batch, scored here
            inputs = self.score_completions(dict(inputs), exact_divergences=self._needs_exact_divergences)
        # Inside `train()` every micro-batch of a rollout batch carries its optimizer step's token count. Any other call
        # (evaluation, a custom loop) is one standalone batch: logged at once, never fed to the scheduler.
        in_rollout = mode == "train" and "step_num_items" in inputs
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)

        logps, entropy = self._sampled_token_logps(model, input_ids, attention_mask, logits_to_keep, with_entropy=True)
        old_logps = inputs.get("old_logps")
        span_ids = inputs.get("span_ids")  # a teacher with another tokenizer: the loss runs on its spans
        if old_logps is None:
            old_logps = logps.detach()
            if span_ids is not None:
                inputs = {**inputs, "teacher_logps": align_teacher_logps(inputs["teacher_logps"], old_logps, span_ids)}
        if "self_scored" in inputs:  # the live self-teacher after the student's prompt is pi_old: pi_old's scores
            inputs = {**inputs, "teacher_logps": self_scored_teacher_logps(inputs, old_logps)}
        rollout_delta = TokenDelta.of_batch(inputs, old_logps)  # once per micro-batch
        delta = rollout_delta.where(torch.isfinite(logps).detach())  # the loss's tokens
        active = delta.active

        schedulers = self._tv_schedulers
        if in_rollout and self._step % self._micro_steps_per_rollout == 0:
            self.rollout_scales = [s.scale for s in schedulers]  # c_k: read once, held for the whole rollout batch
        scales = self.rollout_scales if in_rollout else [s.scale for s in schedulers]
        scale_index = self._scale_index(inputs)
        scale = torch.tensor(scales, device=active.device)[scale_index].unsqueeze(1)
        spec = ADVANTAGE_MODE_REGISTRY[args.advantage_mode]
        advantages = advantages_from_delta(
            args.advantage_mode,
            delta,
            teacher_logps=inputs["teacher_logps"],
            old_logps=old_logps,
            scale=scale if args.tv_scale_target == "advantage" else 1.0,
            reverse_kl=inputs.get("reverse_kl"),
            generator=self._shuffle_generator() if "generator" in spec.inputs else None,
            sign_tolerance=self.sign_tolerance,
            **spec.config_kwargs(args),
        )
        if args.distillation_coef != 1.0:
            advantages = args.distillation_coef * advantages
        reward_term = None
        if "reward_advantages" in inputs:
            # The reward advantage is the sequence's, on each of its tokens; c_k and the TV estimate never see it.
            reward_term = torch.where(active, args.reward_coef * inputs["reward_advantages"].unsqueeze(1), 0.0)
            distill_term = advantages
            if args.reward_coef:
                advantages = advantages + reward_term

        # Inactive tokens get ratio 1 from constants, so a non-finite log-probability there cannot reach a gradient.
        ratio = torch.exp(torch.where(active, logps, 0.0) - torch.where(active, old_logps, 0.0))
        clipped_ratio = ratio.clamp(1 - args.epsilon, 1 + args.epsilon_high)
        per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        sampled_by_vllm = "sampler_logps" in inputs
        importance_weights = None
        if sampled_by_vllm:
            log_gap = torch.where(active, old_logps - inputs["sampler_logps"], 0.0)
            if args.vllm_importance_sampling_correction:
                importance_weights = log_gap.exp().clamp(max=args.vllm_importance_sampling_cap)
                per_token_loss = per_token_loss * importance_weights
        # A span's X is weighted by the span's ratio, the product of its tokens'
        tv_weights = importance_weights
        if span_ids is not None and importance_weights is not None:
            span_gap = broadcast_spans(span_sums(log_gap, span_ids), span_ids)
            tv_weights = span_gap.exp().clamp(max=args.vllm_importance_sampling_cap)
        per_token_loss = torch.where(active, per_token_loss, 0.0)

        if in_rollout:
            # Data-parallel replicas average their gradients, so each divides by its share of the step's global token
            # count (under SP, each process of a replica sums whole rows, of which only its shard has a gradient).
            normalizer = inputs["step_num_items"].clamp(min=1) / self._data_parallel_size
        elif num_items_in_batch is not None:
            normalizer = torch.as_tensor(num_items_in_batch, device=per_token_loss.device).clamp(min=1)
        else:
            normalizer = active.sum().clamp(min=1)
        loss = per_token_loss.sum() / normalizer
        if (scale := self._gradient_scale()) != 1:
            loss = loss * scale - (loss * (scale - 1)).detach()  # the same value, `scale` times the gradient

        with torch.no_grad():
            routing = inputs.get("teacher_index")
            statistics = self._step_statistics if in_rollout else StepStatistics()
            counted = self._counts_rows(model)
            statistics.add(
                counted=counted,
                active=active,
                delta=delta.delta,
                ratio=ratio,
                advantages=advantages,
                loss_mask=inputs["loss_mask"],
                per_token_loss=per_token_loss,
                entropy=entropy,
                epsilon=(args.epsilon, args.epsilon_high),
                sign_tolerance=self.sign_tolerance if spec.sign_based else None,
                log_gap=log_gap if sampled_by_vllm else None,
                teachers=None if routing is None else {name: routing == k for k, name in enumerate(self.teachers)},
                terms=None if reward_term is None else (distill_term, reward_term),
            )
            # Under vLLM the tokens were drawn by the sampler: X_t weighted by the loss's truncated ratio pi_old /
            # pi_vllm estimates the TV under pi_old again (docs/method.md). The estimate is of the rollout policy, so
            # it reads the rollout's tokens, whatever the current student gives them.
            first_pass = (self._step // self._micro_batches_per_rollout) % args.num_iterations == 0
            if not in_rollout or first_pass:
                scales_count = len(self.rollout_scales)
                tv = tv_sums_by_scale(
                    rollout_delta, scale_index, scales_count, tv_weights, inputs.get("exact_tv", 0.0)
                )
                tv = tv * counted
            if in_rollout and first_pass:
                self._rollout_tv += tv
            elif not in_rollout:
                statistics.log(self.accelerator, self._metrics[mode], dispersion=False)
                u, n = self.accelerator.reduce(tv.sum(dim=0)[:2], reduction="sum").tolist()
                log_tv_estimate(self._metrics[mode], u, n)

        return (loss, None) if return_outputs else loss

    # ----------------------------------------------------------------------------------------------------------------
    # Around the optimizer step: skip non-finite gradients, then update the scheduler and log
    # ----------------------------------------------------------------------------------------------------------------

    def _get_grad_norm(self, model, grad_norm=None):
        # Called by `Trainer` right before `optimizer.step()`, with the pre-clip norm (computed here when
        # `max_grad_norm` is 0). DeepSpeed has stepped already and skips non-finite steps itself (fp16 overflow).
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._step_grad_norm = None if grad_norm is None else float(grad_norm)
        if self._step_grad_norm is not None and not math.isfinite(self._step_grad_norm):
            self._rollout_grad_norm_finite = False
            if not self.is_deepspeed_enabled:
                # Torch optimizers skip parameters without a gradient: no update, no moment or weight-decay change.
                model.zero_grad(set_to_none=True)
        return grad_norm

    def _finish_optimizer_step(self):
        metrics = self._metrics["train"]
        step_nonfinite = self._step_grad_norm is not None and not math.isfinite(self._step_grad_norm)
        skipped = self.accelerator.optimizer_step_was_skipped or (not self.is_deepspeed_enabled and step_nonfinite)
        metrics["update/skipped"].append(float(skipped))
        if self._rollout_stream is not None:
            self._sync_rollout_weights()
        for index, scale in enumerate(self.rollout_scales):
            metrics[self._scale_metric("tv/scale", index)].append(scale)

        self._step_statistics.log(self.accelerator, metrics)
        self._step_statistics = StepStatistics()

        if self._step % self._micro_steps_per_rollout == 0:
            self._finish_rollout()
        for index, scheduler in enumerate(self._tv_schedulers):
            if self.per_teacher_scale and scheduler.reference is None:
                continue  # a teacher still pooling tokens for its reference (`tv_reference_min_tokens`)
            metrics[self._scale_metric("tv/ema", index)].append(nan_if_none(scheduler.ema))
            metrics[self._scale_metric("tv/reference", index)].append(nan_if_none(scheduler.reference))

    def _scale_metric(self, metric, index):
        # "tv/scale" of the one pooled scale, or "tv/<teacher>/scale" of each teacher's
        return metric.replace("tv/", f"tv/{list(self.teachers)[index]}/") if self.per_teacher_scale else metric

    def _finish_rollout(self):
        metrics = self._metrics["train"]
        totals = self.accelerator.reduce(self._rollout_tv, reduction="sum")
        grad_norm = None if self._rollout_grad_norm_finite else float("nan")
        frozen = [
            not scheduler.update(u, n, grad_norm=grad_norm)
            for scheduler, (u, n, _) in zip(self._tv_schedulers, totals.tolist(), strict=True)
        ]
        metrics["tv/frozen"].append(float(all(frozen)))
        u, n, exact = totals.sum(dim=0).tolist()
        if n == 0:
            logger.warning(
                f"Step {self.state.global_step + 1}: the rollout batch has no active token (every completion is empty, "
                "masked or non-finite). The loss is 0 and the TV scheduler keeps its state."
            )
        log_tv_estimate(metrics, u, n)
        if self._needs_exact_divergences:
            metrics["tv/exact"].append(exact / n if n > 0 else float("nan"))
        if self.per_teacher_scale:
            for index, (u, n, _) in enumerate(totals.tolist()):
                metrics[self._scale_metric("tv/estimate", index)].append(u / n if n > 0 else float("nan"))
        self._rollout_tv, self._rollout_grad_norm_finite = torch.zeros_like(self._rollout_tv), True
