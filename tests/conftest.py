import os

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tvopd_trl import TVOPDConfig


os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

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


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """Student and teacher checkpoints on disk, each with the shared tokenizer, like Hub checkpoints."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, seed, hidden in (("student", 0, 32), ("teacher", 1, 48)):
        path = root / name
        build_model(tokenizer, seed, hidden_size=hidden).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture
def prompts():
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q, _ in arithmetic_problems(64, seed=1)]}
    )


def tiny_config(output_dir, **overrides):
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
