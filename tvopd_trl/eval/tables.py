# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The paper's results tables: their rows, computed from runs, and their layout in Markdown and LaTeX ("mean ± std",
bold best, underlined second).

Each row function takes one method's runs and aggregates across them with the sample standard deviation; `tvopd-trl
report` and `tvopd-trl study` build their tables from these rows, so both compute the paper's numbers the same way.
"""

from .benchmarks import PAPER_BENCHMARKS
from .selection import (
    PAPER_LATE_WINDOW,
    PAPER_STAGES,
    aggregate_selections,
    late_mean,
    mean_std,
    peak_drop,
    select_checkpoint,
    stage_averages,
)


def main_results_row(runs, benchmarks=PAPER_BENCHMARKS, min_step=1, max_step=1000):
    """A method's main-results row from its runs (`{step: {benchmark: mean@k}}` each): every run selects its own
    checkpoint ([`select_checkpoint`]), then `{benchmark: (mean, std), "avg": (mean, std)}` across runs
    ([`aggregate_selections`]). Returns the row and the runs' selections, in order."""
    selections = [select_checkpoint(run, benchmarks, min_step, max_step) for run in runs]
    return aggregate_selections(selections, benchmarks), selections


def retention_row(series, window=PAPER_LATE_WINDOW):
    """A method's retention row from its runs' S_k (`{step: value}` each): `{"LateMean": (mean, std), "PeakDrop":
    (mean, std)}` across runs. Every run must cover `window`."""
    return {
        "LateMean": mean_std(late_mean(s, window) for s in series),
        "PeakDrop": mean_std(peak_drop(s, window) for s in series),
    }


def stage_row(series, stages=PAPER_STAGES):
    """A method's stage-wise row from its runs' series (`{step: value}` each): `{stage: (mean, std)}`, averaged
    within each stage and run, then across runs. Every run must have an evaluation in every stage."""
    per_run = [stage_averages(s, stages) for s in series]
    return {name: mean_std(averages[name] for averages in per_run) for name in stages}


def _marks(values, rank_second, lower_is_better=False):
    """`{key: "best" | "second"}` for the highest and second-highest of `values` (lowest, with `lower_is_better`;
    ties share a mark)."""
    distinct = sorted({value for value in values.values() if value is not None}, reverse=not lower_is_better)
    marks = {}
    for key, value in values.items():
        if distinct and value == distinct[0]:
            marks[key] = "best"
        elif rank_second and len(distinct) > 1 and value == distinct[1]:
            marks[key] = "second"
    return marks


def _cell(value, fmt, scale, digits, mark=None):
    if value is None:
        return "–"
    mean, std = value if isinstance(value, tuple) else (value, None)
    plus_minus = " $\\pm$ " if fmt == "latex" else " ± "
    text = f"{mean * scale:.{digits}f}" + ("" if std is None else f"{plus_minus}{std * scale:.{digits}f}")
    if mark == "best":
        return f"\\textbf{{{text}}}" if fmt == "latex" else f"**{text}**"
    if mark == "second":
        return f"\\underline{{{text}}}" if fmt == "latex" else f"<u>{text}</u>"
    return text


def format_table(
    rows,
    columns,
    *,
    header=None,
    first_column="Method",
    fixed_rows=None,
    highlight="columns",
    rank_second=True,
    lower_is_better=(),
    fmt="markdown",
    scale=100.0,
    digits=2,
    caption=None,
):
    """
    A table of `rows` (`{label: {column: (mean, std) | mean | None}}`) as Markdown or LaTeX.

    Args:
        columns (`list[str]`): the column keys, in order; `header` maps them to display names.
        fixed_rows (`dict`, *optional*): rows shown first and never highlighted (the paper's step-0 "Student" row).
        highlight (`str`): `"columns"` marks the best (bold) and second-best (underlined, if `rank_second`) mean in
            each column, as the main-results table does; `"rows"` marks within each row, as the stage-wise table does;
            `"none"` marks nothing.
        lower_is_better (`tuple[str]`): columns whose best value is the lowest (PeakDrop), with `"columns"`.
        scale, digits: values are multiplied by `scale` (fractions to %) and printed with `digits` decimals.
    """
    header = header or {}
    marks = {label: {} for label in rows}
    if highlight == "columns":
        for column in columns:
            values = {label: _mean(row.get(column)) for label, row in rows.items()}
            best = _marks(values, rank_second, column in lower_is_better)
            for label, mark in best.items():
                marks[label][column] = mark
    elif highlight == "rows":
        for label, row in rows.items():
            marks[label] = _marks({column: _mean(row.get(column)) for column in columns}, rank_second)
    elif highlight != "none":
        raise ValueError(f"`highlight` must be 'columns', 'rows' or 'none' (got {highlight!r}).")
    body = [
        [label] + [_cell(row.get(column), fmt, scale, digits) for column in columns]
        for label, row in (fixed_rows or {}).items()
    ]
    body += [
        [label] + [_cell(row.get(column), fmt, scale, digits, marks[label].get(column)) for column in columns]
        for label, row in rows.items()
    ]
    titles = [first_column] + [header.get(column, column) for column in columns]
    if fmt == "latex":
        titles = [_latex_escape(title) for title in titles]
        body = [[_latex_escape(cells[0]), *cells[1:]] for cells in body]
    if fmt == "markdown":
        lines = ["| " + " | ".join(titles) + " |", "|" + "|".join([" --- "] + [" ---: "] * len(columns)) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(([f"{caption}", ""] if caption else []) + lines) + "\n"
    if fmt == "latex":
        lines = [
            "\\begin{table}[t]",
            "  \\centering",
            *([f"  \\caption{{{_latex_escape(caption)}}}"] if caption else []),
            f"  \\begin{{tabular}}{{l{'c' * len(columns)}}}",
            "  \\toprule",
            "  " + " & ".join(f"\\textbf{{{title}}}" for title in titles) + " \\\\",
            "  \\midrule",
        ]
        lines += ["  " + " & ".join(cells) + " \\\\" for cells in body]
        lines += ["  \\bottomrule", "  \\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"
    raise ValueError(f"`fmt` must be 'markdown' or 'latex' (got {fmt!r}).")


def _mean(value):
    return value[0] if isinstance(value, tuple) else value


def _latex_escape(text):
    for character in "&%$#_{}":
        text = text.replace(character, "\\" + character)
    return text.replace("±", "$\\pm$").replace("–", "--")
