"""Seconds per optimizer step of TV-OPD (`tv`) against Raw OPD (`raw`) on the tiny test models, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_tiny_step.py [--rounds 4] [--steps 10]

Both modes train the same student against the same teacher on the same prompts with the same seed; runs alternate
tv, raw, tv, raw, ... in one process so that machine drift hits both. Each step is timed from `on_step_begin` to
`on_step_end` (generation, scoring, loss, backward and optimizer step); the first step of each run is dropped as
warm-up. Prints a Markdown table with the median and the tv/raw ratio.
"""

import argparse
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import build_model, build_tokenizer, tiny_config
from tvopd_trl.tiny import prompt_dataset


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def run(mode, tokenizer, prompts, steps, callbacks=(), **overrides):
    """Seconds of each step but the first of a `steps`-step run; `overrides` go to the config, the rest to the
    trainer."""
    timer = StepTimer()
    reward_funcs = overrides.pop("reward_funcs", None)
    args = tiny_config(
        tempfile.mkdtemp(prefix=f"bench-{mode}-"),
        advantage_mode=mode,
        per_device_train_batch_size=16,
        max_steps=steps,
        max_completion_length=16,
        # Full-length completions in both modes: the two runs' rollouts then have the same shape at every step.
        generation_kwargs={"min_new_tokens": 16},
        learning_rate=3e-3,
        logging_steps=steps,
        **overrides,
    )
    trainer = TVOPDTrainer(
        model=build_model(tokenizer, seed=0, hidden_size=64),
        teacher_model=build_model(tokenizer, seed=1, hidden_size=128),
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        teacher_processing_class=tokenizer,
        callbacks=[timer, *callbacks],
        reward_funcs=reward_funcs,
    )
    trainer.train()
    return timer.seconds[1:]


def setup():
    """The command line (`--rounds`, `--steps`), the test tokenizer and 1,024 OPD prompts, on one thread."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    return cli, build_tokenizer(), prompt_dataset("opd", n=1024)


def main():
    cli, tokenizer, prompts = setup()
    seconds = {"tv": [], "raw": []}
    for _ in range(cli.rounds):
        for mode in seconds:
            seconds[mode] += run(mode, tokenizer, prompts, cli.steps)
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    print("| mode | steps timed | median s/step | vs raw |")
    print("|---|---|---|---|")
    for mode, values in seconds.items():
        print(f"| {mode} | {len(values)} | {median[mode]:.4f} | {median[mode] / median['raw']:.3f} |")


if __name__ == "__main__":
    main()
