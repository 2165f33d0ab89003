"""A teacher of another family for cross-tokenizer tests: a Llama-3-like byte-level BPE tokenizer trained apart from
the student's (numbers in groups of up to `digits` digits, its own special tokens and chat template) and a random
LlamaForCausalLM on it."""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tvopd_trl.tiny import task


LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,DIGITS}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def other_family_tokenizer(digits=3, vocab_size=420, pre_tokenizer=None):
    """The tokenizer; `pre_tokenizer` replaces its byte-level one (to build tokenizers that lose bytes)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_REGEX.replace("DIGITS", str(digits))), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"{row['question']} {row['response']}" for row in task.problems("sft")[:2000]]
    corpus += ["The answer is café, naïve, über: 👍 right? Yes!\n\nDone."] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def other_family_teacher(tokenizer, seed=0):
    """A random Llama model on `tokenizer`, with heads of 32 (vLLM's CPU build serves those)."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_other_family_teacher(path, digits=3, seed=0):
    tokenizer = other_family_tokenizer(digits)
    other_family_teacher(tokenizer, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
