"""The draft's acceptance rate as vLLM's own speculative decoding counts it, beside transformers' (docs/drafts.md).

    . .venv-vllm/bin/activate && python results/drafts/vllm_check.py --draft DRAFT_DIR --output OUT.json

vLLM's CPU build serves SmolLM2-135M-Instruct with `DRAFT_DIR` (the 4-layer cut by default, built beside the model)
drafting `--gamma` tokens a step (`speculative_config`, method `draft_model`), on the first `--held_out` held-out
questions of the terse task as chat turns, 32 new tokens each at T = `--temperature` with nothing truncated, seeded.
`draft_sample_method: probabilistic` makes it standard speculative sampling (a drafted token y ~ q accepted with
probability min(1, p(y) / q(y))), the rate TV-OPD's estimate reads; vLLM's default, `greedy`, drafts argmax q and
accepts it with probability p(argmax q), another rate (`--draft_sample_method greedy` measures it). The verifier's counters
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens_per_pos`) give the drafted tokens
tested and accepted, counted as `measure_assisted_acceptance` counts them: a draft of gamma tokens whose first n are
accepted tested n + 1 of them if n < gamma, else gamma.
"""

import argparse
import json
import os

from tvopd_trl.job import embedded_draft_paths
from tvopd_trl.speculative import wilson_interval
from tvopd_trl.terse_task import questions


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=None, help="draft folder (default: the 4-layer cut)")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--held_out", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft_sample_method", choices=["probabilistic", "greedy"], default="probabilistic")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    cut, target = embedded_draft_paths()
    draft = args.draft or cut
    speculative = {
        "model": draft,
        "num_speculative_tokens": args.gamma,
        "draft_sample_method": args.draft_sample_method,
    }
    llm = LLM(
        target, speculative_config=speculative, dtype="float32", max_model_len=512, seed=args.seed,
        gpu_memory_utilization=0.2, disable_log_stats=False,
    )  # fmt: skip
    sampling = SamplingParams(temperature=args.temperature, top_k=0, top_p=1.0, max_tokens=32, seed=args.seed)
    conversations = [[{"role": "user", "content": q}] for q in questions("test")[: args.held_out]]
    outputs = llm.chat(conversations, sampling, use_tqdm=False)
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    # Position i + 1 of a draft is tested where its first i + 1 tokens were accepted; that needs every draft whole
    assert draft_tokens == args.gamma * drafts, (draft_tokens, drafts)
    tested = drafts + sum(per_position[:-1])
    accepted = sum(per_position)
    results = {
        "settings": {**vars(args), "draft": draft},
        "acceptance": accepted / tested,
        "interval": list(wilson_interval(accepted, tested)),
        "tested": tested,
        "accepted": accepted,
        "drafts": drafts,
        "accepted_per_position": per_position,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "settings"}, indent=1))


if __name__ == "__main__":
    main()
