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
"""Checks that catch silent teacher-scoring bugs before a run (`tvopd-trl doctor`).

OPD's advantages are built from delta = log pi_T(y) - log pi_old(y) on tokens sampled from pi_old, and nothing in a
training run tells a wrong delta from a right one: a teacher that sees another chat template, runs in another dtype,
or scores at another temperature than the sampler still produces numbers. The doctor runs the trainer's own
generation and scoring path on a few prompts and tests what must hold exactly:

- the student scored as its own teacher (loaded through the teacher's path) gives delta = 0;
- the sampled tokens are draws from pi_old at the scoring `temperature`: with H_t the entropy and V_t the variance of
  log pi_old under pi_old at position t, z = sum_t (log pi_old(y_t) + H_t) / sqrt(sum_t V_t) is standard normal;
- the on-policy TV estimate [1 - exp(delta)]_+ is unbiased for the exact TV: the same z-test on X_t - TV_t.

Plus the static checks: one vocabulary and special tokens, the same chat template, no teacher mass on padded
vocabulary rows, and the dtypes.
"""

import dataclasses
import tempfile
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer, set_seed

from .cross_tokenizer import TokenizerAlignment
from .teachers import TEACHER_PROMPT_COLUMN
from .tokenizers import check_shared_vocabulary
from .tv import tv_estimate


PASS, FAIL, WARN, INFO, SKIP = "PASS", "FAIL", "WARN", "INFO", "SKIP"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


# ----------------------------------------------------------------------------------------------------------------------
# Pure statistics
# ----------------------------------------------------------------------------------------------------------------------


def sampling_moments(log_probs: torch.Tensor, tokens: torch.Tensor):
    """Per position of `(T, V)` log-distributions and `(T,)` sampled tokens: (log p(y), entropy, variance of log p)."""
    probs = log_probs.exp()
    finite = torch.where(probs > 0, log_probs, 0.0)  # 0 * -inf is 0 here, not NaN
    entropy = -(probs * finite).sum(-1)
    variance = (probs * finite**2).sum(-1) - entropy**2
    return log_probs.gather(-1, tokens[:, None]).squeeze(-1), entropy, variance.clamp_min(0.0)


def z_score(deviations: torch.Tensor, variances: torch.Tensor) -> float:
    """sum(deviations) / sqrt(sum(variances)): standard normal when the deviations have conditional mean 0."""
    total = variances.sum()
    return float(deviations.sum() / total.sqrt()) if total > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------------------------
# Static checks: tokenizers and configs, no weights
# ----------------------------------------------------------------------------------------------------------------------


def check_tokenizers(student, teacher, cross_tokenizer=False):
    try:
        if check_shared_vocabulary(student, teacher, cross_tokenizer):
            return Check("tokenizers", PASS, f"one vocabulary of {len(student)} tokens, same special-token ids")
        TokenizerAlignment(student, teacher, [student.eos_token_id])  # its setup checks
    except ValueError as error:
        return Check(
            "tokenizers",
            FAIL,
            str(error).split(". Set `cross_tokenizer")[0] + ".",
            "Use a teacher of the student's family, or set `cross_tokenizer=True`.",
        )
    return Check(
        "tokenizers",
        PASS,
        f"another vocabulary ({len(teacher)} tokens): the teacher scores its own tokenization of each completion, "
        "aligned on spans (cross_tokenizer)",
    )


def check_chat_templates(student, teacher, prompts):
    """The trainer renders prompts with the student's template and the teacher scores those ids as they are."""
    conversational = [p for p in prompts if isinstance(p, list)]
    if not conversational:
        return Check("chat template", PASS, "prompts are plain text: no chat template is applied")
    if teacher.chat_template is None:
        return Check("chat template", WARN, "the teacher's tokenizer has no chat template to compare with")
    differing = 0
    for messages in conversational:
        rendered = [
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for tokenizer in (student, teacher)
        ]
        differing += rendered[0] != rendered[1]
    if differing:
        return Check(
            "chat template",
            FAIL,
            f"{differing} of {len(conversational)} prompts render differently under the teacher's chat template: the "
            "teacher scores prompts in a format it was not trained on",
            "Give the student's tokenizer the teacher's template (`tokenizer.chat_template = "
            "teacher_tokenizer.chat_template`, saved with the student), or pick a teacher with the student's format.",
        )
    return Check("chat template", PASS, f"{len(conversational)} prompts render identically")


def check_vocab_sizes(student_config, teacher_config, tokenizer_size):
    student_size = student_config.get_text_config().vocab_size
    teacher_size = teacher_config.get_text_config().vocab_size
    if min(student_size, teacher_size) < tokenizer_size:
        return Check(
            "vocabulary size",
            FAIL,
            f"the output layers have {student_size} (student) and {teacher_size} (teacher) rows, fewer than the "
            f"tokenizer's {tokenizer_size} tokens",
            "Use checkpoints whose output layers cover the tokenizer (`model.resize_token_embeddings(n)`, saved).",
        )
    if student_size != teacher_size:
        return Check(
            "vocabulary size",
            PASS,
            f"student {student_size} rows, teacher {teacher_size}, over the tokenizer's {tokenizer_size} tokens: padded "
            "siblings (the student never samples a padded id; see the padded-vocabulary check for the mass there)",
        )
    padding = f"{student_size - tokenizer_size} padded rows beyond the tokenizer's {tokenizer_size} tokens"
    return Check(
        "vocabulary size", PASS, f"both {student_size}" + (f" ({padding})" if student_size > tokenizer_size else "")
    )


# ----------------------------------------------------------------------------------------------------------------------
# Checks on the trainer's own rollouts
# ----------------------------------------------------------------------------------------------------------------------


def rollouts(trainer, prompts, exact_divergences=False):
    """The trainer's generation and teacher scoring on `prompts`, plus pi_old's log-probs of the sampled tokens (and,
    with `exact_divergences`, the exact per-state `exact_tv` and `reverse_kl` of a local teacher)."""
    set_seed(trainer.args.seed)
    batch = trainer.score_completions(
        trainer.generate_completions(prompts), old_logps=True, exact_divergences=exact_divergences
    )
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    batch["input_ids"], batch["attention_mask"], batch["keep"] = ids, mask, keep
    batch["active"] = batch["completion_mask"].bool()
    return batch


def _position_log_probs(model, batch, row, temperature):
    """Full-vocabulary float32 `(keep, V)` log-distributions of one row at the completion positions."""
    keep = batch["keep"]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"][row : row + 1], attention_mask=batch["attention_mask"][row : row + 1]
        ).logits
    return torch.log_softmax(logits[0, -keep - 1 : -1].float() / temperature, dim=-1)


def check_self_delta(batch, tolerance, student_dtype, teacher_dtype):
    active = batch["active"]
    gap = (batch["teacher_logps"] - batch["old_logps"]).abs()[active]
    worst = float(gap.max()) if gap.numel() else 0.0
    detail = f"max |delta| {worst:.2e} over {int(active.sum())} tokens (tolerance {tolerance:g})"
    if worst <= tolerance:
        return Check("self-delta", PASS, detail)
    cause = "the teacher path scores the same weights differently"
    fix = "Load the teacher as the student is loaded (same `dtype`, no quantization) and score both with one path."
    if student_dtype != teacher_dtype:
        cause = f"the teacher path loads the weights in {teacher_dtype}, the student in {student_dtype}"
        fix = "Set the same `dtype` in `model_init_kwargs` and `teacher_model_init_kwargs`."
    return Check("self-delta", FAIL, f"{detail}: {cause}", fix)


def check_sampling(model, batch, temperature, z_threshold):
    """Are the sampled tokens draws from pi_old at `temperature`? Also: does the full softmax match the fused head?"""
    deviations, variances, head_gap = [], [], 0.0
    for row in range(batch["input_ids"].size(0)):
        active = batch["active"][row]
        if not active.any():
            continue
        log_probs = _position_log_probs(model, batch, row, temperature)
        sampled, entropy, variance = sampling_moments(log_probs, batch["completion_ids"][row])
        deviations.append((sampled + entropy)[active])
        variances.append(variance[active])
        head_gap = max(head_gap, float((sampled - batch["old_logps"][row]).abs()[active].max()))
    deviation, variance = torch.cat(deviations), torch.cat(variances)
    z = z_score(deviation, variance)
    detail = (
        f"z = {z:+.2f} over {deviation.numel()} tokens (|z| <= {z_threshold:g} expected); mean log pi_old(y) "
        f"{float(deviation.mean()):+.3f} nats from its expectation; full softmax vs fused head: {head_gap:.1e}"
    )
    if variance.sum() < 1.0:
        return Check("sampling temperature", WARN, detail + ": too little randomness to test", "Use more prompts.")
    if abs(z) > z_threshold:
        direction = "less" if z < 0 else "more"
        return Check(
            "sampling temperature",
            FAIL,
            f"{detail}: the sampled tokens are {direction} likely than draws from pi_old at temperature "
            f"{temperature} would be, so the rollouts come from another distribution",
            "Sample at the scoring `temperature`: drop `temperature`, `top_p`, `top_k`, `min_p` and "
            "`repetition_penalty` from `generation_kwargs` and the sampling fields (or accept off-policy rollouts).",
        )
    return Check("sampling temperature", PASS, detail)


def check_padded_vocabulary(teacher, batch, tokenizer_size, temperature, tolerance=1e-3):
    vocab_size = teacher.config.get_text_config().vocab_size
    if vocab_size <= tokenizer_size:
        return Check("padded vocabulary", PASS, "no rows beyond the tokenizer's tokens")
    worst = 0.0
    for row in range(batch["input_ids"].size(0)):
        log_probs = _position_log_probs(teacher, batch, row, temperature)[batch["active"][row]]
        if log_probs.numel():
            worst = max(worst, float(log_probs[:, tokenizer_size:].logsumexp(-1).exp().max()))
    detail = f"the teacher puts at most {worst:.2e} of its mass on the {vocab_size - tokenizer_size} padded ids"
    if worst > tolerance:
        return Check(
            "padded vocabulary",
            FAIL,
            detail + ": the student can never sample them, so delta and the TV estimate are biased",
            "Mask the padded rows of the teacher's output layer (set their bias/logits to -inf) or fix the checkpoint.",
        )
    return Check("padded vocabulary", PASS, detail)


def check_dtypes(student_dtype, teacher_dtype):
    if student_dtype == teacher_dtype:
        return Check("dtype", PASS, f"both {student_dtype}")
    return Check(
        "dtype",
        WARN,
        f"student {student_dtype}, teacher {teacher_dtype}: log-probs are float32 either way, but a lower-precision "
        "teacher adds noise to delta",
        "Load both in the same dtype unless memory forces otherwise.",
    )


def pair_report(trainer, batch, z_threshold):
    """Mean delta, the TV estimate and, with an in-process teacher, the exact TV and the estimator's consistency."""
    active = batch["active"]
    delta = (batch["teacher_logps"] - batch["old_logps"])[active]
    total, count = tv_estimate(batch["teacher_logps"], batch["old_logps"], active)
    estimate = float(total / count)
    summary = f"mean delta {float(delta.mean()):+.3f} nats (reverse KL estimate {float(-delta.mean()):.3f}); TV estimate {estimate:.3f}"
    if all(teacher.served for teacher in trainer.teachers.values()):
        return Check("teacher vs student", INFO, summary + " (served teacher: no exact TV)")
    exact = batch["exact_tv"]
    x = (1 - (batch["teacher_logps"] - batch["old_logps"]).exp()).clamp_min(0.0)[active]
    residual = x - exact[active]
    z = z_score(residual, residual**2)
    detail = f"{summary}; exact TV {float(exact[active].mean()):.3f}; estimate vs exact z = {z:+.2f}"
    if abs(z) > z_threshold:
        return Check(
            "teacher vs student",
            FAIL,
            detail + ": the on-policy TV estimate is biased, so the rollouts are not draws from pi_old",
            "See the sampling-temperature check.",
        )
    return Check("teacher vs student", PASS, detail)


# ----------------------------------------------------------------------------------------------------------------------
# The whole examination
# ----------------------------------------------------------------------------------------------------------------------


def _doctor_args(training_args, num_prompts, max_completion_length, output_dir):
    """The run's config, shrunk to one rollout of `num_prompts` prompts, in one process, writing nowhere that counts."""
    return dataclasses.replace(
        training_args,
        output_dir=output_dir,
        per_device_train_batch_size=num_prompts,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=min(training_args.max_completion_length, max_completion_length),
        report_to="none",
        push_to_hub=False,
    )


def _build(trainer_kwargs, **overrides):
    """A trainer, with its construction warnings (off-policy sampling, dtypes, ...) as WARN checks."""
    from .trainer import TVOPDTrainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = TVOPDTrainer(**(trainer_kwargs | overrides))
    notes = {str(w.message) for w in caught if issubclass(w.category, UserWarning)}
    return trainer, [Check("trainer warning", WARN, note) for note in sorted(notes)]


def diagnose(
    job_args, training_args, model_args, num_prompts=8, max_completion_length=128, tolerance=1e-3, z_threshold=5.0
):
    """Every check, in order, on the pair and prompts the main job would use with these arguments (`job_parser`'s).
    With several teachers, each teacher is checked against the student on the prompts routed to it, its checks named
    `check (teacher)`."""
    from .job import apply_model_config, load_job
    from .teachers import TEACHER_ID_COLUMN

    student_path, teacher_path, tokenizer, dataset = load_job(job_args, training_args, model_args)
    options = dict(
        model_options=apply_model_config(model_args, training_args),
        num_prompts=num_prompts,
        max_completion_length=max_completion_length,
        tolerance=tolerance,
        z_threshold=z_threshold,
    )
    if not isinstance(teacher_path, dict):
        return _diagnose_pair(training_args, student_path, teacher_path, tokenizer, dataset, **options)
    if training_args.teacher_model_server_url is not None:
        raise ValueError(
            "`tvopd-trl doctor` checks several teachers when they are local (`teacher_model_name_or_path`); check a "
            "served one on its own, with `teacher_model_server_url` set to its URL."
        )
    checks = []
    for name, path in teacher_path.items():
        routed = dataset.select([i for i, teacher in enumerate(dataset[TEACHER_ID_COLUMN]) if teacher == name])
        pair = _diagnose_pair(training_args, student_path, path, tokenizer, routed, **options)
        checks += [dataclasses.replace(check, name=f"{check.name} ({name})") for check in pair]
    return checks


def _diagnose_pair(
    training_args,
    student_path,
    teacher_path,
    tokenizer,
    dataset,
    model_options,
    num_prompts,
    max_completion_length,
    tolerance,
    z_threshold,
):
    prompts = [dataset[i] for i in range(min(num_prompts, len(dataset)))]
    checks = []
    remote_code = training_args.trust_remote_code
    teacher_tokenizer = (
        AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=remote_code) if teacher_path else None
    )
    own = training_args.self_distillation
    if own is not None:
        checks.append(Check("tokenizers", SKIP, f"the student is its own teacher (`self_distillation: {own}`)"))
    elif teacher_tokenizer is None:
        checks.append(Check("tokenizers", SKIP, "served teacher without `teacher_model_name_or_path`"))
    else:
        checks.append(check_tokenizers(tokenizer, teacher_tokenizer, training_args.cross_tokenizer))
    # A teacher of another tokenizer renders prompts with its own template and has its own output layer
    cross = teacher_tokenizer is not None and not check_shared_vocabulary(tokenizer, teacher_tokenizer, True)
    if teacher_tokenizer is not None and not cross:
        checks.append(check_chat_templates(tokenizer, teacher_tokenizer, [p["prompt"] for p in prompts]))
    served = training_args.teacher_model_server_url is not None
    if not served and not cross and own is None:
        checks.append(
            check_vocab_sizes(
                AutoConfig.from_pretrained(student_path, trust_remote_code=remote_code),
                AutoConfig.from_pretrained(teacher_path, trust_remote_code=remote_code),
                len(tokenizer),
            )
        )
    if any(c.status == FAIL for c in checks if c.name in ("tokenizers", "vocabulary size")):
        return checks + [Check("model checks", SKIP, "the pair cannot be trained as it is: fix the failures above")]

    with tempfile.TemporaryDirectory() as output_dir:
        args = _doctor_args(training_args, len(prompts), max_completion_length, output_dir)
        common = dict(
            model=student_path,
            train_dataset=dataset.select(range(len(prompts))),
            processing_class=tokenizer,
            **model_options,
        )
        # The student scored as its own teacher after its own prompts, where every delta is 0 up to numerics
        self_args = dataclasses.replace(args, teacher_model_server_url=None, self_distillation=None)
        trainer, _ = _build(common, args=self_args, teacher_model=student_path, teacher_processing_class=tokenizer)
        batch = rollouts(trainer, [{k: v for k, v in p.items() if k != TEACHER_PROMPT_COLUMN} for p in prompts])
        student_dtype = next(trainer.model.parameters()).dtype
        checks.append(
            check_self_delta(batch, tolerance, student_dtype, next(trainer.teacher_model.parameters()).dtype)
        )
        checks.append(check_sampling(trainer.model, batch, args.temperature, z_threshold))
        del trainer, batch

        trainer, notes = _build(
            common,
            args=args,
            teacher_model=None if served or own is not None else teacher_path,
            teacher_processing_class=teacher_tokenizer,
        )
        checks += notes
        batch = rollouts(trainer, prompts, exact_divergences=not served)
        if not served:  # the teacher's model: with `self_distillation: live`, the student's own
            (teacher,) = (t.model for t in trainer.teachers.values())
            checks.append(check_dtypes(student_dtype, next(teacher.parameters()).dtype))
            checks.append(check_padded_vocabulary(teacher, batch, len(tokenizer), args.temperature))
        checks.append(pair_report(trainer, batch, z_threshold))
    return checks
