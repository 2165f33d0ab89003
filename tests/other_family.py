"""A teacher of another family for cross-tokenizer tests: a Llama-3-like tokenizer from the embedded builder (its own
special tokens, chat template and byte-level BPE, trained apart from the student's) and a random LlamaForCausalLM on it,
with heads of 32 (vLLM's CPU build serves those)."""

from transformers import LlamaForCausalLM

from tvopd_trl.tiny.build import LLAMA3, PRETOKENIZE_REGEXES, build_model, build_tokenizer


def other_family_tokenizer(digits=3, vocab_size=420):
    """Numbers cut into single digits (`digits=1`, as the student's) or groups of up to three (`3`, Llama 3's)."""
    return build_tokenizer(vocab_size, PRETOKENIZE_REGEXES["digits" if digits == 1 else "triplets"], LLAMA3)


def other_family_teacher(tokenizer, seed=0):
    return build_model(tokenizer, 64, 2, 2, seed, max_position_embeddings=128, architecture=LlamaForCausalLM)


def save_other_family_teacher(path, digits=3, seed=0):
    tokenizer = other_family_tokenizer(digits)
    other_family_teacher(tokenizer, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
