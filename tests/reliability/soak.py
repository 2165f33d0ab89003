"""Soak run of the tiny pair: does a long run crash, grow its memory, or slow down?

```bash
OMP_NUM_THREADS=1 python -m tests.reliability.soak --steps 2000 --output_dir outputs/soak   # the issue's soak
```

It trains the shipped tiny pair for `--steps` optimizer steps (16 prompts each, the main job's other settings) and
records the process's resident memory and the wall time of every step. It prints, and writes to `soak.json`: whether
the run finished, the RSS growth from the end of the warm-up to the end, and the median step time of the last 200
steps against the first 200.
"""

import argparse
import json
import os
import statistics
import time

from transformers import TrainerCallback

from tvopd_trl.testing import tiny_config, tiny_pair_trainer


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Probe(TrainerCallback):
    def __init__(self):
        self.rss, self.seconds = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)
        self.rss.append(_rss_mb())


def soak(steps, output_dir, warmup=100, window=200):
    args = tiny_config(
        output_dir, max_steps=steps, per_device_train_batch_size=16, logging_steps=50, learning_rate=1e-3
    )
    trainer = tiny_pair_trainer(args, prompts=1600)
    probe = _Probe()
    trainer.add_callback(probe)
    start = time.perf_counter()
    trainer.train()
    window = min(window, steps // 2)
    report = {
        "steps": len(probe.seconds),
        "finished": trainer.state.global_step == steps,
        "wall_seconds": time.perf_counter() - start,
        "rss_after_warmup_mb": probe.rss[warmup - 1],
        "rss_end_mb": probe.rss[-1],
        "rss_peak_mb": max(probe.rss),
        "rss_growth": probe.rss[-1] / probe.rss[warmup - 1] - 1,
        "step_seconds_first": statistics.median(probe.seconds[:window]),
        "step_seconds_last": statistics.median(probe.seconds[-window:]),
    }
    report["step_time_ratio"] = report["step_seconds_last"] / report["step_seconds_first"]
    with open(os.path.join(output_dir, "soak.json"), "w") as f:
        json.dump({**report, "rss_mb": probe.rss, "step_seconds": probe.seconds}, f)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--output_dir", default="outputs/soak")
    options = parser.parse_args()
    os.makedirs(options.output_dir, exist_ok=True)
    for key, value in soak(options.steps, options.output_dir).items():
        print(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
