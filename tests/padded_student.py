"""The vLLM-ready student with an output layer padded beyond its tokenizer, for the real-vLLM tests."""

import torch
from transformers import AutoModelForCausalLM

from tvopd_trl.tiny import vllm_paths


def save_padded_student(tokenizer, path, rows=20):
    """Saves (with `tokenizer`) the vLLM-ready student with `rows` output rows beyond the tokenizer, each a copy of the
    EOS row scaled up: where EOS is likely (after the answer) a padded id is likelier still, so without a restriction
    padded ids are sampled. Returns `path` as a string."""
    model = AutoModelForCausalLM.from_pretrained(vllm_paths()["student"], dtype=torch.float32)
    tokens = len(tokenizer)
    model.resize_token_embeddings(tokens + rows, mean_resizing=False)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[tokens:] = 3 * weight[tokenizer.eos_token_id]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
