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
"""The embedded tool task: four-digit addition that the tiny models do with a Python tool, `add`.

``"Compute 4721 + 8635."`` is answered in two assistant turns around one tool result::

    <|im_start|>user\\nCompute 4721 + 8635.<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>{"name": "add", "arguments": {"a": 4721, "b": 8635}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n13356<|im_end|>\\n<|im_start|>assistant\\n\\boxed{13356}<|im_end|>

Sums of two four-digit numbers are out of reach of a model of the tiny pairs' size in a build's few hundred steps (the
default pair takes ~700 steps to learn two-digit ones), but copying is not: the operands into the call, the tool's
result into the answer (learned in ~250). The chat template (`CHAT_TEMPLATE`) is ChatML with tool calls as JSON
between ``<tool_call>`` markers and tool results as a ``tool`` turn, without the tool-definition system block of
Qwen's templates (many times the prompt's length, for every prompt); `RESPONSE_TEMPLATE`
is the transformers (>= 5.13) `response_template` that reads such a turn back into a message with `tool_calls`, as
TRL's tool loop does (`parse_response(tokenizer, ids, prefix=..., tools=[add])`). TRL sets a response template itself
only for chat templates it knows, so the family's tokenizers carry this one (`tokenizer_config.json`).

`evaluate_with_tool` runs TRL's loop with transformers `generate` (sample a turn, parse it, run the calls, append the
tool results as TRL does, sample the next turn) and grades the final assistant turn on its last ``\\boxed{}`` with
math-verify; `mistake` names what went wrong first in each wrong conversation.

The problems (``a, b`` in 1000..9999) are dealt by a seeded draw into splits like the other skills': ``"test"`` (500,
held out), ``"dev"`` (500, picks the student), ``"opd"`` (2,000 distillation prompts) and ``"sft"`` (20,000, the
supervised transcripts).
"""

import json
import random
import re
from collections import Counter

from .task import SPLITS


SPLIT_SEED = 4321
SPLIT_SIZES = {"test": 500, "dev": 500, "opd": 2000, "sft": 20_000}
OPERANDS = range(1000, 10_000)
MAX_NEW_TOKENS = 40  # a turn's budget: the calling turn is 33 tokens with its EOS, the answering one 8-9
# Rounds of calls (TRL's `max_tool_calling_iterations`): the teacher calls once, and a model that calls again after the
# result gets its second call run, as TRL's loop (no limit by default) would.
MAX_TOOL_ITERATIONS = 2
MISTAKE_KINDS = ("no_call", "unparsed_call", "failed_call", "wrong_arguments", "wrong_final_answer")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen3's response template (`trl.chat_template_utils.qwen3_template`) without the reasoning field: JSON calls between
# the markers, any other text before the end of the turn as the content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": TOOL_CALL_OPEN,
            "close": TOOL_CALL_CLOSE,
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


TOOLS = [add]


def _boxed(value):
    return f"\\boxed{{{value}}}"


def question(a, b):
    return f"Compute {a} + {b}."


def transcript(a, b):
    """The reference conversation: the question, the call, the tool's result and the boxed answer."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": str(add(a, b))},
        {"role": "assistant", "content": _boxed(add(a, b))},
    ]


def _split_pairs(split):
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {SPLITS}.")
    # 81 million operand pairs: a seeded draw of distinct pair indices, dealt into the splits in order.
    size = len(OPERANDS)
    drawn = random.Random(SPLIT_SEED).sample(range(size * size), sum(SPLIT_SIZES.values()))
    start = 0
    for name in SPLITS:
        if name == split:
            return [(OPERANDS[i // size], OPERANDS[i % size]) for i in drawn[start : start + SPLIT_SIZES[name]]]
        start += SPLIT_SIZES[name]


def call_text(a, b):
    """The calling turn's text, as the chat template renders it (the call as JSON between the markers)."""
    return TOOL_CALL_OPEN + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + TOOL_CALL_CLOSE


def problems(split):
    """The problems of `split` as dicts with keys `a`, `b`, `question`, `answer`, `call` (the calling turn's text) and
    `response` (the final turn's), in a fixed order; `transcript(a, b)` has the reference conversation. (Strings only:
    20,000 rows of nested messages would set off the garbage collector's full passes over torch's objects, 2.5 s.)"""
    return [
        {
            "a": a,
            "b": b,
            "question": question(a, b),
            "answer": str(add(a, b)),
            "call": call_text(a, b),
            "response": _boxed(add(a, b)),
        }
        for a, b in _split_pairs(split)
    ]


def prompt_dataset(split, n=None):
    """A `datasets.Dataset` with a conversational `prompt` column (one user turn) and a `solution` column (the sum),
    for a trainer with `tools=TOOLS`. `n` keeps the first `n` problems of the split (its order is fixed)."""
    from datasets import Dataset

    rows = problems(split)[:n]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": row["question"]}] for row in rows],
            "solution": [row["answer"] for row in rows],
        }
    )


def transcript_texts(tokenizer, rows):
    """The reference transcripts of `rows` rendered by `tokenizer`'s chat template, each ended by its last EOS (the
    template's line break after it is no token a model generates)."""
    texts = tokenizer.apply_chat_template([transcript(row["a"], row["b"]) for row in rows], tokenize=False)
    return [text.removesuffix("\n") for text in texts]


def assistant_spans(text, eos_token="<|im_end|>", anchor="<|im_start|>assistant\n"):
    """`[(piece, trained), ...]` covering a rendered conversation up to its last EOS: each assistant turn (after its
    header, through its EOS) is trained, the rest (prompt, headers, tool results) is not, as in TRL's tool loop."""
    pieces, position = [], 0
    for match in re.finditer(re.escape(anchor) + r"(.*?" + re.escape(eos_token) + ")", text, re.DOTALL):
        pieces += [(text[position : match.start(1)], False), (match.group(1), True)]
        position = match.end(1)
    return pieces


def _tool_suffix_ids(tokenizer, tool_messages):
    """The tokens TRL appends after a calling turn's EOS (`DistillationTrainer._get_tool_suffix_ids`): the tool
    results and the next assistant header, rendered by the chat template."""
    dummy = [
        {"role": "user", "content": "dummy"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}],
        },
    ]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prefix = prefix[: len(prefix) - prefix[::-1].index(tokenizer.eos_token_id)]
    return full[len(prefix) :]


def _run_calls(calls):
    """TRL's execution of one turn's calls: `(tool messages, results, failures)`, a failure's result being an error."""
    tools, messages, results, failures = {tool.__name__: tool for tool in TOOLS}, [], [], 0
    for call in calls:
        function = call["function"]
        try:
            if function["name"] not in tools:
                raise ValueError(f"Tool {function['name']} not found.")
            result = tools[function["name"]](**function["arguments"])
        except Exception as error:
            failures += 1
            result = {"error": str(error)}
        results.append(result)
        messages.append({"role": "tool", "name": function["name"], "content": str(result)})
    return messages, results, failures


def _generate(model, tokenizer, sequences, max_new_tokens, sampling, seed, batch_size):
    """One turn for each token sequence: the sampled ids, through the EOS when there is one, within the model's
    positions."""
    import torch

    outputs, device = [], next(model.parameters()).device
    positions = model.config.max_position_embeddings
    for batch_index, start in enumerate(range(0, len(sequences), batch_size)):
        batch = sequences[start : start + batch_size]
        length = max(map(len, batch))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (length - len(s)) + s for s in batch], device=device)
        attention_mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in batch], device=device)
        torch.manual_seed(hash((seed, batch_index)) % 2**63)
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=min(max_new_tokens, positions - length),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
        for row in generated[:, length:].tolist():
            outputs.append(row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return outputs


def run_tool_loop(
    model,
    tokenizer,
    prompts,
    sampling,
    seed=0,
    max_new_tokens=MAX_NEW_TOKENS,
    batch_size=512,
    max_iterations=MAX_TOOL_ITERATIONS,
):
    """TRL's tool loop (`DistillationTrainer._tool_call_loop`) with transformers `generate`: samples a turn for each
    chat prompt, parses it (`trl.chat_template_utils.parse_response`, with the tokenizer's response template), runs
    its calls, appends the turn's EOS-ended ids and the chat template's tool suffix, and samples the next turn, for up
    to `max_iterations` rounds of calls. As in TRL, a conversation whose tool results would not fit the model's
    positions ends with its calling turn. Returns one record per prompt: `turns` (the parsed assistant messages),
    `texts` (each turn as generated), `results` (the tool results of each round), `calls` and `failures` (counts),
    and `ids` (prompt and conversation, as the next turn would see it)."""
    from trl.chat_template_utils import parse_response

    records = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        records.append({"turns": [], "texts": [], "results": [], "calls": 0, "failures": 0, "ids": ids})
    active = list(range(len(records)))
    for iteration in range(max_iterations + 1):
        turns = _generate(
            model,
            tokenizer,
            [records[i]["ids"] for i in active],
            max_new_tokens,
            sampling,
            hash((seed, iteration)),
            batch_size,
        )
        calling = []
        for i, turn in zip(active, turns, strict=True):
            record = records[i]
            message = parse_response(tokenizer, turn, prefix=record["ids"], tools=TOOLS)
            record["turns"].append(message)
            record["texts"].append(tokenizer.decode(turn))
            record["ids"] = record["ids"] + turn
            if message.get("tool_calls") and iteration < max_iterations:
                tool_messages, results, failures = _run_calls(message["tool_calls"])
                record["results"].append(results)
                record["calls"] += len(results)
                record["failures"] += failures
                suffix = _tool_suffix_ids(tokenizer, tool_messages)
                if len(record["ids"]) + len(suffix) < model.config.max_position_embeddings:
                    record["ids"] = record["ids"] + suffix
                    calling.append(i)
        active = calling
        if not active:
            break
    return records


def mistake(record, answer):
    """What went wrong first in a conversation whose final answer is not `answer` (the sum): `"no_call"` (the first
    turn has no call marker: it answered in its head, or said nothing), `"unparsed_call"` (a marker, but no call the
    response template reads: bad JSON, a cut turn), `"failed_call"` (the tool raised: unknown name, missing or extra
    arguments), `"wrong_arguments"` (the calls ran, and none returned the sum) or `"wrong_final_answer"` (a call
    returned the sum, but the last turn does not box it)."""
    if TOOL_CALL_OPEN not in record["texts"][0]:
        return "no_call"
    if not record["results"]:
        return "unparsed_call"
    results = [result for round_results in record["results"] for result in round_results]
    if all(isinstance(result, dict) for result in results):
        return "failed_call"
    if str(answer) not in map(str, results):
        return "wrong_arguments"
    return "wrong_final_answer"


def _sample_conversations(model, tokenizer, prompts, sampling, seed, max_new_tokens, batch_size):
    """`run_tool_loop` in eval mode, under a forked RNG: training continues the same without it."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            return run_tool_loop(model, tokenizer, prompts, sampling, seed, max_new_tokens, batch_size)
    finally:
        model.train(was_training)


def _final_answer_text(record):
    return record["turns"][-1].get("content") or ""


def tool_frequencies(records):
    """TRL's `tools/call_frequency` (calls per conversation) and `tools/failure_frequency` (failed calls per call) of
    `run_tool_loop`'s records."""
    calls = sum(record["calls"] for record in records)
    return {
        "call_frequency": calls / len(records),
        "failure_frequency": sum(record["failures"] for record in records) / calls if calls else 0.0,
    }


def _sampling(greedy, temperature, top_p, top_k):
    if greedy:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)


class ToolLoopGenerator:
    """[`~tvopd_trl.eval.TransformersGenerator`]'s call through `run_tool_loop` with the `add` tool, for the
    `tiny-tools` benchmark: each response is the last assistant turn's text (what `evaluate_with_tool` grades), and
    `stats` holds the last call's `tool_frequencies`. It generates in one process (`shard` of one): the tool loop's
    turns are not collectives."""

    def __init__(self, model, tokenizer, batch_size=64):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stats = None

    def __call__(self, prompts, settings, shard=(0, 1)):
        if shard[1] > 1:
            raise ValueError(
                "The embedded tool task is evaluated in one process; run the job on one process, or set "
                "`eval_problems: 0` and score the saved model with `tvopd-trl eval --benchmarks tiny-tools`."
            )
        if settings.chat_template_kwargs:
            raise ValueError(
                "The embedded tool task's chat template takes no `chat_template_kwargs`: leave them unset."
            )
        greedy = settings.temperature == 0
        samples = 1 if greedy else settings.k
        sampling = _sampling(greedy, settings.temperature, settings.top_p, settings.top_k)
        records = _sample_conversations(
            self.model,
            self.tokenizer,
            [prompt for prompt in prompts for _ in range(samples)],
            sampling,
            settings.seed,
            settings.max_new_tokens,
            self.batch_size,
        )
        self.stats = tool_frequencies(records)
        texts = [_final_answer_text(record) for record in records]
        responses = [texts[i * samples : (i + 1) * samples] for i in range(len(prompts))]
        return [row * settings.k for row in responses] if greedy else responses


def tiny_tools_benchmark():
    """The tool task's held-out split, registered as `"tiny-tools"`: answered through the tool loop
    (`ToolLoopGenerator`), up to `MAX_NEW_TOKENS` per turn."""
    from ..eval.benchmarks import Benchmark, Problem

    def load():
        return [Problem(f"{p['a']}+{p['b']}", p["question"], p["answer"]) for p in problems("test")]

    return Benchmark("tiny-tools", "Tiny-tools", prompt_template="{problem}", loader=load, generator=ToolLoopGenerator)


def evaluate_with_tool(
    model, tokenizer, split="test", k=4, greedy=False, seed=0, n=None, batch_size=512, max_new_tokens=MAX_NEW_TOKENS
):
    """Accuracy with the `add` tool on `split` (its first `n` problems), mean@k at the paper's sampling settings (T=0.6,
    top-p 0.95, top-k 20) or greedy: each conversation of `run_tool_loop` graded on the last ``\\boxed{}`` of its last
    assistant turn with math-verify. Returns `{"accuracy", "call_frequency", "failure_frequency", "mistakes"}`: calls
    per conversation and failed calls per call (TRL's `tools/call_frequency` and `tools/failure_frequency`), and the
    wrong conversations counted by `mistake` kind. Grades in the calling thread, which must be the main one
    (math-verify's alarm, `tvopd_trl.eval.grade_answer`)."""
    from ..eval import grade_answer, last_boxed
    from ..eval.generation import PAPER_TEMPERATURE, PAPER_TOP_K, PAPER_TOP_P

    rows = problems(split)[:n]
    samples = 1 if greedy else k
    sampling = _sampling(greedy, PAPER_TEMPERATURE, PAPER_TOP_P, PAPER_TOP_K)
    prompts = [[{"role": "user", "content": row["question"]}] for row in rows for _ in range(samples)]
    golds = [row["answer"] for row in rows for _ in range(samples)]
    records = _sample_conversations(model, tokenizer, prompts, sampling, seed, max_new_tokens, batch_size)
    answers = [last_boxed(_final_answer_text(record)) for record in records]
    # In this process, whose math-verify stays imported and its parses cached from one evaluation to the next: a pool
    # of workers (`tvopd_trl.eval.grade`) would start anew for each of a build's dev evaluations (2.6 s against 0.5).
    correct = [grade_answer(answer, gold) == "correct" for answer, gold in zip(answers, golds, strict=True)]
    kinds = Counter(mistake(r, gold) for r, gold, right in zip(records, golds, correct, strict=True) if not right)
    return {
        "accuracy": sum(correct) / len(correct),
        **tool_frequencies(records),
        "mistakes": {kind: kinds[kind] for kind in MISTAKE_KINDS},
    }
