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
"""Tiny, untrained Qwen2 models and a tokenizer trained on the spot: for tests and smoke runs without the Hub."""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .config import TVOPDConfig


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def arithmetic_problems(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 100, (n, 2), generator=generator).tolist()
    return [(f"Compute {a} + {b}.", str(a + b)) for a, b in pairs]


def build_tokenizer():
    corpus = [f"{q} The answer is \\boxed{{{a}}}." for q, a in arithmetic_problems(500)]
    corpus += ["user assistant system Compute + - * = . The answer is"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", *SPECIAL_TOKENS])
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, seed, hidden_size=32, num_layers=2):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def arithmetic_prompts(n, seed=0):
    """A conversational prompt dataset of `n` two-digit additions."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in arithmetic_problems(n, seed)]})


def tiny_config(output_dir, **overrides):
    """A `TVOPDConfig` for fast single-process CPU runs of the tiny models; `overrides` win."""
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=3,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    defaults.update(overrides)
    return TVOPDConfig(**defaults)
