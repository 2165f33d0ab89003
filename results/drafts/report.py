"""The tables and plots of study part nine (docs/replication.md) from the runs of `study.py` in `results/drafts/study/`.

python results/drafts/report.py   # writes results/drafts/study/tables.md, acceptance.png and curves.png
"""

import glob
import json
import os
import statistics

from matplotlib.figure import Figure

from tvopd_trl.plots import plot_curves


HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "study")
NAMES = {"tv": "TV-OPD", "raw": "Raw OPD", "kl": "TRL forward KL (beta 0)", "jsd": "TRL JSD (beta 0.5)"}


def load_runs():
    """Per objective, its runs' results, in seed order."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(HERE, "*_seed*.json"))):
        with open(path) as f:
            run = json.load(f)
        runs.setdefault(run["settings"]["objective"], []).append(run)
    return {objective: runs[objective] for objective in NAMES if objective in runs}


def spread(values, digits=3):
    """`mean +- sd (v1, v2, ...)` of one value per seed."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} +- {sd:.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def table(runs, temperatures):
    before = [run["before"] for runs_of in runs.values() for run in runs_of if "before" in run]
    header = ["draft", *(f"measured acceptance, T = {t}" for t in temperatures)]
    header += ["own-state `tv/acceptance`, steps 1-5 -> 26-30", "seconds a step"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    if before:
        cells = [spread([b[t]["acceptance"] for b in before]) for t in temperatures]
        lines.append("| untrained 4-layer cut | " + " | ".join(cells) + " | | |")
    for objective, runs_of in runs.items():
        cells = [spread([run["after"][t]["acceptance"] for run in runs_of]) for t in temperatures]
        logged = [[e["tv/acceptance"] for e in run["logged"] if "tv/acceptance" in e] for run in runs_of]
        own = f"{statistics.fmean(v[0] for v in logged):.2f} -> {statistics.fmean(v[-1] for v in logged):.2f}"
        speed = statistics.fmean(run["seconds_per_step"] for run in runs_of)
        lines.append(f"| {NAMES[objective]} | " + " | ".join(cells) + f" | {own} | {speed:.1f} |")
    tested = statistics.fmean(run["after"][temperatures[-1]]["tested"] for r in runs.values() for run in r)
    return (
        "\n".join(lines)
        + f"\n\nEach cell: mean +- sd over seeds (each seed's value); about {tested:.0f} drafted tokens tested a measurement.\n"
    )


def plot_measured(runs, temperatures, path):
    figure = Figure(figsize=(7, 4))
    axis = figure.subplots()
    for offset, temperature in enumerate(temperatures):
        xs = [index + 0.15 * (offset - (len(temperatures) - 1) / 2) for index in range(len(runs))]
        for x, runs_of in zip(xs, runs.values(), strict=True):
            values = [run["after"][temperature]["acceptance"] for run in runs_of]
            axis.scatter([x] * len(values), values, color=f"C{offset}", s=12)
        axis.scatter([], [], color=f"C{offset}", label=f"T = {temperature}")
        befores = [run["before"][temperature]["acceptance"] for r in runs.values() for run in r if "before" in run]
        if befores:
            axis.axhline(statistics.fmean(befores), color=f"C{offset}", linestyle="--", linewidth=1)
    axis.set_xticks(range(len(runs)), [NAMES[objective] for objective in runs], rotation=15)
    axis.set(ylabel="measured acceptance (assisted generation)", title="Drafts after training (dashed: untrained)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    runs = load_runs()
    temperatures = list(next(iter(runs.values()))[0]["after"])
    with open(os.path.join(HERE, "tables.md"), "w") as f:
        f.write(table(runs, temperatures))
    plot_measured(runs, temperatures, os.path.join(HERE, "acceptance.png"))
    curves = {
        NAMES[objective]: [{e["step"]: e["tv/acceptance"] for e in run["logged"] if "tv/acceptance" in e} for run in r]
        for objective, r in runs.items()
    }
    plot_curves(curves, os.path.join(HERE, "curves.png"), "Own-state acceptance estimate", "tv/acceptance", scale=1.0)
    print(table(runs, temperatures))


if __name__ == "__main__":
    main()
