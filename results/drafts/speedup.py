"""The recipe's draft before and after training, timed against the target alone, in one process on a quiet machine.

    python results/drafts/speedup.py outputs/real/smollm2_draft --output results/drafts/recipe/speedup.json

The recipe's own measurement (`eval_acceptance_prompts`) times the target once, at the start, and the draft after
training minutes later: on a shared machine the load changes in between. Here the target alone, the 4-layer cut and
the trained draft are timed one after the other (the target again at the end, to see the load held), on the recipe's
24 held-out questions at its settings (`speculative.draft_report`, gamma = 3, T = 1, 32 new tokens, seed 0).
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.eval import get_benchmark, load_problems
from tvopd_trl.job import embedded_draft_paths
from tvopd_trl.speculative import draft_report, generation_speed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trained", help="the trained draft's folder (the recipe's output_dir)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    cut, target_dir = embedded_draft_paths()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    benchmark = get_benchmark("terse")
    prompts = [benchmark.prompt(problem) for problem in load_problems(benchmark, limit=24)]
    sampling = dict(temperature=1.0, max_new_tokens=32, seed=0)
    speed = generation_speed(target, tokenizer, prompts, **sampling)
    results = {"target_tokens_per_second": speed}
    for name, path in (("before", cut), ("after", args.trained)):
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        results[name] = draft_report(target, draft, tokenizer, prompts, 3, target_speed=speed, **sampling)
    results["target_tokens_per_second_again"] = generation_speed(target, tokenizer, prompts, **sampling)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
