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

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import is_torch_bf16_gpu_available, is_torch_tf32_available
from trl import DistillationConfig

from .advantages import ADVANTAGE_MODE_REGISTRY, ADVANTAGE_MODES
from .tv import validate_tv_hyperparameters


# ClipOPD bounds used when `advantage_mode="clip"` and none are given (see the `advantage_clip_low` docstring).
DEFAULT_CLIP_BOUNDS = (-5.0, 5.0)


@dataclass
class TVOPDConfig(DistillationConfig):
    r"""
    Configuration class for the [`TVOPDTrainer`].

    Extends [`~trl.DistillationConfig`] with the parameters of sampled-token on-policy distillation (OPD) and of
    TV-Regulated OPD (TV-OPD). The inherited `beta` (the generalized-JSD mix of the base trainer) plays no part here.
    Two inherited defaults differ. `bf16` left unset follows the machine: bf16 where transformers accepts it (a
    bf16-capable GPU), float32 elsewhere, instead of TRL's bf16, which transformers refuses on a CPU. `tf32` left unset
    means TF32 matmuls on a GPU that has them. The trainer projects the LM head in float32 (so that bf16 rounding never
    decides sign(delta)), and without TF32 that projection took half of a step on an H200 (docs/performance.md,
    section 8). Set `tf32=False` to keep IEEE float32 matmuls.

    Parameters:
        > Parameters that control the advantage

        advantage_mode (`str`, *optional*, defaults to `"tv"`):
            Per-token coefficient of the PPO-clipped policy-gradient loss, computed from the sampled-token log-ratio
            delta = log pi_T - log pi_old. One of `"raw"` (Raw OPD), `"clip"` (ClipOPD), `"power"` (PowerOPD),
            `"vopd"` (vOPD), `"sign"` (Sign / Sign-TV), `"tv"` (TV-OPD), `"relative_power"` (Power(beta) ablation),
            `"sequence_constant"`, `"shuffle"` and `"sign_mass_raw_alloc"` (magnitude ablations).
        advantage_clip_low (`float`, *optional*):
            Lower ClipOPD bound. When `advantage_mode="clip"` and neither bound is set, the bounds default to
            `(-5.0, 5.0)`: the TV-OPD paper does not state ClipOPD's thresholds, so this is our choice; it clips about
            the top 1% of |delta| in the paper's dispersion snapshot (p99 of 6.47). In every magnitude-based mode, a
            delta of -inf (teacher gives the token no mass) is replaced by this value if set.
        advantage_clip_high (`float`, *optional*):
            Upper ClipOPD bound. See `advantage_clip_low`.
        power_gamma (`float`, *optional*, defaults to `0.5`):
            Box-Cox exponent of PowerOPD, > 0: A = pi_T^gamma - pi_old^gamma. The TV-OPD paper does not state the
            value its PowerOPD baseline used; 0.5 is our choice, halfway between the log-ratio limit (gamma -> 0) and
            the probability difference (gamma = 1).
        relative_power_beta (`float`, *optional*, defaults to `0.4`):
            Exponent of the Power(beta) relative-magnitude ablation, in [0, 1]: 1 recovers Raw OPD and 0 recovers
            Sequence-Constant. 0.4 is the stronger of the two settings the paper reports (Power-0.4 and Power-0.8).
        advantage_kwargs (`dict[str, Any]` or `str`, *optional*):
            Hyperparameters of the advantage mode that have no field of their own (see
            [`~tvopd_trl.advantages.AdvantageMode`]), by keyword, as a dict or a JSON string; unset ones keep the
            mode's defaults. A key the mode does not take is an error. None of the paper's modes needs it.
        sign_tolerance (`float`, *optional*):
            In the sign-based modes (`sign`, `tv`, `relative_power`, `sequence_constant`, `shuffle`,
            `sign_mass_raw_alloc`), a token with |delta| at or below it is a tie, read as delta = 0: no direction,
            advantage 0, however the two forwards rounded it. `None` picks it from the teacher: `0` with a teacher model
            or server (the paper's sign, where only delta = 0 is a tie), and with `self_distillation` a bound on the
            rounding of two forwards of the same weights in the student's compute dtype
            (`tvopd_trl.advantages.SELF_TEACHER_SIGN_TOLERANCE`: 1e-3 nats in float32, 0.1 in fp16, 0.3 in bf16;
            measured in docs/method.md, section 13). The share of active tokens it turns into ties is logged as
            `advantage/tie_fraction`; the TV estimate and the `advantage/*` statistics of |delta| read delta as it is.

        > Parameters that control the TV-EMA scheduler (`advantage_mode="tv"`)

        tv_alpha (`float`, *optional*, defaults to `0.5`):
            Attenuation exponent alpha of c_k = clip(((D_bar + eps) / (D_ref + eps)) ** alpha, tv_min_scale, 1).
            `0` keeps c_k = 1 (Sign-TV). The paper's value.
        tv_ema_decay (`float`, *optional*, defaults to `0.95`):
            EMA retention of the pooled TV estimate. The paper's value.
        tv_min_scale (`float`, *optional*, defaults to `0.1`):
            Floor c_min of the scale. The paper's value.
        tv_eps (`float`, *optional*, defaults to `1e-5`):
            Guard epsilon of the ratio. The paper's value.
        tv_scale_target (`str`, *optional*, defaults to `"advantage"`):
            What c_k scales: `"advantage"` (A = c_k * sign(delta), the paper's) or `"learning_rate"` (A = sign(delta)
            and the step's learning rate is multiplied by c_k). AdamW largely cancels a slowly changing uniform scale
            of the loss, but not of the learning rate. The decoupled weight decay of AdamW-like optimizers keeps its
            unscaled strength lr * weight_decay, as it does with `"advantage"`; an optimizer that adds weight decay to
            the gradient (SGD, Adam) scales it with the step. Not supported under DeepSpeed, whose engine steps the
            optimizer.
        tv_scale_per_teacher (`bool`, *optional*):
            With several teachers, whether each has its own scheduler and scale c_k, fed by the TV estimate pooled over
            its own rows only and frozen on a step where it had none (a row's advantage uses its teacher's c_k), or one
            scheduler pools every row, as with one teacher. Defaults to `True` with several teachers; ignored with
            one. Not supported with `tv_scale_target="learning_rate"`, whose one learning rate cannot carry several
            scales.
        tv_reference_min_tokens (`int`, *optional*, defaults to `1000`):
            With a scale per teacher, the active tokens a teacher's reference D_ref pools at least: its (U, N) are
            summed over rollout batches until N reaches this count, then D_ref = D_bar = U / N; until then its scale
            is 1 and its `tv/<teacher>/ema` and `tv/<teacher>/reference` are not logged. A rarely routed teacher's
            first rollout batch may hold one short completion, whose TV would otherwise set its scale for the whole
            run. `0` fixes D_ref at the first rollout batch with any of its tokens. The pooled scale (one teacher, or
            `tv_scale_per_teacher=False`) keeps the paper's rule, its first rollout batch (docs/method.md, section 4).
        log_update_norm (`bool`, *optional*, defaults to `True`):
            Whether to log `update/norm`, the norm of each optimizer step's realised parameter change. With a torch
            optimizer that steps each parameter on its own (AdamW, SGD, ...; no fp16 gradient scaler), the step runs
            in buckets of parameters, each copied just before its part of the step: about 1/64 of the trainable
            parameters' memory (a larger parameter is stepped in slices of that size by an elementwise optimizer such
            as AdamW or SGD, whole by Adafactor or Muon). Otherwise (DeepSpeed, other optimizers) it needs a copy of
            the trainable parameters (of the local shard when sharded) from just before `optimizer.step()` to just
            after: parameter-sized memory like one AdamW moment. `False` takes no copy and logs no `update/norm`.
        update_norm_interval (`int`, *optional*, defaults to `1`):
            Log `update/norm` on every this many optimizer steps (the first included); the others take no copy.
        log_exact_tv (`bool`, *optional*, defaults to `False`):
            Whether to log `tv/exact`, the exact mean conditional TV over the vocabulary at every active state. It
            costs one extra no-grad forward of both models and a chunked pass over their vocabulary projections per
            rollout batch (`vopd` pays this anyway).

        > Parameters that control the policy-gradient loss and rollout reuse

        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower PPO clip range of the ratio pi_theta / pi_old.
        epsilon_high (`float`, *optional*):
            Upper PPO clip range. Defaults to `epsilon`.
        num_iterations (`int`, *optional*, defaults to `1`):
            Passes mu over each rollout batch. With `num_iterations=1` and `steps_per_generation=1` (the paper's
            setting) every rollout batch feeds exactly one optimizer step, the ratio is 1 and the clip is inactive.
        steps_per_generation (`int`, *optional*, defaults to `1`):
            Consecutive optimizer steps S that one rollout batch is split into. Unlike GRPO, where it counts
            micro-batches, it counts optimizer steps here: a rollout batch holds `per_device_train_batch_size *
            gradient_accumulation_steps * steps_per_generation` prompts per process.

        > Parameters that control the task reward

        reward_funcs (`list[str]`, *optional*):
            Names of registered reward functions (`tvopd_trl.rewards.REWARD_FUNCS`: `accuracy`, math-verify against
            the dataset's `solution` or `answer` column) scored on every rollout. The trainer's `reward_funcs` argument
            takes callables with TRL GRPO's signature too, and wins over this field.
        reward_weights (`list[float]`, *optional*):
            Weight of each reward function in the summed reward, as in TRL GRPO. Defaults to 1 each.
        reward_coef (`float`, *optional*, defaults to `0.0`):
            alpha in A_t = A_distill_t + alpha * A_reward: the weight of the group-normalised sequence reward beside
            the distillation coefficient. `0.0` trains on the teacher alone, exactly as without rewards (the rewards
            are still scored and logged when `reward_funcs` is set). Needs `num_generations >= 2`.
        distillation_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the distillation coefficient A_distill_t. `0.0` with `reward_coef > 0` trains on the reward
            alone (GRPO with this loss); the teacher is still scored, and the TV estimate and c_k still logged.
        num_generations (`int`, *optional*, defaults to `1`):
            Completions sampled per prompt, consecutive in the rollout batch (TRL GRPO's groups). It must divide the
            rollout batch's prompts over all processes.
        scale_rewards (`str`, *optional*, defaults to `"group"`):
            How the reward advantage is scaled after its group's mean is subtracted, as in TRL GRPO: by the group's
            standard deviation (`"group"`), the batch's (`"batch"`), or not at all (`"none"`).

        > Parameters that control the loss phase's batching

        padding_free (`bool`, *optional*, defaults to `False`):
            Whether the teacher's and the student's loss-phase forwards run without padding: the rows of each forward
            are concatenated into one sequence, with `position_ids` restarting at 0 on each row, which transformers
            masks from one another (variable-length kernels with FlashAttention, a block-diagonal mask with `sdpa`,
            `eager` and `flex_attention`; any other attention implementation is refused). Log-probabilities equal the
            padded ones within float tolerance, and the work follows the real tokens instead of rows x the longest
            row. With `sdpa` or `eager`, a forward's attention grows with the square of its tokens: set
            `max_tokens_per_micro_batch` too (docs/performance.md, section 11). As in TRL's SFT. A teacher server is
            unaffected: it never pads.
        max_tokens_per_micro_batch (`int`, *optional*):
            Token budget of one forward of the loss phase: the rows of each micro-batch (and of the rollout the
            teacher scores) go through the model in consecutive groups of at most this many tokens (real tokens with
            `padding_free`, rows x padded width without; a longer row goes alone), instead of
            `per_device_train_batch_size` rows at a time. It bounds a forward's peak memory; it does not change the
            micro-batches, the optimizer steps or the token-mean (docs/scaling.md, section 9). Unset, a forward takes
            `per_device_train_batch_size` rows.

        > Parameters that control the LM head's precision

        lm_head_precision (`str`, *optional*, defaults to `"model"`):
            The precision of the sampled-token LM head's operands. `"model"`: the model's compute dtype (autocast's,
            or the weights' own), the products summed and the logits kept in float32, with no float32 copy of the
            head (a bf16 GEMM with float32 output on CUDA, an exact upcast per vocabulary chunk elsewhere).
            `"float32"`: float32 hidden states through a float32 head, as TRL's `cast_lm_head_to_fp32`. The softmax
            runs in float32 either way, and with float32 weights and no autocast both are the same. Measured, the
            choice never flipped sign(delta) where the backbone's own bf16 rounding flips up to 0.7% of tokens
            (docs/precision.md). Under DeepSpeed and FSDP the head is TRL's float32 one whatever this says: for their
            bf16 module weights it multiplies the same values.

        > Parameters that control the data preprocessing

        max_prompt_length (`int` or `None`, *optional*, defaults to `1024`):
            Maximum prompt length in tokens, after the chat template. Longer prompts are truncated on the left, as in
            the paper, and counted in `prompts/truncated`. `None` disables truncation.

        > Parameters that control vLLM rollouts

        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `True`):
            With `use_vllm=True`, whether to weight each token's loss by the truncated importance ratio pi_old /
            pi_vllm, correcting the mismatch between the vLLM sampler and the trainer's log-probabilities.
        vllm_importance_sampling_cap (`float`, *optional*, defaults to `3.0`):
            Truncation of that ratio (TRL GRPO's default).
        vllm_server_weights_dir (`str`, *optional*):
            With `vllm_mode="server"` on a trainer without CUDA (where TRL's NCCL weight sync cannot run): the folder
            through which the student's weights reach the server after each optimizer step, which the server loads in
            place (it runs with `VLLM_SERVER_DEV_MODE=1`; docs/vllm.md). It must be readable by the server: the
            default, a temporary folder removed at exit, suits a server on the same machine. Unused with CUDA.
        max_staleness (`int`, *optional*, defaults to `0`):
            Asynchronous rollouts, as TRL's asynchronous trainers name it: with `max_staleness=s > 0` the vLLM server
            samples the next rollout batches while the trainer trains on this one, each with weights at most `s`
            optimizer steps older than those of its first update (a staler one is dropped, sampled again and counted
            in `async/dropped`). pi_old stays the student's log-probability at learner time; the sampler's enters only
            through the truncated importance weight (docs/method.md). `0` generates each rollout batch when it is
            needed, as TRL does. Needs `use_vllm=True`, `vllm_mode="server"` and one optimizer step per rollout batch
            (docs/vllm.md). Without `vllm_importance_sampling_correction` the stale samples enter the loss as if drawn
            from pi_old: allowed for ablations, with a warning.
        vllm_server_request_timeout (`float`, *optional*, defaults to `900.0`):
            Seconds one request to the vLLM rollout server (`vllm_mode="server"`: a rollout batch's generation, a
            weight sync, the prefix-cache reset) may take. A server that does not answer in time stops the run with
            one error naming its URL and this setting, rather than hanging it: TRL's client sets no timeout. A request
            that timed out is not sent again; one whose connection the server closed before answering is, once. Raise
            it for long generations; with several processes keep it below `ddp_timeout`, or the others, waiting in a
            collective, time out first. (`vllm_server_timeout` is only the wait for the server at start-up.)

        > Parameters that control a served teacher

        teacher_model_server_url (`str`, `list[str]` or `dict[str, str | list[str]]`, *optional*):
            Base URL of a vLLM server that hosts the teacher (e.g. `"http://teacher-node:8000"`, started with `trl
            vllm-serve` or `vllm serve`), as in TRL's `ServerDistillationConfig`. The teacher then scores each sampled
            token with one prefill request (`VLLMClient.get_sequence_logprobs`) instead of living in the training
            processes, which frees their memory for the student. Pass no `teacher_model` to the trainer then, and
            `teacher_processing_class` to check the vocabularies. Needs vLLM's client (`pip install -e ".[vllm]"`);
            not usable with `advantage_mode="vopd"` or `log_exact_tv`, which need the full next-token distribution.
            A list of URLs (a JSON list on the command line) is a pool of replicas of one teacher server: each
            rollout's scoring is cut into chunks spread over them, and a chunk that a replica fails is retried on
            another (docs/vllm.md). With several teachers, a mapping `{name: URL or list of URLs}` (a JSON object on
            the command line): those teachers are served, and the trainer's `teacher_model` mapping names the local
            ones (docs/multi-teacher.md).
        teacher_model_server_timeout (`float`, *optional*, defaults to `240.0`):
            Seconds to wait for the teacher server (each replica of a pool, all at once) to answer its health check
            before training fails, or, with a pool, starts without the replicas that did not answer.
        teacher_model_server_request_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds one scoring request (a chunk of `teacher_model_server_chunk_rows` rows) may take before it counts
            as failed and is retried, after a backoff of 1 s doubling with each retry, on another replica where there
            is one. A read timeout is no exception, even on the only replica: the chunk waits its backoff before it goes
            back, and holds its slot meanwhile. A server that is healthy but slower than this per chunk needs a longer
            timeout or smaller chunks, not retries.
        teacher_model_server_retries (`int`, *optional*, defaults to `4`):
            Retries of a chunk before the step fails with a `ConnectionError` naming every replica. A server that stops
            answering fails the step within (retries + 1) x `teacher_model_server_request_timeout` plus 2^retries - 1
            seconds of backoff (1515 s with the defaults). With several processes, keep that below `ddp_timeout` (1800
            s by default), or the others, waiting in a collective, time out first and the run dies without naming the
            teacher: the trainer warns when it is not.
        teacher_model_server_chunk_rows (`int`, *optional*):
            Rows of a process's rollout per scoring request. By default at most 32, so that one request's work, and so
            its timeout, does not grow with the rollout, and at least 4 chunks per replica of a pool, so that a slow
            replica's share can move.
        teacher_model_server_max_in_flight (`int`, *optional*, defaults to `2`):
            Scoring requests in flight per replica from each training process (P processes put up to P times this on
            each replica, which vLLM batches together).

        > Parameters that control a teacher with another tokenizer

        cross_tokenizer (`bool`, *optional*, defaults to `False`):
            Whether a teacher whose tokenizer differs from the student's (another model family) is distilled from, local
            or served: it scores the student's completion text on its own tokenization, and each span where both
            tokenizations cut carries the span's log-ratio (docs/cross-tokenizer.md). The teacher's tokenizer must be
            known (`teacher_processing_class`, or the teacher's folder). Without it such a teacher is refused. A
            teacher with the student's vocabulary is scored on the student's own ids either way. Modes `power` and
            `vopd` and `log_exact_tv` compare per-token distributions over one vocabulary and are refused with such a
            teacher.

        > Parameters that control self-distillation

        self_distillation (`str`, *optional*):
            The student as its own teacher (on-policy self-distillation), with no `teacher_model`: `"live"` scores with
            the student's current weights (no gradient; the weights that sampled the rollout, as OPSD does) and
            `"frozen"` with a copy of the student from before training (its checkpoint loaded again, or a copy of the
            model passed). The teacher sees privileged context through each row's `teacher_prompt` column
            (docs/self-distillation.md); without one its delta is 0 (live) or the drift from the start (frozen).
            `None` distils from `teacher_model`.

    > [!NOTE]
    > These parameters have default values different from [`~trl.DistillationConfig`]:
    > - `disable_dropout`: Defaults to `True` instead of `False`: a probability ratio needs a deterministic policy.
    > - `restore_callback_states_from_checkpoint`: Defaults to `True` instead of `False`, so that resuming restores
    >   the TV scheduler.
    """

    _VALID_DICT_FIELDS = DistillationConfig._VALID_DICT_FIELDS + [
        "advantage_kwargs",
        "teacher_model_name_or_path",
        "teacher_model_server_url",
    ]

    # Parameters whose default values are overridden from DistillationConfig / TrainingArguments
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Whether to disable dropout in the student model. A probability ratio needs it off."},
    )
    restore_callback_states_from_checkpoint: bool = field(
        default=True,
        metadata={"help": "Whether to restore callback states (the TV scheduler among them) on resume."},
    )

    # Parameters that control the advantage
    advantage_mode: str = field(
        default="tv",
        metadata={"help": "Per-token advantage coefficient.", "choices": list(ADVANTAGE_MODES)},
    )
    advantage_clip_low: float | None = field(
        default=None,
        metadata={"help": "Lower ClipOPD bound; -5.0 when advantage_mode='clip' and no bound is set."},
    )
    advantage_clip_high: float | None = field(
        default=None,
        metadata={"help": "Upper ClipOPD bound; 5.0 when advantage_mode='clip' and no bound is set."},
    )
    power_gamma: float | None = field(
        default=0.5,
        metadata={"help": "PowerOPD Box-Cox exponent (> 0)."},
    )
    relative_power_beta: float | None = field(
        default=0.4,
        metadata={"help": "Power(beta) relative-magnitude ablation exponent, in [0, 1]."},
    )
    advantage_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Hyperparameters of the advantage mode without a field of their own, as a JSON object."},
    )
    sign_tolerance: float | None = field(
        default=None,
        metadata={
            "help": "|delta| at or below it is a tie (advantage 0) in the sign-based modes; by default 0 with a "
            "teacher model and the forwards' rounding with self_distillation."
        },
    )

    # Parameters that control the TV-EMA scheduler
    tv_alpha: float = field(default=0.5, metadata={"help": "TV-OPD attenuation exponent alpha (>= 0)."})
    tv_ema_decay: float = field(default=0.95, metadata={"help": "EMA retention of the TV estimate, in [0, 1)."})
    tv_min_scale: float = field(default=0.1, metadata={"help": "Floor of the TV-OPD scale, in (0, 1]."})
    tv_eps: float = field(default=1e-5, metadata={"help": "Guard epsilon of the TV ratio (> 0)."})
    tv_scale_target: str = field(
        default="advantage",
        metadata={
            "help": "What c_k scales: `advantage` (the paper's) or `learning_rate`.",
            "choices": ["advantage", "learning_rate"],
        },
    )
    tv_scale_per_teacher: bool | None = field(
        default=None,
        metadata={"help": "One TV scheduler and scale per teacher (default with several teachers), or one for all."},
    )
    tv_reference_min_tokens: int = field(
        default=1000,
        metadata={"help": "With a scale per teacher, active tokens a teacher's TV reference pools at least (>= 0)."},
    )
    log_update_norm: bool = field(
        default=True,
        metadata={"help": "Whether to log `update/norm` (costs a copy of some or all trainable parameters)."},
    )
    update_norm_interval: int = field(
        default=1,
        metadata={"help": "Log `update/norm` on every this many optimizer steps (>= 1)."},
    )
    log_exact_tv: bool = field(
        default=False,
        metadata={"help": "Whether to log the exact mean conditional TV over the vocabulary (`tv/exact`)."},
    )

    # Parameters that control the policy-gradient loss and rollout reuse
    epsilon: float = field(default=0.2, metadata={"help": "Lower PPO clip range of the ratio."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper PPO clip range; defaults to epsilon."})
    num_iterations: int = field(default=1, metadata={"help": "Passes over each rollout batch (mu)."})
    steps_per_generation: int = field(
        default=1, metadata={"help": "Optimizer steps each rollout batch is split into (S)."}
    )

    # Parameters that control the task reward
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Registered reward functions scored on every rollout, e.g. `accuracy`."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function in the summed reward (default 1 each)."}
    )
    reward_coef: float = field(
        default=0.0, metadata={"help": "alpha: weight of the group-normalised reward advantage beside the teacher's."}
    )
    distillation_coef: float = field(
        default=1.0, metadata={"help": "Weight of the distillation advantage; 0 with reward_coef > 0: reward only."}
    )
    num_generations: int = field(default=1, metadata={"help": "Completions sampled per prompt (GRPO's groups)."})
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Scaling of the reward advantage: by its group's std, the batch's, or none.",
            "choices": ["group", "batch", "none"],
        },
    )

    # Parameters that control the loss phase's batching
    padding_free: bool = field(
        default=False,
        metadata={"help": "Whether the loss phase's forwards pack their rows into one sequence, without padding."},
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "Token budget of one loss-phase forward; unset, it takes per_device_train_batch_size rows."},
    )

    # Parameters that control the LM head's precision
    lm_head_precision: str = field(
        default="model",
        metadata={
            "help": "Precision of the sampled-token LM head: `float32` inputs, or the model's own with float32 "
            "accumulation (`model`).",
            "choices": ["float32", "model"],
        },
    )

    # Parameters that control the data preprocessing
    max_prompt_length: int | None = field(
        default=1024,
        metadata={"help": "Maximum prompt length; longer prompts are left-truncated. None disables truncation."},
    )

    # Parameters that control vLLM rollouts
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Whether to correct the vLLM sampler / trainer mismatch with truncated importance weights."},
    )
    vllm_importance_sampling_cap: float = field(
        default=3.0, metadata={"help": "Truncation of the vLLM importance-sampling ratio."}
    )
    vllm_server_weights_dir: str | None = field(
        default=None,
        metadata={
            "help": "With vllm_mode server and no CUDA: the folder, readable by the server, through which the "
            "student's weights reach it after each step (default: a temporary one)."
        },
    )

    max_staleness: int = field(
        default=0,
        metadata={
            "help": "Optimizer steps a vLLM server rollout may lag behind the weights it is trained on; 0: synchronous."
        },
    )

    vllm_server_request_timeout: float = field(
        default=900.0,
        metadata={"help": "Seconds one request to the vLLM rollout server may take before the run stops."},
    )

    # Several teachers: a mapping by name (docs/multi-teacher.md)
    teacher_model_name_or_path: dict[str, str] | str | None = field(
        default=None,
        metadata={"help": "Teacher model name or path, or a JSON object {name: path} of several teachers."},
    )

    # Parameters that control a served teacher
    teacher_model_server_url: dict[str, str | list[str]] | str | list[str] | None = field(
        default=None,
        metadata={
            "help": "Base URL of a vLLM server hosting the teacher, a JSON list of the URLs of its replicas, or a JSON "
            "object {name: URL or list of URLs} of several teachers."
        },
    )
    teacher_model_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the teacher server's health check."}
    )
    teacher_model_server_request_timeout: float = field(
        default=300.0, metadata={"help": "Seconds a scoring request to the teacher server may take before a retry."}
    )
    teacher_model_server_retries: int = field(
        default=4, metadata={"help": "Retries of a teacher scoring request before the step fails."}
    )
    teacher_model_server_chunk_rows: int | None = field(
        default=None,
        metadata={
            "help": "Rows per teacher scoring request; unset, at most 32, and at least 4 chunks per replica of a pool."
        },
    )
    teacher_model_server_max_in_flight: int = field(
        default=2, metadata={"help": "Teacher scoring requests in flight per replica from each process."}
    )

    # Parameters that control a teacher with another tokenizer
    cross_tokenizer: bool = field(
        default=False,
        metadata={"help": "Distill from a teacher whose tokenizer differs from the student's, on aligned text spans."},
    )

    # Parameters that control self-distillation
    self_distillation: str | None = field(
        default=None,
        metadata={
            "help": "The student as its own teacher: 'live' (its current weights) or 'frozen' (as before training).",
            "choices": ["live", "frozen"],
        },
    )

    def _check_reward_settings(self):
        if self.reward_coef < 0 or self.distillation_coef < 0 or self.reward_coef == self.distillation_coef == 0:
            raise ValueError(
                f"reward_coef and distillation_coef must be >= 0 and not both 0, got {self.reward_coef} and "
                f"{self.distillation_coef}."
            )
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}.")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}.")
        if self.reward_coef > 0 and self.num_generations < 2:
            raise ValueError(
                f"reward_coef={self.reward_coef} weights a reward advantage measured against its group's mean, which is "
                "0 for a group of one completion: set num_generations >= 2."
            )
        if self.reward_coef > 0 and self.tv_scale_target == "learning_rate":
            raise ValueError(
                "tv_scale_target='learning_rate' would scale the reward term by c_k too, while c_k regulates the "
                "distillation term only: leave tv_scale_target='advantage' with reward_coef > 0."
            )

    def __getstate__(self):
        # transformers pickles the config into every checkpoint's `training_args.bin` and uploads that file with
        # `push_to_hub`: the token stays in memory only.
        return {**self.__dict__, "hub_token": None}

    def __post_init__(self):
        # transformers 5.21+ renamed `gradient_checkpointing*` to `activation_checkpointing*` and warns whenever only
        # the old name is set, which TRL's configs always do (their `gradient_checkpointing` defaults to True), as do
        # recipes that must also run on transformers 5.16-5.20 (no new name). Pass the value on under the new name;
        # transformers mirrors it back into the old one, which TRL reads.
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if hasattr(self, new) and getattr(self, new) is None:
                setattr(self, new, getattr(self, old))
        if self.bf16 is None and not self.fp16:
            self.bf16 = is_torch_bf16_gpu_available()
        if self.tf32 is None and is_torch_tf32_available():
            self.tf32 = True
        # TRL's config refuses sequence parallelism, which this trainer runs in its loss phase (docs/scaling.md); what
        # it cannot run is refused by the trainer (`tvopd_trl.sequence_parallel.check_sequence_parallel`).
        launched_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if launched_deepspeed and not torch.accelerator.is_available():
            if self.ddp_backend is None:
                self.ddp_backend = "gloo"  # DeepSpeed's one process group on a machine without an accelerator
            # Before the process group forms: DeepSpeed's CPU backend would compile its shared-memory all-reduce (1-3
            # minutes on 2 cores, once per extension cache), which only its tensor-parallel inference calls; training
            # communicates through gloo either way.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        parallelism_config, self.parallelism_config = self.parallelism_config, None
        super().__post_init__()
        self.parallelism_config = parallelism_config
        # transformers parses only JSON objects (`_VALID_DICT_FIELDS`): a pool of replicas comes as a JSON list
        if isinstance(self.teacher_model_server_url, str) and self.teacher_model_server_url.startswith("["):
            self.teacher_model_server_url = json.loads(self.teacher_model_server_url)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.world_size == 1:
            raise ValueError(
                f"This process is one of {launched} that were launched (WORLD_SIZE={launched}), but no process group "
                "joins them: each would train its own unsynchronised copy. Without a GPU, set `use_cpu=True` (DDP) "
                "or `ddp_backend='gloo'` (DeepSpeed)."
            )
        if self.advantage_mode not in ADVANTAGE_MODE_REGISTRY:
            raise ValueError(
                f"Unknown advantage_mode {self.advantage_mode!r}. Valid modes are: {', '.join(ADVANTAGE_MODE_REGISTRY)}."
            )
        mode = self.advantage_mode
        spec = ADVANTAGE_MODE_REGISTRY[mode]
        validate_tv_hyperparameters(
            self.tv_alpha, self.tv_ema_decay, self.tv_min_scale, self.tv_eps, self.tv_reference_min_tokens
        )
        if self.beta != 1.0:
            raise ValueError(
                f"beta={self.beta} selects DistillationTrainer's JSD, which TV-OPD does not compute: its loss is the "
                "sampled-token policy gradient chosen by `advantage_mode` (`raw` is the closest to beta=1, reverse KL). "
                "Remove `beta`."
            )
        if self.lm_head_precision not in ("float32", "model"):
            raise ValueError(
                f"lm_head_precision must be 'float32' or 'model' (the model's compute dtype, summed in float32), got "
                f"{self.lm_head_precision!r}."
            )
        if self.self_distillation not in (None, "live", "frozen"):
            raise ValueError(
                f"self_distillation must be 'live' (the student's current weights), 'frozen' (its weights before "
                f"training) or None (a teacher model), got {self.self_distillation!r}."
            )
        if self.self_distillation is not None and (self.teacher_model_name_or_path or self.teacher_model_server_url):
            raise ValueError(
                f"self_distillation={self.self_distillation!r} makes the student its own teacher: remove "
                "teacher_model_name_or_path and teacher_model_server_url, or set self_distillation to None."
            )
        if self.self_distillation is not None and self.teacher_model_init_kwargs is not None:
            raise ValueError(
                f"self_distillation={self.self_distillation!r} loads the student's own weights as the teacher, as the "
                "student loads (model_init_kwargs): remove teacher_model_init_kwargs."
            )
        if self.sign_tolerance is not None and not 0 <= self.sign_tolerance < math.inf:
            raise ValueError(
                f"sign_tolerance must be a finite number >= 0, got {self.sign_tolerance}: 0 keeps the paper's sign, None "
                "picks it from the teacher."
            )
        if self.tv_scale_target not in ("advantage", "learning_rate"):
            raise ValueError(f"tv_scale_target must be 'advantage' or 'learning_rate', got {self.tv_scale_target!r}.")
        if self.tv_scale_target == "learning_rate" and "scale" not in spec.inputs:
            raise ValueError(
                f"tv_scale_target='learning_rate' applies the TV-OPD scale c_k, which advantage_mode={mode!r} does "
                "not use. Set advantage_mode='tv', or leave tv_scale_target='advantage'."
            )
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.epsilon < 0 or self.epsilon_high < 0:
            raise ValueError(f"epsilon and epsilon_high must be >= 0, got {self.epsilon} and {self.epsilon_high}.")
        for name in ("num_iterations", "steps_per_generation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.update_norm_interval < 1:
            raise ValueError(
                f"update_norm_interval must be >= 1, got {self.update_norm_interval}: 1 logs `update/norm` on every "
                "optimizer step. To log none, set log_update_norm=False."
            )
        self._check_reward_settings()
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(
                f"max_completion_length must be >= 1, got {self.max_completion_length}: it is the rollouts' length budget."
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}.")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1 or None, got {self.max_tokens_per_micro_batch}."
            )
        if self.vllm_importance_sampling_cap <= 0:
            raise ValueError(f"vllm_importance_sampling_cap must be > 0, got {self.vllm_importance_sampling_cap}.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}.")
        if self.vllm_server_request_timeout <= 0:
            raise ValueError(f"vllm_server_request_timeout must be > 0, got {self.vllm_server_request_timeout}.")
        if self.teacher_model_server_request_timeout <= 0 or self.teacher_model_server_retries < 0:
            raise ValueError(
                "teacher_model_server_request_timeout must be > 0 and teacher_model_server_retries >= 0, got "
                f"{self.teacher_model_server_request_timeout} and {self.teacher_model_server_retries}."
            )
        for name in ("teacher_model_server_chunk_rows", "teacher_model_server_max_in_flight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.teacher_model_server_url is not None and (spec.needs_exact_divergence or self.log_exact_tv):
            raise ValueError(
                f"advantage_mode={mode!r} and log_exact_tv=True need the teacher's full next-token distribution, which a "
                "teacher server (teacher_model_server_url) does not return. Load the teacher in-process, or use "
                "another mode and log_exact_tv=False."
            )

        if mode == "clip" and self.advantage_clip_low is None and self.advantage_clip_high is None:
            self.advantage_clip_low, self.advantage_clip_high = DEFAULT_CLIP_BOUNDS
        if self.advantage_kwargs is not None and not isinstance(self.advantage_kwargs, dict):
            raise ValueError(f"advantage_kwargs must be a dict or a JSON object, got {self.advantage_kwargs!r}.")
        own = [keyword for keyword, name in spec.hyperparameters.items() if name is None]
        unknown = sorted(set(self.advantage_kwargs or {}) - set(own))
        if unknown:
            raise ValueError(
                f"advantage_kwargs sets {unknown}, which advantage_mode={mode!r} does not take there (it takes "
                f"{own or 'nothing'}). A hyperparameter with a config field of its own, such as power_gamma, is set "
                "through that field."
            )
        spec.check(mode, spec.config_kwargs(self))
        if self.advantage_clip_low is not None and not self.advantage_clip_low < 0:
            raise ValueError(
                f"advantage_clip_low must be < 0, got {self.advantage_clip_low}: a positive bound would turn the "
                "teacher's 'less likely' into 'more likely'."
            )
        if self.advantage_clip_high is not None and not self.advantage_clip_high > 0:
            raise ValueError(f"advantage_clip_high must be > 0, got {self.advantage_clip_high}.")
        if not self.disable_dropout:
            warnings.warn(
                "disable_dropout=False: with dropout on, the student's log-probabilities are random draws, so pi_old, "
                "the ratio pi_theta / pi_old and the TV estimate no longer describe the policy that sampled the "
                "tokens. Set disable_dropout=True (the default).",
                stacklevel=2,
            )
        if not self.restore_callback_states_from_checkpoint:
            warnings.warn(
                "restore_callback_states_from_checkpoint=False: resuming from a checkpoint restarts the TV scheduler "
                "(c_k = 1, new reference) instead of restoring it. Set it to True to resume the run exactly.",
                stacklevel=2,
            )
