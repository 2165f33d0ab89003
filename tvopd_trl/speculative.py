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
"""The speculative-sampling acceptance rate of a draft q for a target p, measured and estimated.

`tv/acceptance` (`tvopd_trl.metrics`) reads 1 minus the on-policy TV estimate as the student's acceptance rate as a
speculative-sampling draft of the teacher: a drafted token y ~ q is accepted with probability min(1, p(y) / q(y)),
which is 1 - [1 - exp(delta)]_+ with delta = log p(y) - log q(y), and whose mean under q is sum_v min(p_v, q_v) =
1 - TV(p, q). This module checks that reading against transformers' own assisted generation:
`measure_assisted_acceptance` counts the drafted tokens its verifier tests and accepts, and `estimate_acceptance`
computes the library's estimate and the exact acceptance at the very states it tested. The rate depends on the states:
training measures it on the student's rollouts, while speculative decoding visits the target's own text.
"""

import copy
import math
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers.generation.utils as generation_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

from .tv import tv_estimate


@dataclass(frozen=True)
class AssistedAcceptance:
    """
    What an assisted generation run did, counted at its verifier.

    `tested` drafted tokens were tested, `accepted` of them were accepted; `acceptance` is their ratio and `interval`
    its Wilson score interval. `target_forwards` counts the target's forward passes (one per verification, and one
    per token it sampled alone when too little room was left to draft), `generated_tokens` the tokens added to the
    prompts; `tokens_per_forward`, their ratio, is what [`expected_tokens_per_verification`] predicts, and
    `wall_seconds` times the whole run. `sequences` holds each prompt's `(1, L)` prompt and generation, and
    `tested_mask` its `(1, L)` mask of the positions whose drafted token the verifier tested: the prefix before such a
    position is a tested state.
    """

    tested: int
    accepted: int
    acceptance: float
    interval: tuple[float, float]
    target_forwards: int
    generated_tokens: int
    tokens_per_forward: float
    wall_seconds: float
    sequences: list[torch.Tensor]
    tested_mask: list[torch.Tensor]


@dataclass(frozen=True)
class AcceptanceEstimate:
    """At `states` states: the library's on-policy acceptance estimate, 1 minus the pooled [1 - exp(delta)]_+ of one
    draft sample per state, and the `exact` mean of sum_v min(p_v, q_v)."""

    estimate: float
    exact: float
    states: int


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) without trials."""
    if trials == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    ratio = successes / trials
    center = (ratio + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(ratio * (1 - ratio) / trials + z * z / (4 * trials * trials))
    return max(center - half, 0.0), min(center + half, 1.0)


def expected_tokens_per_verification(acceptance: float, gamma: int) -> float:
    """
    Expected tokens one target forward yields when it verifies `gamma` drafted tokens: (1 - a^(gamma + 1)) / (1 - a)
    (Leviathan et al. 2023, eq. 1), `gamma + 1` at a = 1.

    It assumes each drafted token is accepted independently with the same probability a = `acceptance`; real
    acceptances vary with the state, and a run also stops drafting at EOS and near its length limit, so a measured
    tokens-per-forward only approximates it.
    """
    if acceptance == 1:
        return float(gamma + 1)
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def truncated_draft(model, num_layers: int):
    """A copy of `model` that keeps its embeddings, final norm and head but only its first `num_layers` decoder
    layers: a draft of `model` that needs no training and shares its tokenizer."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    # Configs that type each layer (sliding or full attention) size the cache from this list
    if getattr(draft.config, "layer_types", None) is not None:
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    return draft


@contextmanager
def _drafting(draft, gamma: int):
    """`draft` drafts exactly `gamma` tokens per verification for the duration: a constant schedule, and a confidence
    threshold of 0. Left unset (None), the threshold takes transformers' default of 0.4, which stops a draft early
    whenever the draft's own probability of its token falls below it, and then retunes itself from the acceptances it
    observes."""
    saved = draft.generation_config
    draft.generation_config = copy.deepcopy(saved)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        draft.generation_config = saved


@contextmanager
def _recording_verifications(verifications: list):
    """Appends `(position, candidates, accepted)` to `verifications` for each call of transformers' speculative
    sampling verifier, which assisted decoding looks up in its module at each call."""
    original = generation_utils._speculative_sampling

    # (candidate_input_ids, candidate_logits, candidate_length, new_logits, is_done_candidate): transformers up to 5.2x
    # passes the last positionally, later releases by name
    def recording(*args, **kwargs):
        valid_tokens, n_matches = original(*args, **kwargs)
        candidate_input_ids, _, candidate_length = args[:3]
        verifications.append((candidate_input_ids.shape[1] - candidate_length, candidate_length, int(n_matches)))
        return valid_tokens, n_matches

    generation_utils._speculative_sampling = recording
    try:
        yield
    finally:
        generation_utils._speculative_sampling = original


def _conversation(prompt):
    """A prompt as chat messages: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _check_plain_user_turns(tokenizer, prompts):
    """Refuses a prompt that already holds the chat template's special tokens: templated twice, it would be measured
    at states no served request has."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False
    )
    markers = [token for token in tokenizer.all_special_tokens if token in rendered]
    for index, prompt in enumerate(prompts):
        found = [token for message in _conversation(prompt) for token in markers if token in message["content"]]
        if found:
            raise ValueError(
                f"Prompt {index} holds the chat template's {found[0]!r}: pass each prompt as the user turn's plain "
                "text, or as chat messages (measure_assisted_acceptance applies the chat template itself)."
            )


def _prompt_ids(tokenizer, prompt, device):
    ids = tokenizer.apply_chat_template(
        _conversation(prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return ids.to(device)


def _sampling(tokenizer, temperature, max_new_tokens):
    """`generate`'s keywords: sampling at `temperature` with nothing truncated."""
    return dict(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )


def measure_assisted_acceptance(
    target,
    draft,
    tokenizer,
    prompts: list,
    gamma: int,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
    confidence: float = 0.95,
) -> AssistedAcceptance:
    """
    Runs transformers' assisted generation of `target` with `draft` drafting `gamma` tokens per verification, sampling
    at `temperature` with nothing truncated (top-k and top-p off), on each of `prompts` (a user turn's plain text, or
    chat messages) with the chat template applied, and counts the drafted tokens its verifier tested and accepted.

    A verification of k candidates that accepts the first n tests n + 1 of them when n < k (the first rejection ends
    it) and all k otherwise. k is `gamma` except where the draft stopped at EOS or where too little room was left
    before `max_new_tokens`; with no room at all the target samples its token alone, testing nothing. The bonus token
    sampled after k acceptances is the target's, not a drafted one, and is not counted.
    """
    if draft is target:
        raise ValueError("The draft must be a model of its own: the target's forward passes are counted by a hook.")
    _check_plain_user_turns(tokenizer, prompts)
    verifications = []
    sequences, tested_masks = [], []
    generated = 0
    target_forwards = []
    hook = target.register_forward_hook(lambda *_: target_forwards.append(None))
    torch.manual_seed(seed)
    start = time.perf_counter()
    try:
        with _drafting(draft, gamma), _recording_verifications(verifications), torch.no_grad():
            for prompt in prompts:
                input_ids = _prompt_ids(tokenizer, prompt, target.device)
                first = len(verifications)
                output = target.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    assistant_model=draft,
                    **_sampling(tokenizer, temperature, max_new_tokens),
                )
                tested_mask = torch.zeros_like(output, dtype=torch.bool)
                for position, candidates, accepted in verifications[first:]:
                    tested_mask[0, position : position + min(accepted + 1, candidates)] = True
                generated += output.shape[1] - input_ids.shape[1]
                sequences.append(output.cpu())
                tested_masks.append(tested_mask.cpu())
    finally:
        hook.remove()
    wall_seconds = time.perf_counter() - start
    tested = sum(min(accepted + 1, candidates) for _, candidates, accepted in verifications)
    accepted = sum(accepted for *_, accepted in verifications)
    return AssistedAcceptance(
        tested=tested,
        accepted=accepted,
        acceptance=accepted / tested if tested else float("nan"),
        interval=wilson_interval(accepted, tested, confidence),
        target_forwards=len(target_forwards),
        generated_tokens=generated,
        tokens_per_forward=generated / len(target_forwards) if target_forwards else float("nan"),
        wall_seconds=wall_seconds,
        sequences=sequences,
        tested_mask=tested_masks,
    )


def estimate_acceptance(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    samples_per_state: int = 1,
    generator: torch.Generator | None = None,
) -> AcceptanceEstimate:
    """
    The on-policy acceptance estimate and the exact acceptance of `draft` for `target` at the states of `input_ids`
    that `mask` marks, both models at `temperature`.

    `mask` (`(B, T)`) marks token positions, as a completion mask does: position t stands for the state
    `input_ids[:, :t]`, whose next-token distributions come from the logits at t - 1 (so `mask[:, 0]` must be
    False). One teacher-forced forward of each model over the whole batch gives p_T and q_T at every marked state;
    there `samples_per_state` tokens y ~ q_T are drawn with `generator` (training draws one: more only shrink the
    estimate's own sampling noise), and [1 - exp(log p_T(y) - log q_T(y))]_+ is pooled by
    [`~tvopd_trl.tv.tv_estimate`] as in training. Padding may sit on either side: positions follow `attention_mask`.
    """
    if mask[:, 0].any():
        raise ValueError("mask[:, 0] marks a state before the first token: it has no logits to come from.")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    states = mask[:, 1:].bool()
    with torch.no_grad():
        target_logits = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        draft_logits = draft(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    target_logps = (target_logits[:, :-1][states].float() / temperature).log_softmax(-1)
    draft_logps = (draft_logits[:, :-1][states].float() / temperature).log_softmax(-1)
    samples = torch.multinomial(draft_logps.exp(), samples_per_state, replacement=True, generator=generator)
    tv_sum, count = tv_estimate(
        target_logps.gather(-1, samples), draft_logps.gather(-1, samples), torch.ones_like(samples)
    )
    exact = torch.minimum(target_logps.exp(), draft_logps.exp()).double().sum(-1).mean()
    return AcceptanceEstimate(
        estimate=1.0 - float(tv_sum) / int(count) if count else float("nan"),
        exact=float(exact),
        states=int(states.sum()),
    )


def _samples(model, tokenizer, prompts: list, temperature: float, max_new_tokens: int, seed: int):
    """`(prompt ids, prompt and sampled completion)` of `model` alone for each of `prompts`, one at a time, sampled as
    [`measure_assisted_acceptance`] samples."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for prompt in prompts:
            input_ids = _prompt_ids(tokenizer, prompt, model.device)
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **_sampling(tokenizer, temperature, max_new_tokens),
            )
            yield input_ids, output[0]


def generation_speed(
    target, tokenizer, prompts: list, temperature: float, max_new_tokens: int, seed: int = 0
) -> float:
    """Tokens a second that `target` generates alone on `prompts`: the baseline of a draft's speedup."""
    start = time.perf_counter()
    sampled = _samples(target, tokenizer, prompts, temperature, max_new_tokens, seed)
    generated = sum(len(output) - input_ids.shape[1] for input_ids, output in sampled)
    return generated / (time.perf_counter() - start)


def own_state_acceptance(
    target, draft, tokenizer, prompts: list, temperature: float, max_new_tokens: int, seed: int = 0
) -> AcceptanceEstimate:
    """[`estimate_acceptance`] at the states of `draft`'s own samples on `prompts` (one completion a prompt): the rate
    `tv/acceptance` reads in training, on other prompts, beside the exact mean of sum_v min(p_v, q_v) there."""
    rows = []
    for input_ids, output in _samples(draft, tokenizer, prompts, temperature, max_new_tokens, seed):
        completion = output[input_ids.shape[1] :]
        # Up to and with the end of turn: generate pads a finished row
        ends = (completion == tokenizer.eos_token_id).nonzero()
        length = int(ends[0]) + 1 if len(ends) else len(completion)
        rows.append((output[: input_ids.shape[1] + length], input_ids.shape[1]))
    width = max(len(row) for row, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=torch.long)  # masked out
    attention_mask = torch.zeros_like(input_ids)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for index, (row, prompt_length) in enumerate(rows):
        input_ids[index, : len(row)], attention_mask[index, : len(row)] = row, 1
        mask[index, prompt_length : len(row)] = True
    generator = torch.Generator().manual_seed(seed)
    return estimate_acceptance(target, draft, input_ids, attention_mask, mask, temperature, generator=generator)


def draft_report(
    target,
    draft,
    tokenizer,
    prompts: list,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    target_speed: float,
    seed: int = 0,
) -> dict:
    """`draft`'s measured acceptance rate for `target` on `prompts` ([`measure_assisted_acceptance`]) as a summary's
    record: the rate, its 95% interval and the drafted tokens tested; the tokens each target forward yielded, beside
    [`expected_tokens_per_verification`]'s prediction at that rate; the assisted generation's tokens a second, with
    its speedup over `target_speed` ([`generation_speed`]), which depends on the hardware; and the rate at the states
    of the draft's own samples on the same prompts ([`own_state_acceptance`]: the estimate `tv/acceptance` reads, and
    the exact rate), which for a draft far from its target differs from the measured one."""
    measured = measure_assisted_acceptance(
        target, draft, tokenizer, prompts, gamma, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed
    )
    speed = measured.generated_tokens / measured.wall_seconds
    own = own_state_acceptance(target, draft, tokenizer, prompts, temperature, max_new_tokens, seed)
    return {
        "acceptance": measured.acceptance,
        "interval": list(measured.interval),
        "tested": measured.tested,
        "gamma": gamma,
        "tokens_per_forward": measured.tokens_per_forward,
        "expected_tokens_per_verification": expected_tokens_per_verification(measured.acceptance, gamma),
        "tokens_per_second": speed,
        "speedup": speed / target_speed,
        "own_state_estimate": own.estimate,
        "own_state_exact": own.exact,
        "own_states": own.states,
    }


def truncated_draft_dir(target_dir, num_layers: int, output_dir) -> str:
    """The folder of [`truncated_draft`] of the model at `target_dir`, with its tokenizer: `output_dir`, written there
    on first use (in a sibling folder renamed into place when whole)."""
    output_dir = str(output_dir)
    if os.path.isfile(os.path.join(output_dir, "config.json")):
        return output_dir
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=".draft-")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    truncated_draft(target, num_layers).save_pretrained(staging)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(staging)
    try:
        os.rename(staging, output_dir)
    except OSError:  # another process put it there first
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
