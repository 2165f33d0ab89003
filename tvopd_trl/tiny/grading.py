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
"""Grading (last ``\\boxed{}`` checked with math-verify) and batched accuracy evaluation."""

import math

import torch
from math_verify import parse, verify


def last_boxed(text):
    """The content of the last ``\\boxed{...}`` in `text` (nested braces allowed), or `None`."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index]
    return None


def is_correct(response, answer):
    """Whether the last ``\\boxed{}`` of `response` is mathematically equal to `answer` (math-verify)."""
    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return False
    try:
        gold = parse(f"${answer}$")
        prediction = parse(f"${boxed}$")
        return bool(gold) and bool(prediction) and bool(verify(gold, prediction))
    except Exception:  # math-verify raises on some malformed inputs; those count as wrong
        return False


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts,
    k=1,
    temperature=0.6,
    top_p=0.95,
    top_k=20,
    greedy=False,
    max_new_tokens=16,
    batch_size=512,
    seed=0,
):
    """`k` responses per prompt (a list of chat-message lists), as a list of lists of strings."""
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    if greedy:
        k = 1
        sampling = dict(do_sample=False)
    else:
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    device = next(model.parameters()).device
    outputs = [[] for _ in prompts]
    expanded = [i for i in range(len(texts)) for _ in range(k)]
    try:
        # Seeded sampling that leaves the caller's random streams alone (`manual_seed` also reseeds CUDA).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(expanded), batch_size):
                rows = expanded[start : start + batch_size]
                batch = tokenizer(
                    [texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=False
                )
                batch = {key: value.to(device) for key, value in batch.items()}
                generated = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                new_tokens = generated[:, batch["input_ids"].size(1) :]
                completions = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
                for i, completion in zip(rows, completions, strict=True):
                    outputs[i].append(completion)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return outputs


def evaluate_accuracy(model, tokenizer, dataset, k=4, **generation_kwargs):
    """Mean accuracy over the problems of `dataset` (columns `prompt`, `answer`) and `k` samples each.

    `generation_kwargs` go to [`generate_responses`]; its defaults are the TV-OPD paper's evaluation sampling
    (temperature 0.6, top-p 0.95, top-k 20), and `greedy=True` takes one greedy response per problem instead."""
    responses = generate_responses(model, tokenizer, list(dataset["prompt"]), k=k, **generation_kwargs)
    scores = [is_correct(r, answer) for rs, answer in zip(responses, dataset["answer"], strict=True) for r in rs]
    return sum(scores) / len(scores) if scores else math.nan
