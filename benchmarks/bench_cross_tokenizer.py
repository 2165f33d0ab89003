"""The alignment's share of a main-job step with a teacher of another family, and that step against the same-family one.

    cd benchmarks && OMP_NUM_THREADS=1 python bench_cross_tokenizer.py [--rounds 3] [--steps 6] [--teachers digits,triplets]
    python benchmarks/bench_cross_tokenizer.py --device cuda --out DIR     # the models on a GPU, the alignment on CPU

The main job's step (recipes/tiny/cross_tokenizer.yaml: 128 prompts, 8 completion tokens, the embedded student) is
timed with the same-family teacher (the token path) and with each embedded teacher of another family
(`tvopd_trl.tiny.cross_tokenizer_paths`), runs alternating in one process so that machine drift hits all of them.
Inside the cross-tokenizer steps, every call of `TokenizerAlignment.align_batch` (the completions' bytes and text, both
batched tokenizer calls, the spans and masks, the teacher's padded batch) is timed: its share of the step is the
target (at most 10%). The first step of each run is warm-up and dropped. Prints a Markdown table and writes it, with
every number and the machine, to results/cross_tokenizer.{md,json} beside this script.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
from common import fmt, machine_info, machine_markdown, markdown_table, train_and_time, write_outputs
from transformers import TrainerCallback

from tvopd_trl.cross_tokenizer import TokenizerAlignment
from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import cross_tokenizer_paths, teacher_path


class AlignmentTimer(TrainerCallback):
    """The seconds of every `TokenizerAlignment.align_batch` call, summed per optimizer step (while `timing()`)."""

    def __init__(self):
        self.per_step, self._step = [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self._step)

    @contextlib.contextmanager
    def timing(self):
        original = TokenizerAlignment.align_batch

        def timed(alignment, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(alignment, *args, **kwargs)
            finally:
                self._step += time.perf_counter() - start

        TokenizerAlignment.align_batch = timed
        try:
            yield
        finally:
            TokenizerAlignment.align_batch = original


def run(teacher, steps, seed, device):
    """Seconds of each step but the first, and the alignment's seconds in each of them."""
    args = tiny_config(
        use_cpu=device == "cpu",
        output_dir=tempfile.mkdtemp(prefix="bench-cross-"),
        cross_tokenizer=True,
        per_device_train_batch_size=128,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=steps,
        seed=seed,
    )
    timer = AlignmentTimer()
    trainer = tiny_pair_trainer(args, prompts=128 * steps, teacher_model=teacher, callbacks=[timer])
    with timer.timing():
        seconds = train_and_time(trainer)
    return seconds[1:], timer.per_step[1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--teachers", default="digits,triplets", help="Embedded teachers of another family to time.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models run")
    parser.add_argument("--out", help="folder of the results (default: results/ beside this script)")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    other = cross_tokenizer_paths()
    teachers = {"same family (token path)": teacher_path()}
    teachers |= {f"cross_{name}": other[name] for name in cli.teachers.split(",")}
    steps = {name: [] for name in teachers}
    aligned = dict.fromkeys(teachers, 0.0)
    for round_index in range(cli.rounds):
        for name, path in teachers.items():
            seconds, alignment = run(path, cli.steps, seed=round_index, device=cli.device)
            steps[name] += seconds
            aligned[name] += sum(alignment)
    same = statistics.median(steps["same family (token path)"])
    machine = machine_info() | ({"gpu": torch.cuda.get_device_name(0)} if cli.device == "cuda" else {})
    rows, results = [], {"machine": machine, "rounds": cli.rounds, "steps": cli.steps, "teachers": {}}
    for name, seconds in steps.items():
        median = statistics.median(seconds)
        share = aligned[name] / sum(seconds)
        rows.append(
            [name, len(seconds), fmt(median), fmt(aligned[name] / len(seconds)), f"{share:.1%}", fmt(median / same)]
        )
        results["teachers"][name] = {"step_seconds": seconds, "alignment_seconds": aligned[name], "share": share}
    table = markdown_table(
        ["teacher", "steps timed", "median s/step", "alignment s/step", "alignment share", "vs same family"], rows
    )
    markdown = f"{table}\n\nTarget: the alignment at most 10% of the step.\n\n{machine_markdown(results['machine'])}"
    print(markdown)
    out = cli.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    write_outputs(out, "cross_tokenizer", results, markdown)


if __name__ == "__main__":
    main()
