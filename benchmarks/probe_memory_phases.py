"""Where TV-OPD's loss-phase peak memory falls: the forward and backward, or the optimizer step.

    OMP_NUM_THREADS=1 python benchmarks/probe_memory_phases.py                 # V 37,984 and 303,872, H 256, T 512
    OMP_NUM_THREADS=1 python benchmarks/probe_memory_phases.py --quick         # a small validation size
    OMP_NUM_THREADS=1 python benchmarks/probe_memory_phases.py --no-update-norm   # log_update_norm=False (no copy)

For each vocabulary, in a fresh process: the `tv` trainer of `bench_step.py` on its fixed rollout runs 2 loss-phase
steps; on the second (AdamW's moments exist by then) the peak RSS is read, and reset, at three boundaries: from the
step's start to just before `optimizer.step()` (forward and backward, before the `update/norm` copy), and from there
to just after it (the copy, the optimizer step). Each peak is reported above the RSS after setup plus the gradients and
AdamW's moments (3 parameter copies, as `bench_step.py`'s activation memory), next to the size of one parameter copy.
With `--no-update-norm` the trainer is built with `log_update_norm=False` (no copy is taken) and the outputs are
probe_memory_phases_no_update_norm.{json,md}.
"""

import argparse
import os

import common
from transformers import TrainerCallback


FULL = dict(vocabs=[37984, 303872], hidden=256, completion=512, prompt=64, batch=4)
QUICK = dict(vocabs=[2048, 8192], hidden=32, completion=16, prompt=8, batch=2)


class PhasePeaks(TrainerCallback):
    def __init__(self):
        self.peaks = []

    def on_step_begin(self, args, state, control, **kwargs):
        common.settle()
        common.reset_peak_rss()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._backward = common.peak_rss_mb()
        common.reset_peak_rss()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.peaks.append({"forward_backward": self._backward, "optimizer_step": common.peak_rss_mb()})


def point_worker(job):
    shape = job["shape"]
    data = common.rollout(shape, job["cache_dir"])
    trainer = common.build_trainer("tv", shape, data, 2, common.scratch_dir("tv"), job.get("config_overrides"))
    common.settle()
    setup = common.rss_mb()
    state = common.optimizer_state_bytes(trainer) / 2**20
    probe = PhasePeaks()
    # Ahead of the trainer's own hooks, so that the first reading comes before the `update/norm` copy is taken
    trainer.callback_handler.callbacks.insert(0, probe)
    trainer.train()
    last = probe.peaks[-1]
    return {name: peak - setup - state for name, peak in last.items()} | {"parameter_copy": state / 3}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_out=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--no-update-norm", action="store_true", help="build the trainer with log_update_norm=False")
    cli = parser.parse_args()
    config = QUICK if cli.quick else FULL
    overrides = {"log_update_norm": False} if cli.no_update_norm else {}
    name = "probe_memory_phases_no_update_norm" if cli.no_update_norm else "probe_memory_phases"
    out, cache_dir, started, info = common.start(cli)
    rows = []
    for vocab in config["vocabs"]:
        shape = common.Shape(
            vocab=vocab,
            hidden=config["hidden"],
            completion=config["completion"],
            prompt=config["prompt"],
            batch=config["batch"],
        )
        result = common.run_worker(
            __file__, common.job("point", shape, cache_dir=cache_dir, config_overrides=overrides)
        )
        rows.append([vocab] + [common.fmt(result.get(key)) for key in ("forward_backward", "optimizer_step")])
        rows[-1].append(common.fmt(result.get("parameter_copy")))
    header = ["V", "peak to optimizer.step() (MB)", "peak in optimizer.step() (MB)", "one parameter copy (MB)"]
    label = ", log_update_norm=False" if cli.no_update_norm else ""
    report = "## Machine\n\n" + common.machine_markdown(info) + f"\n\n## Peak memory by phase, tv{label}\n\n"
    report += "Above the RSS after setup + gradients + AdamW moments; second loss-phase step.\n\n"
    report += common.markdown_table(header, rows)
    print(report)
    common.write_outputs(out, name, {"machine": info, "config": config, "overrides": overrides, "rows": rows}, report)


if __name__ == "__main__":
    if common.is_worker():
        common.serve_worker({"point": point_worker})
    else:
        main()
