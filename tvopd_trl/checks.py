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
"""What [`TVOPDTrainer`] checks at construction.

Bad input is refused before any model loads wherever it can be (`check_inputs`, `wait_for_server`,
`check_paths`, `load_tokenizer`), with an error that names the fix; what can only be checked on the loaded models comes after
(`check_loaded_trainer`), with warnings for settings that break the estimator's assumptions.
"""

import inspect
import os
import time
import warnings

from accelerate.utils import DistributedType, get_int_from_env
from transformers import AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.utils import logging
from trl.import_utils import is_vllm_available

from .async_rollouts import check_async_setup
from .cross_tokenizer import teacher_alignments
from .sequence_parallel import check_sequence_parallel
from .teacher_prompts import check_teacher_prompts
from .teachers import SINGLE_TEACHER, check_routing, teacher_sources
from .tokenizers import check_shared_vocabulary


logger = logging.get_logger(__name__)

# Model-specific logit post-processing that a plain projection through the output head would miss.
LOGIT_POSTPROCESSING_ATTRIBUTES = (
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
    "final_logit_softcapping",
)


def check_inputs(args, train_dataset, processing_class, tools, teacher_model, eval_dataset=None):
    """Everything about the arguments that is wrong whatever the models turn out to be (paths aside: see
    `check_paths`). Returns the teachers' sources, `(local, served)` (see `teacher_sources`)."""
    local, served = teacher_sources(teacher_model, args.teacher_model_server_url)
    if SINGLE_TEACHER in local and SINGLE_TEACHER in served:
        raise ValueError(
            "Pass either a `teacher_model` or `teacher_model_server_url` in the config, not both: with a teacher "
            "server, no teacher is loaded in the training processes."
        )
    if not local and not served:
        raise ValueError(
            "TVOPDTrainer needs a `teacher_model` (a model or a path), or `teacher_model_server_url` in the config: "
            "the teacher supplies every advantage."
        )
    names = [*local, *served]
    if len(names) > 1 and args.tv_scale_target == "learning_rate" and args.tv_scale_per_teacher is not False:
        raise ValueError(
            "tv_scale_target='learning_rate' has one learning rate per step, which cannot carry a scale per teacher. "
            "Set tv_scale_per_teacher=False (one scale pooled over every teacher) or tv_scale_target='advantage'."
        )
    check_routing(train_dataset, names)
    check_teacher_prompts(train_dataset)
    for evaluation in eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]:
        check_routing(evaluation, names, every_teacher=False)
        check_teacher_prompts(evaluation)
    if (args.use_vllm or served) and not is_vllm_available():
        feature = "use_vllm=True" if args.use_vllm else "teacher_model_server_url"
        raise ImportError(
            f'{feature} needs vLLM, which is not installed: `pip install -e ".[vllm]"` in the repository on the training '
            "machines (the README's GPU install), or train without it (transformers generation, in-process teacher)."
        )
    _check_dataset(train_dataset, processing_class)
    _check_batch_layout(args, train_dataset)
    check_async_setup(args, train_dataset)
    if tools and args.use_vllm and args.vllm_mode == "server" and args.world_size > 1:
        raise ValueError(
            f"Tools with a vLLM rollout server need a single training process (this run has {args.world_size}): "
            "TRL samples each tool turn in a request that every process must join, yet only the processes whose "
            "rows called a tool join it. Train in one process, or use vllm_mode='colocate' (each process samples "
            "its own rows)."
        )
    if tools and args.use_vllm and args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size > 1:
        raise ValueError(
            "Tools with colocated vLLM need vllm_tensor_parallel_size=1: the processes of a tensor-parallel group "
            "sample each turn together, yet each runs its own tool loop."
        )
    if any(inspect.iscoroutinefunction(tool) for tool in tools or ()):
        # TRL refuses them too, once the models are loaded
        raise ValueError("Async tools are not supported by TRL's tool loop: pass synchronous tools.")
    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            "TVOPDTrainer is text-only, but the processing class is a multimodal processor "
            f"({type(processing_class).__name__}). Pass the model's tokenizer instead."
        )
    return local, served


def check_reward_setup(args, reward_funcs):
    """The task reward's settings against the resolved reward functions (`TVOPDConfig` checks the rest)."""
    if args.reward_coef > 0 and not reward_funcs:
        raise ValueError(
            f"reward_coef={args.reward_coef} weights a task reward, but no reward function is set: pass "
            "`reward_funcs` (a callable or a registered name such as 'accuracy'), or set reward_coef=0."
        )
    if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
        raise ValueError(
            f"reward_weights has {len(args.reward_weights)} weights for {len(reward_funcs)} reward functions: give one "
            "weight per function."
        )


def check_paths(model, local_teachers):
    """`local_teachers`: `{name: model or path}`, as `teacher_sources` returns them."""
    roles = {"model": model}
    for name, value in local_teachers.items():
        roles["teacher_model" if name == SINGLE_TEACHER else f"teacher_model[{name!r}]"] = value
    for role, value in roles.items():
        # A Hub id is `name` or `org/name`; anything else that does not exist here is a mistyped local path.
        local = isinstance(value, str) and (value.startswith((".", "/", "~")) or value.count("/") > 1)
        if local and not os.path.exists(os.path.expanduser(value)):
            raise FileNotFoundError(f"`{role}` {value!r} does not exist: give a local checkpoint folder or a Hub id.")


def _check_dataset(train_dataset, processing_class):
    """An empty or prompt-less dataset, or chat prompts without a chat template."""
    columns = getattr(train_dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"The training dataset has no `prompt` column (its columns: {', '.join(columns)}). Map yours to chat "
            "messages in `prompt` with `tvopd_trl.prompts.to_prompt_dataset(dataset, column)` (the main job's "
            "`dataset_prompt_column`)."
        )
    if hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
        raise ValueError("The training dataset is empty: it has no prompt to roll out.")
    if (
        isinstance(processing_class, PreTrainedTokenizerBase)
        and processing_class.chat_template is None
        and hasattr(train_dataset, "__getitem__")
        and isinstance(train_dataset[0]["prompt"], list)
    ):
        raise ValueError(
            "The prompts are chat messages but the tokenizer has no chat template to render them. Use the "
            "instruct model's tokenizer, set `tokenizer.chat_template`, or give plain-text prompts."
        )


def _check_batch_layout(args, train_dataset):
    processes = args.world_size
    if args.use_vllm and args.vllm_mode == "colocate" and processes % args.vllm_tensor_parallel_size:
        raise ValueError(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} does not divide the {processes} training "
            "processes: colocated vLLM runs one engine per group of that many processes. Choose a divisor."
        )
    rollout = (
        args.per_device_train_batch_size * processes * args.gradient_accumulation_steps * args.steps_per_generation
    )
    if rollout % args.num_generations:
        raise ValueError(
            f"num_generations={args.num_generations} does not divide the rollout batch of {rollout} completions "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x {processes} processes x "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps} x steps_per_generation "
            f"{args.steps_per_generation}): each prompt's group of samples must fit in one rollout batch."
        )
    if (
        train_dataset is not None
        and hasattr(train_dataset, "__len__")  # an iterable dataset has no size to check
        and len(train_dataset) < rollout // args.num_generations
    ):
        raise ValueError(
            f"One rollout batch takes {rollout // args.num_generations} prompts (per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {processes} processes x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x steps_per_generation {args.steps_per_generation} / "
            f"num_generations {args.num_generations}), but the dataset has {len(train_dataset)}: no batch would ever be drawn. Lower one of those factors or use "
            "more prompts."
        )


def probe_server(url, request_timeout):
    """Raises a `requests` exception unless the vLLM server at `url` answers its health check with 200 within
    `request_timeout` seconds."""
    import requests

    requests.get(f"{url.rstrip('/')}/health", timeout=request_timeout).raise_for_status()


def server_unreachable(url, timeout, what):
    """The `ConnectionError` for a vLLM server that did not answer its health check in time, naming the fix."""
    return ConnectionError(
        f"{what[0].upper()}{what[1:]} at {url} did not answer within {timeout} s. Start it first (`tvopd-trl "
        "vllm-serve --role rollouts|teacher --model <model>`, docs/vllm.md) or fix the URL; the matching "
        "`..._timeout` setting sets how long to wait (a vLLM server on a CPU may take minutes to start)."
    )


def wait_for_server(url, timeout, what):
    """Returns once the vLLM server at `url` answers its health check, asked every 2 s for `timeout` seconds (at least
    once); raises [`server_unreachable`]'s error otherwise. Not TRL's `check_server`: its request has no timeout, so a
    server that accepts the connection and never answers holds it forever, and it asks again forever, whatever its
    deadline, while the server answers with an error status (a vLLM server whose engine died answers 503)."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            # A deadline nearly spent (or 0) still leaves the server a second to answer
            return probe_server(url, max(deadline - time.monotonic(), 1.0))
        except requests.exceptions.RequestException as error:
            if time.monotonic() + 2.0 >= deadline:
                raise server_unreachable(url, timeout, what) from error
        time.sleep(2.0)


def check_teacher_pools(args, pools):
    """A teacher server that stops answering must fail the step before the other processes give up waiting for it:
    they wait in a collective for up to `ddp_timeout` seconds, and then kill the run without naming the teacher."""
    for pool in pools.values():
        if args.world_size > 1 and pool.give_up_seconds > args.ddp_timeout:
            warnings.warn(
                f"{pool.what[0].upper()}{pool.what[1:]} can take {pool.give_up_seconds:g} s to give up on a chunk "
                f"((teacher_model_server_retries + 1) x teacher_model_server_request_timeout, plus {pool.backoff:g} s "
                f"of backoff doubling with each retry), longer than ddp_timeout={args.ddp_timeout} s: if it stops "
                "answering, the other processes' collective times out first and the run dies without naming the "
                "teacher. Lower those two settings or raise ddp_timeout.",
                stacklevel=3,
            )


def load_tokenizer(source, trust_remote_code):
    """The tokenizer of a local folder or Hub id, or None when there is none to load (then only a warning can say that
    the vocabularies were not compared)."""
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        logger.info(f"No tokenizer could be loaded from {source!r}: {error}")
        return None


def check_loaded_trainer(trainer, teacher_tokenizers, shared_vocabulary=None):
    """What needs the loaded student and teachers (`trainer.teachers`; `teacher_tokenizers`: name -> tokenizer or None,
    where a teacher's tokenizer loaded from its folder is added; `shared_vocabulary`: name -> `check_shared_vocabulary`'s
    verdict, where already known). Returns the alignments of the teachers with another tokenizer
    (`tvopd_trl.cross_tokenizer.teacher_alignments`)."""
    args = trainer.args
    check_process_group(trainer.accelerator)
    if trainer._is_vlm:  # loaded by the base class when `processing_class` was None
        raise ValueError(
            "TVOPDTrainer is text-only, but the model's processing class is a multimodal processor "
            f"({type(trainer.processing_class).__name__}). Pass the model's tokenizer as `processing_class`."
        )
    if trainer.is_deepspeed_enabled and args.tv_scale_target == "learning_rate":
        raise ValueError(
            "tv_scale_target='learning_rate' scales the learning rate just before `optimizer.step()`, which the "
            "DeepSpeed engine takes inside `backward`. Use tv_scale_target='advantage' under DeepSpeed."
        )
    student = trainer.accelerator.unwrap_model(trainer.model)
    check_sequence_parallel(trainer, student)
    teachers = [
        None if teacher.served else trainer.accelerator.unwrap_model(teacher.model)
        for teacher in trainer.teachers.values()
    ]
    shared_vocabulary = dict(shared_vocabulary or {})
    for name, teacher in zip(trainer.teachers, teachers, strict=True):
        teacher_tokenizers[name], shared_vocabulary[name] = _check_teacher(
            trainer, student, teacher, teacher_tokenizers[name], shared_vocabulary.get(name)
        )
    # Before the checks of one vocabulary below: a teacher of another tokenizer fails them with a vaguer message
    alignments = teacher_alignments(trainer, teacher_tokenizers, shared_vocabulary)
    if args.padding_free:
        _check_packed_attention(student, "the student")
        for name, teacher in zip(trainer.teachers, teachers, strict=True):
            if teacher is not None:
                _check_packed_attention(teacher, "the teacher" if name == SINGLE_TEACHER else f"the teacher {name!r}")
    _warn_on_off_policy_sampling(args)
    if args.teacher_model_server_url is not None and args.temperature != 1.0:
        warnings.warn(
            f"A teacher server scores at temperature {args.temperature} only if it applies the temperature to "
            "prompt log-probabilities (vLLM's `--logprobs-mode processed_logprobs`, which `trl vllm-serve` sets); "
            "a plain `vllm serve` returns temperature-1 log-probabilities. The paper samples at temperature 1.",
            stacklevel=3,
        )
    if args.bf16 and trainer.accelerator.device.type == "cpu":
        warnings.warn(
            "bf16=True on CPU: bf16 autocast there is emulated and made TV-OPD about 3x slower than float32 in a "
            "measured case (docs/performance.md). Set bf16=False (TRL's config defaults to bf16=True).",
            stacklevel=3,
        )
    if trainer._needs_exact_divergences:  # the config refuses these with a served teacher
        configs = [model.config.get_text_config() for model in (student, *teachers) if model is not None]
        for config in configs:
            found = [name for name in LOGIT_POSTPROCESSING_ATTRIBUTES if getattr(config, name, None) is not None]
            if found:
                raise ValueError(
                    f"advantage_mode={args.advantage_mode!r} and log_exact_tv=True need the exact next-token "
                    f"distribution, but {config.model_type} post-processes its logits ({', '.join(found)}), which "
                    "the exact divergence does not reproduce. Use another mode, or set log_exact_tv=False."
                )
        rows = sorted({config.vocab_size for config in configs})
        if len(rows) > 1:
            raise ValueError(
                f"advantage_mode={args.advantage_mode!r} and log_exact_tv=True compare whole next-token distributions, "
                f"which needs output layers of one size; these have {rows} rows. Use another mode, or set "
                "log_exact_tv=False."
            )
    return alignments


def check_process_group(accelerator):
    """Refuses processes that a launcher started together but that do not form one group in accelerate. Without a
    GPU and without the CPU asked for, `accelerate launch` with `--ddp_backend gloo` (and no DeepSpeed) joins them in a
    torch process group that accelerate ignores: each trains its own copy of the model with distributed type NO, and
    what they gather holds their own shard only."""
    # The variables accelerate itself reads to count the launched processes (torchrun, MPI)
    launched = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    if launched > 1 and (accelerator.distributed_type == DistributedType.NO or accelerator.num_processes != launched):
        raise ValueError(
            f"This process is one of {launched} that the launcher started, but accelerate does not run them as one "
            f"group (distributed type {accelerator.distributed_type.value}, {accelerator.num_processes} process(es)): "
            "each would train its own unsynchronised copy. Without a GPU, ask for the CPU: `--use_cpu` (or "
            "`use_cpu: true` in the recipe) with recipes/accelerate_configs/ddp_cpu.yaml; `--ddp_backend gloo` alone "
            "is for DeepSpeed (zero3_cpu.yaml)."
        )


def _check_packed_attention(model, name):
    implementation = model.config.get_text_config()._attn_implementation
    # The mapping `masking_utils` consults: for any other implementation it builds no mask at all, and packed rows
    # would attend to one another.
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ValueError(
            f"padding_free=True packs rows into one sequence, but {name} runs attn_implementation={implementation!r}, "
            "for which transformers does not mask packed rows from one another. Load it with "
            "attn_implementation='sdpa' (or 'flash_attention_2' on a GPU), or set padding_free=False."
        )


def _check_teacher(trainer, student, teacher, teacher_processing_class, shared_vocabulary=None):
    """The teacher's tokenizer (loaded from its folder when not given) and whether it shares the student's vocabulary
    (`shared_vocabulary` where already known; None for an unknown tokenizer)."""
    if teacher_processing_class is None and teacher is not None and teacher.config._name_or_path:
        teacher_processing_class = load_tokenizer(teacher.config._name_or_path, trainer.args.trust_remote_code)
    if teacher_processing_class is None:
        compared = "nothing" if teacher is None else "only vocab_size"
        warnings.warn(
            f"The teacher's tokenizer is unknown, so {compared} was compared with the student's. Pass "
            "`teacher_processing_class` to check that both share one vocabulary.",
            stacklevel=4,
        )
    elif shared_vocabulary is None:
        shared_vocabulary = check_shared_vocabulary(
            trainer._tokenizer, teacher_processing_class, trainer.args.cross_tokenizer
        )
    if teacher is None:
        return teacher_processing_class, shared_vocabulary
    student_dtype = next(student.parameters()).dtype
    teacher_dtype = next(teacher.parameters()).dtype
    if student_dtype != teacher_dtype:
        warnings.warn(
            f"The student is in {student_dtype} and the teacher in {teacher_dtype}. Log-probabilities are computed "
            "in float32 either way, but a low-precision teacher shifts delta = log pi_T - log pi_old.",
            stacklevel=4,
        )
    return teacher_processing_class, shared_vocabulary


def _warn_on_off_policy_sampling(args):
    generation_kwargs = args.generation_kwargs or {}
    reasons = []
    if args.top_p < 1.0:
        reasons.append(f"top_p={args.top_p}")
    if args.top_k:
        reasons.append(f"top_k={args.top_k}")
    if args.min_p:
        reasons.append(f"min_p={args.min_p}")
    if args.repetition_penalty != 1.0:
        reasons.append(f"repetition_penalty={args.repetition_penalty}")
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if key in generation_kwargs:
            reasons.append(f"generation_kwargs[{key!r}]={generation_kwargs[key]}")
    if reasons:
        warnings.warn(
            f"Sampling with {', '.join(reasons)} draws tokens from a distribution other than pi_old at "
            f"temperature {args.temperature}, which the TV estimate and the advantages assume. The paper samples "
            "at temperature 1.0 and top-p 1.0.",
            stacklevel=4,
        )
