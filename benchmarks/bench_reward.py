"""What a task reward costs a step, beside the same run without it (issue: "a task reward beside the teacher").

    OMP_NUM_THREADS=1 python benchmarks/bench_reward.py [--rounds 4] [--steps 10]

Both runs sample `num_generations=4` completions per prompt (the same rollouts, seed and shapes as
`bench_tiny_step.py`), in `tv` mode; one has `reward_coef=0` and no reward function, the other `reward_coef=1` with a
reward function that does no work of its own (it returns the completions' lengths), so the difference is the
trainer's part: decoding, the call, the gather, the group normalisation, the reward term and its metrics. Runs
alternate in one process so that machine drift hits both; the first step of each run is dropped.
"""

import statistics

from bench_tiny_step import run, setup


def completion_length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def main():
    cli, tokenizer, prompts = setup()
    common = dict(num_generations=4)
    arms = {
        "no reward": dict(common),
        "reward_coef=1, a reward without work": dict(common, reward_coef=1.0, reward_funcs=[completion_length]),
    }
    seconds = {arm: [] for arm in arms}
    for _ in range(cli.rounds):
        for arm, overrides in arms.items():
            seconds[arm] += run("tv", tokenizer, prompts, cli.steps, **overrides)

    base = statistics.median(seconds["no reward"])
    print(f"tv, 16 completions per step (4 prompts x 4), 16 tokens each; {cli.rounds} rounds x {cli.steps} steps\n")
    print("| run | steps timed | median s/step | vs no reward |")
    print("|---|---|---|---|")
    for arm, values in seconds.items():
        median = statistics.median(values)
        print(f"| {arm} | {len(values)} | {median:.4f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
