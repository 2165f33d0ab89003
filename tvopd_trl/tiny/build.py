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
"""Builds the embedded default teacher/student pair from scratch, on one CPU core, deterministically.

    OMP_NUM_THREADS=1 python -m tvopd_trl.tiny.build --output-dir DIR

1. Trains a Qwen2-style byte-level BPE tokenizer (``tokenizers``, 300 tokens) on the task text: Qwen2's
   pre-tokenization, so every digit is one token; ``<|im_start|>`` / ``<|im_end|>`` chat markers, ``<|im_end|>`` as
   EOS, ``<|endoftext|>`` as padding, left padding.
2. Trains a Qwen2 model (hidden 64, 2 layers, 4 heads, MLP 256, tied embeddings: 150,976 parameters, 0.6 MB) from
   scratch with the supervised next-token loss on the responses of the ``"sft"`` split: AdamW (lr 3e-3, weight decay
   0.1), batch 128, 100 warmup steps, constant to step 600, cosine decay to step 1,500. Addition is learned in a sharp
   transition after a long plateau: with the default seed, dev accuracy sits near 10-20% until step ~700 and
   passes 75% by step ~760.
3. Every 10 steps it measures the accuracy on the ``"dev"`` split (one sample per problem at the evaluation settings)
   until that accuracy first exceeds ``--student-max-dev-accuracy`` (0.30): the last checkpoint at or below it (step
   710 with the default seed) is saved as ``DIR/student``; the final model as ``DIR/teacher``. Same architecture and
   tokenizer, nearly the same weights, mistakes concentrated on the answer digits.
4. After the student, dev accuracy (mean@4 now: one sample per problem is too noisy here) is measured at every step
   until it first reaches 0.67 (``weak_teacher``'s ``dev_accuracy`` window, 0.67-0.74; a checkpoint past its high
   end stops the build): that checkpoint is saved as ``DIR/weak_teacher``, an imperfect teacher of the same run, and
   its held-out mean@4 must lie in 0.60-0.75 (the build fails otherwise). Dev runs a few points above held-out in the
   transition (dev mean@4 0.63 at a checkpoint that is 0.59 held out), hence the window's low end.

All three directories load with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. The
held-out accuracies of each (k=4 samples at temperature 0.6, top-p 0.95, top-k 20; and greedy) and the wall time are
printed and written to ``DIR/build.json``. Training does not depend on the evaluations (they sample under a forked RNG:
builds that evaluate every 1 or 2 steps after the student write the same student and teacher), and the result is
bit-identical from run to run on one software stack. Measured for the shipped student and teacher (one core of the
2-core CPU box, torch 2.13, transformers 5.24): 251 s; teacher 1.000 (k=4) / 1.000 (greedy), student 0.332 / 0.384.
The current stack (torch 2.13.0+cpu, transformers 5.24.0) trains a different course from the same seed (student step
570, 0.223 / 0.244; teacher 1.000 / 1.000), and the shipped weak teacher comes from that rebuild: step 623 (dev 0.680),
held-out 0.649 (k=4) / 0.722 (greedy), 254 s for the whole build (``build.json``'s ``weak_teacher_build``).

The multi-teacher family (``--family multi-teacher``: ``DIR/student``, ``DIR/addition``, ``DIR/subtraction``) reuses
the tokenizer (unchanged: its corpus already holds every token of ``"Compute 86 - 47."``), the architecture and the
optimizer:

1. One model trained from scratch on both skills' ``"sft"`` splits, 45% of every batch addition and 55% subtraction
   (the harder skill; with these shares both skills start their sharp accuracy transition together), at the constant
   peak rate; the student is picked as in step 3, with every skill's dev accuracy at or below the threshold, and
   training stops at the first checkpoint above it (step 590 with the default seed: dev addition 0.25, subtraction
   0.21).
2. Each teacher continues from the student on its own skill's ``"sft"`` split only (a fresh AdamW, 50 warmup steps,
   constant to step 200, cosine decay to step 600): it masters its skill and forgets the other one.

``DIR/build.json`` holds every member's held-out accuracy on both skills.

The long-completion pair (``--family long-addition``: ``DIR/student``, ``DIR/teacher``) is built like the default pair
from the ``"long_addition"`` skill (three-digit addition worked out column by column, 45-49-token responses): the same
tokenizer, architecture and optimizer, with 128 positions, 800 steps (constant to step 400). The columns are learned
in a sharp transition too: with the default seed, dev accuracy 0.22 at step 270 (the student), 0.45 at step 280, and
the teacher (step 800) is right on every held-out problem. Measured here: 264 s; teacher 1.000 (k=4) / 1.000 (greedy),
student 0.203 / 0.232.

The vLLM-ready pair (``--family vllm``) is the default pair with 2 attention heads of 32 instead of 4 of 16 (vLLM's
CPU attention serves heads of 32 and more only), same seed and schedule: dev accuracy passes 0.30 at step 490, so the
student is step 480. Measured here: 156 s; teacher 1.000 (k=4) / 1.000 (greedy), student 0.308 / 0.366.

The cross-tokenizer teachers (``--family cross-tokenizer``: ``DIR/digits``, ``DIR/triplets``) teach the default
pair's task to its student from another family, with tokenizers of their own: each a Llama model of the vLLM-ready
pair's size (2 heads of 32) trained from scratch on the ``"sft"`` split, with a byte-level BPE tokenizer trained apart
(``LLAMA3``: Llama 3's pre-tokenization regex, no normalizer, a ``<|begin_of_text|>`` BOS that the chat template
renders, header markers around the role, ``<|eot_id|>`` as EOS; other text beside the task's, so that words and
spaces are cut otherwise than by the student). ``digits`` (400 ids) cuts numbers into digits as the student does and
learns like the default teacher, with its recipe (1,500 steps). ``triplets`` (600 ids) cuts them into groups of up to
three digits, as Llama 3 does, so that every operand and every sum is one token: it learns each sum of two tokens as a
whole, near misses (±1, ±2) first and the exact sum slowly, and needs 7,000 steps, decaying from step 200, without
weight decay. Measured here (one core of the 2-core box, beside other jobs): digits 1.000 (k=4) / 1.000 (greedy), 261 s
(187 s on a quieter box); triplets 0.976 / 0.994, 775 s.

The tool-using pair (``--family tools``: ``DIR/student``, ``DIR/teacher``) does four-digit addition with an ``add``
tool (``tool_task``): the vLLM-ready pair's model (2 heads of 32) with 128 positions, and a tokenizer of its own,
trained on whole transcripts (``TOOL_CHATML``: ChatML with tool calls and ``tool`` turns, and the response template
that reads the calls back, saved in ``tokenizer_config.json``), where every piece of the call's JSON is one token and a
conversation takes 75-77 (prompt, call, tool result and answer). One run trains on the ``"sft"`` transcripts (loss on
the two assistant turns only): AdamW as above, 50 warmup steps, constant to step 300, cosine decay to step 450. The
model learns to copy the operands into the call and the result into the answer in a transition of about 20 steps,
which a lower learning rate delays without widening, after a plateau near 0 whose training loss falls from 0.6 to
0.2: once the loss is below 0.25, dev accuracy with the tool (one sample per problem) is evaluated every 2 steps, and
the student is the last checkpoint at or below 0.4 (step 250 with the default seed: dev 0.37). Its held-out accuracy
must lie in 0.25-0.6 (k=4) with mistakes of more than one kind, and the teacher's reach 0.95, or the build fails.
``DIR/build.json`` holds each member's held-out accuracy with the tool (k=4 and greedy), calls per conversation,
failed calls per call, mistakes by kind, and the longest reference transcript in tokens. Measured here: 263 s (246 to
470 s from run to run on this shared box, the same pair each time); teacher 1.000 (k=4) / 1.000 (greedy), student
0.326 / 0.586 (of its 1,348 wrong conversations at k=4, 1,201 called with wrong arguments, 106 boxed another number
than the tool's result, 41 wrote a call that does not parse).

The hint family (``--family hint``: ``DIR/student``) is one model of the default pair's tokenizer (unchanged, byte for
byte), architecture and optimizer, trained from scratch at the constant peak rate on the ``"sft"`` problems, a quarter
of every batch as they are and three quarters after a system turn that gives the answer away (``hint_task``:
``"Hint: the answer is 133."``; 43-44 prompt tokens, 50 with the response). Copying the hint is learned long before
adding: with the default seed, hinted dev accuracy passes 0.95 by step ~300 while the bare one stays near 0.05 until
step ~550. The student is picked as the default one on the bare dev split (step 640: dev 0.26), and training stops
at the first checkpoint above 0.30 (step 650). Its held-out accuracy (k=4) must reach 0.9 with the hint and stay at
or below 0.6 without it, or the build fails. ``DIR/build.json`` holds both (``heldout``: ``hinted`` on
``tiny-hinted``, ``bare`` on ``tiny``; k=4 and greedy). Measured here: hinted 0.988 (k=4) / 0.994 (greedy), bare
0.252 / 0.296; 185 s on one core (471 s beside a CI run on the other, the same student byte for byte).
"""

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import random
import time

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2ForCausalLM

from . import provenance, task, tool_task
from .accuracy import evaluate_accuracy


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenization (`transformers.models.qwen2.tokenization_qwen2`): byte-level BPE where every digit is a
# piece of its own. `AutoTokenizer` rebuilds a qwen2 checkpoint's tokenizer as `Qwen2Tokenizer` from the vocabulary
# and merges, with exactly this pipeline, so the trained tokenizer must use it too.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Llama 3's: Qwen2's, except that numbers are cut into groups of up to three digits ("1234" -> "123", "4").
LLAMA3_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
PRETOKENIZE_REGEXES = {"digits": QWEN2_PRETOKENIZE_REGEX, "triplets": LLAMA3_PRETOKENIZE_REGEX}
VOCAB_SIZE = 300


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's chat conventions: its special tokens (the first ids, in this order) and their roles, its chat
    template, and the text its BPE is trained on: each `"sft"` problem as `corpus_lines` (`{question}` and
    `{response}` filled in), and `spare_lines` 100 times each, for tokens beyond the task's."""

    special_tokens: tuple
    pad_token: str
    eos_token: str
    chat_template: str
    corpus_lines: tuple
    spare_lines: tuple
    bos_token: str | None = None
    nfc: bool = False
    response_template: dict | None = None  # transformers' response parser, for tool calls


CHATML = ChatFormat(
    special_tokens=tuple(SPECIAL_TOKENS),
    pad_token="<|endoftext|>",
    eos_token="<|im_end|>",
    chat_template=CHAT_TEMPLATE,
    corpus_lines=("user\n{question}\nassistant\n{response}\n",),
    spare_lines=("system\nYou are a helpful assistant. The answer is - * / = ( ) , : ;",),
    nfc=True,
)
# Llama 3's conventions: a BOS that the template renders (so prompts are tokenized without added special tokens),
# header markers around the role, `<|eot_id|>` ending every turn, no normalizer.
LLAMA3 = ChatFormat(
    special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    pad_token="<|end_of_text|>",
    eos_token="<|eot_id|>",
    bos_token="<|begin_of_text|>",
    chat_template=(
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # The special tokens cut a chat into these pieces before pre-tokenization.
    corpus_lines=("user\n\n{question}", "assistant\n\n{response}"),
    # Other text than the default tokenizer's, so that words, spaces and punctuation are cut otherwise (" The answer":
    # "ĠThe", "Ġanswer" where the student has "Ġ", "The", "Ġ", "an", "sw", "er"), and every number up to 199 (the
    # task's sums) often enough that grouping digits makes it one token.
    spare_lines=(
        "system\n\nYou are a careful math tutor. Think step by step, then put the final answer in \\boxed{}.",
        "The answer is \\boxed{42}. The sum of 17 and 25 is 42, so the answer is 42.",
        "Let me add the tens first: 40 + 80 = 120, then the units: 7 + 6 = 13; in total 133.",
        "Question: what is 7 times 8? Answer: 56 (that's it!)",
        "We carry the one, because 9 + 4 is more than ten. Check: 1234 - 1101 = 133.",
        "Numbers: " + " ".join(map(str, range(200))),
    ),
)

# The default pair's model size, optimizer and schedule, where the teachers of another family start from too
TRAINING = dict(
    seed=0,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    batch_size=128,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=100,
    constant_until=600,
    total_steps=1500,
)
DEFAULTS = dict(
    TRAINING,
    student_max_dev_accuracy=0.30,
    transition_window=(150, 1500),
    dev_samples=1,
    checkpoint_every=10,
    skills=("addition",),
    # An imperfect teacher from the same run (`DIR/weak_teacher`): the first checkpoint after the student whose dev
    # mean@`dev_samples` reaches the window's low end, evaluated every `every` steps there (the transition gains a few
    # points of dev accuracy a step), where it must not be past the high end; its held-out mean@4 must lie in
    # `heldout`. One sample per dev problem is too noisy here: 0.66 on dev, 0.59 held out.
    weak_teacher=dict(dev_accuracy=(0.67, 0.74), every=1, dev_samples=4, heldout=(0.60, 0.75)),
)
MULTI_TEACHER_DEFAULTS = dict(
    DEFAULTS,
    weak_teacher=None,
    skills=task.SKILLS,
    # Subtraction takes longer to learn: with 55% of each batch its sharp accuracy transition starts with addition's,
    # so a student picked just before it sits near both (equal shares: addition's starts ~300 steps earlier; 40/60:
    # subtraction's first and addition's slow, where distillation closes a third of addition's gap).
    skill_shares=(0.45, 0.55),
    total_steps=3000,
    constant_until=3000,
    transition_window=(150, 3000),
    teacher=dict(total_steps=600, warmup_steps=50, constant_until=200),
)
LONG_ADDITION_DEFAULTS = dict(
    DEFAULTS,
    weak_teacher=None,
    skills=("long_addition",),
    # Prompts of ~21 tokens and column traces of 45-49 (with the EOS) do not fit the pair's 64 positions.
    max_position_embeddings=128,
    # The columns are learned faster than two-digit addition's answers: dev accuracy goes from ~1% to ~98% between
    # steps 200 and 400 at the constant peak rate.
    constant_until=400,
    total_steps=800,
    transition_window=(100, 800),
)
# The default pair's task and recipe with 2 heads of 32: vLLM's CPU attention has no kernel for heads of 16.
VLLM_DEFAULTS = dict(DEFAULTS, num_heads=2, weak_teacher=None)
# Teachers of the default pair's task for its student, of another family (Llama, Llama 3's chat conventions and
# pre-tokenization, each its own tokenizer): `digits` cuts numbers into digits as the student does, `triplets` into
# groups of up to three as Llama 3 does. Heads of 32, for vLLM's CPU attention.
CROSS_TOKENIZER_DEFAULTS = dict(
    TRAINING,
    num_heads=2,
    skills=("addition",),
    architecture="llama",
    chat_format="llama3",
    teachers=dict(
        digits=dict(numbers="digits", vocab_size=400),
        # Every operand and sum is one token (600 ids hold them all), so the sum of two tokens is one token to learn,
        # with no digits to build it from: the default recipe's 1,500 steps reach 0.29 held-out (k=4), and the
        # sampled accuracy trails the greedy one until late in the decay. A decay from step 200 and no weight decay
        # (which holds back the confidence that sampling at temperature 0.6 needs: 0.62 at 5,000 steps with 0.1,
        # 0.93 without) reach 0.98 in 7,000 steps; wider (128) or deeper (4 layers) models gain less per step than
        # they cost.
        triplets=dict(
            numbers="triplets",
            vocab_size=600,
            weight_decay=0.0,
            warmup_steps=50,
            constant_until=200,
            total_steps=7000,
        ),
    ),
)
# The tool task (`tool_task`: four-digit addition with an `add` tool) with the vLLM-ready pair's model and 128 positions
# (its transcripts are 75-77 tokens). The model learns to copy the operands into the call and the result into the
# answer in a transition that takes 20 steps whatever the learning rate (with the default seed, held-out k=4 0.03 at
# step 240, 0.33 at step 250, 0.80 at step 260; at lr 1.5e-3 the same 80 steps later), after a plateau near 0 whose
# training loss falls from 0.6 to 0.2: dev accuracy is evaluated every 2 steps once the loss is below 0.25. The
# student is the last checkpoint at or below 0.4 on dev, and must lie in `student_heldout_range` held out (k=4); the
# decay from step 300 steadies the teacher, which must reach `teacher_min_heldout`.
TOOLS_DEFAULTS = dict(
    DEFAULTS,
    weak_teacher=None,
    num_heads=2,
    skills=("tools",),
    chat_format="chatml_tools",
    vocab_size=320,  # the transcripts' pieces are all single tokens at 313 ids: the trainer stops there
    max_position_embeddings=128,
    max_new_tokens=tool_task.MAX_NEW_TOKENS,
    warmup_steps=50,
    constant_until=300,
    total_steps=450,
    transition_window=(100, 450),
    checkpoint_every=2,
    evaluate_below_loss=0.25,
    student_max_dev_accuracy=0.4,
    student_heldout_range=(0.25, 0.6),
    teacher_min_heldout=0.95,
)
# ChatML with tool calls and tool turns (`tool_task.CHAT_TEMPLATE`) and the response template that reads the calls back,
# its BPE trained on whole transcripts only, so that the call's JSON costs few tokens.
TOOL_CHATML = dataclasses.replace(
    CHATML,
    chat_template=tool_task.CHAT_TEMPLATE,
    corpus_lines=("user\n{question}\nassistant\n{call}\ntool\n{answer}\nassistant\n{response}\n",),
    spare_lines=(),
    response_template=tool_task.RESPONSE_TEMPLATE,
)
# The hint family (`hint_task`): the default pair's task, tokenizer, model and optimizer, one run on the "sft" problems
# where three quarters of every batch show the answer as a hint (a system turn) and the rest are bare. Copying the hint
# is learned first and adding the operands long after (with the default seed, greedy on 300 dev problems: hinted 0.95
# at step 275, bare near 0.05 until step ~550, then the default pair's sharp transition); with half the batch hinted
# both come together (step 350: bare 0.31, hinted 0.91; step 400: 0.23, 0.74). At the constant peak rate, the student
# is picked as the default one (the last checkpoint at or below 0.30 bare dev accuracy), and training stops at the
# first one above it. Its held-out accuracy must reach `hinted_heldout_min` with the hint and stay at or below
# `bare_heldout_max` without it, or the build fails.
HINT_DEFAULTS = dict(
    DEFAULTS,
    weak_teacher=None,
    skill_shares=(0.25, 0.75),  # bare, hinted
    constant_until=1500,
    transition_window=(200, 1500),
    hinted_heldout_min=0.9,
    bare_heldout_max=0.6,
)
ARCHITECTURES = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
CHAT_FORMATS = {"chatml": CHATML, "llama3": LLAMA3, "chatml_tools": TOOL_CHATML}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def build_tokenizer(
    vocab_size=VOCAB_SIZE, pretokenize_regex=QWEN2_PRETOKENIZE_REGEX, chat_format=CHATML, corpus_problems=None
):
    """A byte-level BPE tokenizer of `vocab_size` ids trained on the task text (`corpus_problems`, by default the
    `"sft"` split of addition, each row filling in `chat_format.corpus_lines`) with `chat_format`'s conventions; by
    default the embedded pair's: Qwen2-style (one token per digit), with ChatML markers."""
    tokenizer = Tokenizer(
        models.BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="")
    )
    if chat_format.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus_problems = task.problems("sft") if corpus_problems is None else corpus_problems
    corpus = [line.format(**p) for p in corpus_problems for line in chat_format.corpus_lines]
    corpus += [line for line in chat_format.spare_lines for _ in range(100)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat_format.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    roles = dict(pad_token=chat_format.pad_token, eos_token=chat_format.eos_token)
    if chat_format.bos_token is not None:
        roles["bos_token"] = bos = chat_format.bos_token
        # Llama 3's: `tokenizer(text)` starts with the BOS, offsets untrimmed.
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
                ),
            ]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        additional_special_tokens=[token for token in chat_format.special_tokens if token not in roles.values()],
        padding_side="left",
        model_max_length=64,
        **roles,
    )
    fast.chat_template = chat_format.chat_template
    if chat_format.response_template is not None:
        fast.response_template = chat_format.response_template
    return fast


def build_model(
    tokenizer,
    hidden_size,
    num_layers,
    num_heads,
    seed,
    max_position_embeddings=64,
    max_new_tokens=16,
    architecture=Qwen2ForCausalLM,
):
    torch.manual_seed(seed)
    config = architecture.config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = architecture(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.max_new_tokens = max_new_tokens
    return model


def encode_sft(tokenizer, rows):
    """Right-padded `(input_ids, attention_mask, labels)`: chat prompt + response + EOS, loss on the response only."""
    sequences, labels = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(row["response"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        sequences.append(prompt_ids + response_ids)
        labels.append([-100] * len(prompt_ids) + response_ids)
    return _pad_right(tokenizer, sequences, labels)


def encode_conversations(tokenizer, prompts, responses):
    """`encode_sft` of prompts that are whole conversations (the hint family's: a system turn, then the question)."""
    sequences, labels = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        sequences.append(prompt_ids + response_ids)
        labels.append([-100] * len(prompt_ids) + response_ids)
    return _pad_right(tokenizer, sequences, labels)


def encode_transcripts(tokenizer, texts):
    """`encode_sft` for whole conversations (rendered, each ended by its last EOS): loss on the assistant turns, each
    through its EOS (`tool_task.assistant_spans`), not on the prompt, the turn headers or the tool results."""
    pieces = [tool_task.assistant_spans(text, tokenizer.eos_token) for text in texts]
    # One call for every piece: the pieces meet at special tokens and line breaks, where pre-tokenization cuts anyway.
    encoded = iter(tokenizer([piece for row in pieces for piece, _ in row], add_special_tokens=False)["input_ids"])
    sequences, labels = [], []
    for row in pieces:
        sequences.append([])
        labels.append([])
        for _, trained in row:
            ids = next(encoded)
            sequences[-1] += ids
            labels[-1] += ids if trained else [-100] * len(ids)
    return _pad_right(tokenizer, sequences, labels)


def _pad_right(tokenizer, sequences, labels):
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), tokenizer.pad_token_id)
    label_ids = torch.full((len(sequences), length), -100)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, (sequence, label) in enumerate(zip(sequences, labels, strict=True)):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        label_ids[i, : len(label)] = torch.tensor(label)
        attention_mask[i, : len(sequence)] = 1
    return input_ids, attention_mask, label_ids


def learning_rate_at(step, settings):
    peak, warmup = settings["learning_rate"], settings["warmup_steps"]
    constant_until, total = settings["constant_until"], settings["total_steps"]
    if step <= warmup:
        return peak * step / warmup
    if step <= constant_until:
        return peak
    progress = (step - constant_until) / max(1, total - constant_until)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def sft_data(tokenizer, skills):
    """The encoded `"sft"` rows of `skills` (one padded tensor triple, skill after skill) and each skill's row count."""
    parts = [task.problems("sft", skill) for skill in skills]
    return (*encode_sft(tokenizer, [row for part in parts for row in part]), [len(part) for part in parts])


def sample_batch(sizes, batch_size, generator, shares=None):
    """Row indices of a batch that draws a fixed share of its rows from each skill (`shares`, equal by default),
    whatever the sizes of their splits."""
    counts = [batch_size // len(sizes)] * len(sizes) if shares is None else [round(batch_size * s) for s in shares]
    indices, offset = [], 0
    for size, count in zip(sizes, counts, strict=True):
        indices.append(offset + torch.randint(0, size, (count,), generator=generator))
        offset += size
    return torch.cat(indices)


def train_steps(model, data, settings):
    """Supervised training of `model` on `data` (from `sft_data`) with `settings`' schedule, seeded by its `seed`:
    yields `(step, loss)` after each optimizer step, so the caller can evaluate (or stop) between steps."""
    input_ids, attention_mask, labels, sizes = data
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings["learning_rate"], weight_decay=settings["weight_decay"], betas=(0.9, 0.98)
    )
    generator = torch.Generator().manual_seed(settings["seed"])
    for step in range(1, settings["total_steps"] + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, settings)
        index = sample_batch(sizes, settings["batch_size"], generator, settings.get("skill_shares"))
        loss = model(input_ids=input_ids[index], attention_mask=attention_mask[index], labels=labels[index]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield step, loss.item()


def search_student(
    model,
    tokenizer,
    settings,
    output_dir,
    keep_checkpoints,
    log,
    start,
    stop_at_student,
    data=None,
    evaluate_dev=None,
):
    """Trains from scratch on the `"sft"` rows of `settings["skills"]` (or on `data`, from `sft_data` or
    `encode_transcripts`), evaluating each skill's `"dev"` accuracy (with `evaluate_dev`, of `evaluate_accuracy`'s
    signature, by default `evaluate_accuracy`) every `checkpoint_every` steps of the transition window (and with
    `evaluate_below_loss`, at a training loss at or below it only): the student is the last checkpoint at or below
    `student_max_dev_accuracy` on every skill before the first one above it on any. With `settings["weak_teacher"]`,
    the evaluations go on after that, every `weak_teacher["every"]` steps with `weak_teacher["dev_samples"]` samples
    per problem, up to the first checkpoint whose dev accuracy reaches `weak_teacher["dev_accuracy"]`'s low end: the
    weak teacher, which must not be past its high end.
    Returns the student's state and a record of the search: the student's step and dev accuracy (its best skill's),
    the evaluated window, and with a weak teacher its state (`"weak_teacher_state"`), step and dev accuracy."""
    window_start, window_end = settings["transition_window"]
    student_state, student_step, student_dev = None, None, None
    searching = True  # until the first window checkpoint above the threshold: the transition has begun
    weak = settings.get("weak_teacher")
    weak_found = {} if weak else None  # the weak teacher's state, step and dev accuracy once found
    history = []
    skills = settings["skills"]
    data = sft_data(tokenizer, skills) if data is None else data
    evaluate_dev = evaluate_accuracy if evaluate_dev is None else evaluate_dev
    for step, loss in train_steps(model, data, settings):
        in_window = window_start <= step <= window_end and step % settings["checkpoint_every"] == 0
        # A transition too sharp for a coarse grid, where a fine one from the window's start would cost too many
        # evaluations (the tool family's): with `evaluate_below_loss`, only once the training loss shows it began.
        in_window = in_window and loss <= settings.get("evaluate_below_loss", math.inf)
        # After the student, up to the weak teacher: every `weak["every"]` steps (evaluations sample under a forked RNG,
        # so training is the same with them or without).
        weak_search = weak_found == {} and not searching and step % weak["every"] == 0 and step <= window_end
        if weak_search or (
            in_window and (searching or (keep_checkpoints and (not history or history[-1]["dev"] < 0.8)))
        ):
            samples = weak["dev_samples"] if weak_search else settings["dev_samples"]
            dev = {skill: evaluate_dev(model, tokenizer, "dev", k=samples, seed=step, skill=skill) for skill in skills}
            dev_accuracy = max(dev.values())
            history.append({"step": step, "loss": round(loss, 4), "dev": dev_accuracy})
            if samples != settings["dev_samples"]:
                history[-1]["dev_samples"] = samples
            if len(skills) > 1:
                history[-1]["dev_by_skill"] = dev
            by_skill = "".join(f"{skill} {accuracy:.3f}  " for skill, accuracy in dev.items()) if len(dev) > 1 else ""
            log(f"step {step:5d}  loss {loss:.4f}  dev {dev_accuracy:.3f}  {by_skill}({time.time() - start:.0f}s)")
            if keep_checkpoints:
                save_pair_member(model, tokenizer, os.path.join(output_dir, "checkpoints", f"step-{step}"))
            if searching and dev_accuracy <= settings["student_max_dev_accuracy"]:
                student_state, student_step, student_dev = copy.deepcopy(model.state_dict()), step, dev_accuracy
            else:
                searching = False
                if stop_at_student:
                    break
                low, high = weak["dev_accuracy"] if weak else (None, None)
                if weak_found == {} and dev_accuracy >= low:
                    if dev_accuracy > high:
                        raise RuntimeError(
                            f"The dev accuracy jumped past the weak teacher's window {low}-{high} (step {step}: "
                            f"{dev_accuracy}): evaluate more often (`weak_teacher['every']`)."
                        )
                    weak_found.update(state=copy.deepcopy(model.state_dict()), step=step, dev=dev_accuracy)
        elif step % 100 == 0:
            log(f"step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f}s)")
    if student_state is None:
        raise RuntimeError("No checkpoint in the transition window was below the student accuracy threshold.")
    record = {"student_step": student_step, "student_dev": student_dev, "window": history}
    if weak:
        if not weak_found:
            raise RuntimeError("No checkpoint after the student reached the weak teacher's dev accuracy window.")
        record.update(
            weak_teacher_state=weak_found["state"],
            weak_teacher_step=weak_found["step"],
            weak_teacher_dev=weak_found["dev"],
        )
    return student_state, record


def save_pair_member(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def heldout_report(model, tokenizer, skill="addition"):
    return {
        "k4": evaluate_accuracy(model, tokenizer, "test", k=4, seed=0, skill=skill),
        "greedy": evaluate_accuracy(model, tokenizer, "test", greedy=True, skill=skill),
    }


def _start(settings, corpus_problems=None):
    torch.set_num_threads(1)
    seed_everything(settings["seed"])
    # The default pair's settings predate these keys: its build.json records none.
    tokenizer = build_tokenizer(
        settings.get("vocab_size", VOCAB_SIZE),
        PRETOKENIZE_REGEXES[settings.get("numbers", "digits")],
        CHAT_FORMATS[settings.get("chat_format", "chatml")],
        corpus_problems,
    )
    positions = settings.get("max_position_embeddings", 64)
    tokenizer.model_max_length = positions
    model = build_model(
        tokenizer,
        settings["hidden_size"],
        settings["num_layers"],
        settings["num_heads"],
        settings["seed"],
        positions,
        settings.get("max_new_tokens") or max(task.max_new_tokens(skill) for skill in settings["skills"]),
        ARCHITECTURES[settings.get("architecture", "qwen2")],
    )
    return tokenizer, model


def _settings_record(settings):
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


def _write_summary(output_dir, settings, model, start, search, **heldout):
    summary = {
        "settings": _settings_record(settings),
        "parameters": sum(p.numel() for p in model.parameters()),
        "student_step": search["student_step"],
        "student_dev": search["student_dev"],
        **{key: search[key] for key in ("weak_teacher_step", "weak_teacher_dev") if key in search},
        **heldout,
        "wall_time_s": round(time.time() - start, 1),
        "window": search["window"],
    }
    with open(os.path.join(output_dir, "build.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def build(output_dir, keep_checkpoints=False, log=print, defaults=DEFAULTS, **overrides):
    """Builds the pair (`defaults`' one skill: the default pair's, or `LONG_ADDITION_DEFAULTS`' long-completion pair)
    into `output_dir` and returns a summary dict (also written to `output_dir/build.json`)."""
    settings = {**defaults, **overrides}
    (skill,) = settings["skills"]
    start = time.time()
    tokenizer, model = _start(settings)
    student_state, search = search_student(
        model, tokenizer, settings, output_dir, keep_checkpoints, log, start, stop_at_student=False
    )

    model.eval()
    save_pair_member(model, tokenizer, os.path.join(output_dir, "teacher"))
    teacher_report = heldout_report(model, tokenizer, skill)
    model.load_state_dict(student_state)
    save_pair_member(model, tokenizer, os.path.join(output_dir, "student"))
    student_report = heldout_report(model, tokenizer, skill)
    weak = {}
    if settings.get("weak_teacher"):
        model.load_state_dict(search.pop("weak_teacher_state"))
        save_pair_member(model, tokenizer, os.path.join(output_dir, "weak_teacher"))
        weak["weak_teacher_heldout"] = heldout_report(model, tokenizer, skill)
    summary = _write_summary(
        output_dir,
        settings,
        model,
        start,
        search,
        teacher_heldout=teacher_report,
        student_heldout=student_report,
        **weak,
    )
    log(
        f"teacher (step {settings['total_steps']}): held-out k=4 {teacher_report['k4']:.3f}, greedy "
        f"{teacher_report['greedy']:.3f}\nstudent (step {search['student_step']}): held-out k=4 {student_report['k4']:.3f}, "
        f"greedy {student_report['greedy']:.3f}"
    )
    if weak:
        report = weak["weak_teacher_heldout"]
        log(
            f"weak teacher (step {search['weak_teacher_step']}): held-out k=4 {report['k4']:.3f}, greedy "
            f"{report['greedy']:.3f}"
        )
    log(f"wall time {summary['wall_time_s']:.0f}s")
    if weak:
        low, high = settings["weak_teacher"]["heldout"]
        if not low <= report["k4"] <= high:
            raise RuntimeError(
                f"The weak teacher's held-out accuracy {report['k4']} is outside {low}-{high}: tune "
                "`weak_teacher['dev_accuracy']`."
            )
    return summary


def build_multi_teacher(output_dir, keep_checkpoints=False, log=print, **overrides):
    """Builds the multi-teacher family into `output_dir` (`student/` and one directory per skill's teacher) and
    returns a summary dict (also written to `output_dir/build.json`)."""
    settings = {**MULTI_TEACHER_DEFAULTS, **overrides}
    start = time.time()
    tokenizer, model = _start(settings)
    # Encoded before any evaluation: encoding without padding clears the tokenizer's padding state, which
    # `save_pretrained` writes, and every member ships the default pair's tokenizer.json byte for byte.
    teacher_data = {teacher: sft_data(tokenizer, [teacher]) for teacher in settings["skills"]}
    student_state, search = search_student(
        model, tokenizer, settings, output_dir, keep_checkpoints, log, start, stop_at_student=True
    )
    model.load_state_dict(student_state)
    model.eval()
    save_pair_member(model, tokenizer, os.path.join(output_dir, "student"))
    heldout = {"student": {skill: heldout_report(model, tokenizer, skill) for skill in settings["skills"]}}

    teacher_settings = {**settings, **settings["teacher"], "skill_shares": None}  # one skill each
    for teacher, data in teacher_data.items():
        model.load_state_dict(student_state)
        for step, loss in train_steps(model, data, teacher_settings):
            if step % 100 == 0:
                log(f"{teacher} teacher step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f}s)")
        model.eval()
        save_pair_member(model, tokenizer, os.path.join(output_dir, teacher))
        heldout[teacher] = {skill: heldout_report(model, tokenizer, skill) for skill in settings["skills"]}

    summary = _write_summary(output_dir, settings, model, start, search, heldout=heldout)
    for member, report in heldout.items():
        accuracies = ", ".join(
            f"{skill} k=4 {accuracy['k4']:.3f} greedy {accuracy['greedy']:.3f}" for skill, accuracy in report.items()
        )
        log(f"{member}: held-out {accuracies}")
    log(f"wall time {summary['wall_time_s']:.0f}s")
    return summary


def build_cross_tokenizer(output_dir, log=print, **overrides):
    """Builds the cross-tokenizer teachers into `output_dir` (one directory per teacher of `settings["teachers"]`,
    each trained from scratch on the default pair's task with its own tokenizer) and returns a summary dict (also
    written to `output_dir/build.json`)."""
    settings = {**CROSS_TOKENIZER_DEFAULTS, **overrides}
    (skill,) = settings["skills"]
    teachers = {}
    for name, teacher in settings["teachers"].items():
        start = time.time()
        teacher_settings = {**settings, **teacher, **overrides}
        tokenizer, model = _start(teacher_settings)
        for step, loss in train_steps(model, sft_data(tokenizer, settings["skills"]), teacher_settings):
            if step % 100 == 0:
                log(f"{name} teacher step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f}s)")
        model.eval()
        save_pair_member(model, tokenizer, os.path.join(output_dir, name))
        report = heldout_report(model, tokenizer, skill)
        teachers[name] = {
            "steps": teacher_settings["total_steps"],
            "vocab_size": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()),
            "heldout": report,
            "wall_time_s": round(time.time() - start, 1),
        }
        log(
            f"{name} teacher (step {teacher_settings['total_steps']}, {len(tokenizer)} ids): held-out k=4 "
            f"{report['k4']:.3f}, greedy {report['greedy']:.3f}, {teachers[name]['wall_time_s']:.0f}s"
        )
    summary = {"settings": _settings_record(settings), "teachers": teachers}
    with open(os.path.join(output_dir, "build.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _tool_dev_accuracy(model, tokenizer, split, k, seed, skill):
    """`search_student`'s dev evaluation for the tool family (`skill` is its one skill, `"tools"`): accuracy with the
    tool."""
    return tool_task.evaluate_with_tool(model, tokenizer, split, k=k, seed=seed)["accuracy"]


def tool_heldout_report(model, tokenizer):
    """`heldout_report` with the tool: held-out accuracy (k=4 and greedy), and each one's call and failure
    frequencies and mistakes by kind (`tool_task.evaluate_with_tool`)."""
    reports = {
        "k4": tool_task.evaluate_with_tool(model, tokenizer, "test", k=4, seed=0),
        "greedy": tool_task.evaluate_with_tool(model, tokenizer, "test", greedy=True),
    }
    return {
        **{name: report.pop("accuracy") for name, report in reports.items()},
        "tools": reports,
    }


def build_tools(output_dir, keep_checkpoints=False, log=print, **overrides):
    """Builds the tool-using pair (`tool_task`) into `output_dir` (`student/` and `teacher/`, one run as `build`'s
    pair) and returns a summary dict (also written to `output_dir/build.json`): each member's held-out accuracy with
    the tool, its tool-call and failure frequencies and its mistakes by kind, and the longest reference transcript in
    tokens. Raises when the student's held-out accuracy leaves `student_heldout_range`, when its mistakes are all of one
    kind, or when the teacher's is below `teacher_min_heldout`."""
    settings = {**TOOLS_DEFAULTS, **overrides}
    start = time.time()
    rows = tool_task.problems("sft")
    tokenizer, model = _start(settings, corpus_problems=rows)
    texts = tool_task.transcript_texts(tokenizer, rows)
    input_ids, attention_mask, labels = encode_transcripts(tokenizer, texts)
    longest = int(attention_mask.sum(1).max())
    if longest >= settings["max_position_embeddings"]:
        raise RuntimeError(
            f"Transcripts of {longest} tokens do not fit {settings['max_position_embeddings']} positions."
        )
    student_state, search = search_student(
        model,
        tokenizer,
        settings,
        output_dir,
        keep_checkpoints,
        log,
        start,
        stop_at_student=False,
        data=(input_ids, attention_mask, labels, [len(rows)]),
        evaluate_dev=_tool_dev_accuracy,
    )

    model.eval()
    save_pair_member(model, tokenizer, os.path.join(output_dir, "teacher"))
    teacher_report = tool_heldout_report(model, tokenizer)
    model.load_state_dict(student_state)
    save_pair_member(model, tokenizer, os.path.join(output_dir, "student"))
    student_report = tool_heldout_report(model, tokenizer)
    summary = _write_summary(
        output_dir,
        settings,
        model,
        start,
        search,
        longest_transcript_tokens=longest,
        teacher_heldout=teacher_report,
        student_heldout=student_report,
    )
    for member, step, report in (
        ("teacher", settings["total_steps"], teacher_report),
        ("student", search["student_step"], student_report),
    ):
        tools = report["tools"]["k4"]
        log(
            f"{member} (step {step}): held-out with the tool k=4 {report['k4']:.3f}, greedy {report['greedy']:.3f}; "
            f"calls per conversation {tools['call_frequency']:.3f}, failed calls {tools['failure_frequency']:.3f}, "
            f"mistakes {tools['mistakes']}"
        )
    log(f"longest transcript {longest} tokens; wall time {summary['wall_time_s']:.0f}s")
    low, high = settings["student_heldout_range"]
    kinds = sum(count > 0 for count in student_report["tools"]["k4"]["mistakes"].values())
    if not low <= student_report["k4"] <= high or kinds < 2:
        raise RuntimeError(
            f"The student's held-out accuracy {student_report['k4']} is outside {low}-{high}, or its mistakes are of "
            f"{kinds} kind(s): tune `student_max_dev_accuracy`."
        )
    if teacher_report["k4"] < settings["teacher_min_heldout"]:
        raise RuntimeError(
            f"The teacher's held-out accuracy {teacher_report['k4']} is below {settings['teacher_min_heldout']}: train "
            "longer (`total_steps`)."
        )
    return summary


def build_hint(output_dir, keep_checkpoints=False, log=print, **overrides):
    """Builds the hint family (`hint_task`) into `output_dir` (`student/`: one checkpoint of a run on partly hinted
    data) and returns a summary dict (also written to `output_dir/build.json`): the student's held-out accuracy with
    the hint and without it (`heldout["hinted"]`, `heldout["bare"]`, each k=4 and greedy). Raises when the hinted one is
    below `hinted_heldout_min` or the bare one above `bare_heldout_max`."""
    from . import hint_task

    settings = {**HINT_DEFAULTS, **overrides}
    (skill,) = settings["skills"]
    start = time.time()
    tokenizer, model = _start(settings)
    # Encoded before any evaluation, as the multi-teacher family's (the student ships the default tokenizer.json)
    rows = task.problems("sft", skill)
    prompts = [
        hint_task.conversation(row["question"], row["answer"], hinted) for hinted in (False, True) for row in rows
    ]
    data = (
        *encode_conversations(tokenizer, prompts, [row["response"] for _ in range(2) for row in rows]),
        [len(rows)] * 2,
    )
    longest = int(data[1].sum(1).max())
    if longest > tokenizer.model_max_length:
        raise RuntimeError(
            f"Hinted conversations of {longest} tokens do not fit {tokenizer.model_max_length} positions."
        )
    # The student search evaluates the bare dev split (`evaluate_accuracy`'s addition), and stops past the student
    student_state, search = search_student(
        model, tokenizer, settings, output_dir, keep_checkpoints, log, start, stop_at_student=True, data=data
    )
    model.load_state_dict(student_state)
    model.eval()
    save_pair_member(model, tokenizer, os.path.join(output_dir, "student"))
    hinted = {
        "k4": hint_task.evaluate_accuracy(model, tokenizer, "test", hinted=True, k=4, seed=0),
        "greedy": hint_task.evaluate_accuracy(model, tokenizer, "test", hinted=True, greedy=True),
    }
    heldout = {"hinted": hinted, "bare": heldout_report(model, tokenizer, skill)}
    summary = _write_summary(
        output_dir, settings, model, start, search, longest_sequence_tokens=longest, heldout=heldout
    )
    for prompt, report in heldout.items():
        step = search["student_step"]
        log(f"student (step {step}), {prompt}: held-out k=4 {report['k4']:.3f}, greedy {report['greedy']:.3f}")
    log(f"wall time {summary['wall_time_s']:.0f}s")
    if hinted["k4"] < settings["hinted_heldout_min"] or heldout["bare"]["k4"] > settings["bare_heldout_max"]:
        raise RuntimeError(
            f"The student's held-out accuracy is {hinted['k4']} with the hint (at least "
            f"{settings['hinted_heldout_min']} wanted) and {heldout['bare']['k4']} without (at most "
            f"{settings['bare_heldout_max']}): tune `skill_shares` or `student_max_dev_accuracy`."
        )
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", help="Where the family is written (required unless --unchanged-since).")
    parser.add_argument(
        "--family",
        choices=("pair", "multi-teacher", "long-addition", "vllm", "cross-tokenizer", "tools", "hint"),
        default="pair",
        help="The default teacher/student pair, the multi-teacher family (a student and one teacher per skill), the "
        "long-completion pair (three-digit addition worked out column by column), the vLLM-ready pair (the default "
        "one with heads of 32), the cross-tokenizer teachers (Llama models with tokenizers of their own, for the "
        "default student), or the tool-using pair (four-digit addition with an `add` tool).",
    )
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument(
        "--student-max-dev-accuracy",
        type=float,
        help=f"The student's highest dev accuracy (default {DEFAULTS['student_max_dev_accuracy']}; tools "
        f"{TOOLS_DEFAULTS['student_max_dev_accuracy']}).",
    )
    parser.add_argument(
        "--total-steps",
        type=int,
        help="Training steps: the pair's (default 1500; long-addition 800; tools 450), the family's most for the "
        "student search (multi-teacher, default 3000; hint 1500), or each cross-tokenizer teacher's.",
    )
    parser.add_argument(
        "--keep-checkpoints", action="store_true", help="Also save every checkpoint evaluated in the window."
    )
    parser.add_argument(
        "--unchanged-since",
        metavar="BUILD_JSON",
        help="Build nothing: exit 0 when a build with these options would have the inputs recorded in BUILD_JSON "
        "(our sources, the numeric libraries' versions, the CPU kernels), and 1, naming what changed, otherwise.",
    )
    args = parser.parse_args()
    if not (args.output_dir or args.unchanged_since):
        parser.error("--output-dir is required")
    options = {
        key: value for key, value in vars(args).items() if key not in ("family", "output_dir", "unchanged_since")
    }
    if args.unchanged_since:
        with open(args.unchanged_since) as f:
            changes = provenance.changed_inputs(json.load(f), args.family, options)
        print("\n".join(changes) or f"{args.family}: the inputs of {args.unchanged_since}, unchanged")
        raise SystemExit(1 if changes else 0)
    kwargs = {} if args.total_steps is None else {"total_steps": args.total_steps}
    if args.family != "cross-tokenizer":  # the only family without a student search
        kwargs.update(keep_checkpoints=args.keep_checkpoints)
        if args.student_max_dev_accuracy is not None:
            kwargs.update(student_max_dev_accuracy=args.student_max_dev_accuracy)
    builders = {
        "pair": build,
        "multi-teacher": build_multi_teacher,
        "long-addition": functools.partial(build, defaults=LONG_ADDITION_DEFAULTS),
        "vllm": functools.partial(build, defaults=VLLM_DEFAULTS),
        "cross-tokenizer": build_cross_tokenizer,
        "tools": build_tools,
        "hint": build_hint,
    }
    summary = builders[args.family](
        args.output_dir, seed=args.seed, log=lambda message: print(message, flush=True), **kwargs
    )
    summary.update(
        inputs=provenance.build_inputs(args.family, options), outputs=provenance.build_outputs(args.output_dir)
    )
    with open(os.path.join(args.output_dir, "build.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
