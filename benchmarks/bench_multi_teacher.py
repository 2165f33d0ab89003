"""Seconds per optimizer step with two teachers over N rows against one teacher over the same N rows, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_multi_teacher.py [--rounds 4] [--steps 8] [--rows 32]

Each row is scored once, by its own teacher, so two teachers of the same size should cost what one costs: the target
is a ratio within 10%. Both runs train the same student on the same prompts with the same seed; "one" scores every
row with teacher A, "two" routes half the rows (alternating `teacher_id`) to a second teacher B of the same shape.
Runs alternate one, two, one, two, ... in one process so that machine drift hits both. Every step is timed from
`on_step_begin` to `on_step_end` (generation, scoring, loss, backward, optimizer step); the first step of each run is
dropped as warm-up. Completions are full length (`min_new_tokens`), so both runs' rollouts have one shape.
"""

import argparse
import statistics
import tempfile

import common
import torch

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import build_model, build_tokenizer, tiny_config
from tvopd_trl.tiny import prompt_dataset


def run(kind, tokenizer, teachers, prompts, rows, steps):
    args = tiny_config(
        tempfile.mkdtemp(prefix=f"bench-{kind}-"),
        per_device_train_batch_size=rows,
        max_steps=steps,
        max_completion_length=32,
        generation_kwargs={"min_new_tokens": 32},
        learning_rate=1e-3,
        logging_steps=steps,
        log_update_norm=False,
    )
    trainer = TVOPDTrainer(
        model=build_model(tokenizer, seed=0, hidden_size=64),
        teacher_model=teachers if kind == "two" else teachers["a"],
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        teacher_processing_class={"a": tokenizer, "b": tokenizer} if kind == "two" else tokenizer,
    )
    return common.train_and_time(trainer)[1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32, help="rows per step (each run scores all of them once)")
    parser.add_argument("--teacher-hidden", type=int, default=256)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    teachers = {
        name: build_model(tokenizer, seed, hidden_size=cli.teacher_hidden) for name, seed in (("a", 1), ("b", 2))
    }
    prompts = prompt_dataset("opd", n=1024)
    prompts = prompts.add_column("teacher_id", ["a", "b"] * (len(prompts) // 2))
    print(common.machine_markdown(common.machine_info()))
    seconds = {"one": [], "two": []}
    for _ in range(cli.rounds):
        for kind in seconds:
            seconds[kind] += run(kind, tokenizer, teachers, prompts, cli.rows, cli.steps)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    print(
        common.markdown_table(
            ["teachers", "steps timed", "median s/step", "vs one"],
            [
                [kind, len(values), f"{median[kind]:.4f}", f"{median[kind] / median['one']:.3f}"]
                for kind, values in seconds.items()
            ],
        )
    )
    ratio = median["two"] / median["one"]
    print(f"target: two teachers within 10% of one -> {'met' if ratio <= 1.10 else 'missed'} ({ratio:.3f})")


if __name__ == "__main__":
    main()
