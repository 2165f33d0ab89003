"""The setup of a teacher of another family on real vocabularies: Qwen3's (151,669 ids) and Llama 3's (128,256).

    OMP_NUM_THREADS=1 python benchmarks/bench_cross_tokenizer_setup.py [--rounds 5]

Both tokenizers are built offline from the ranks that `quicktok-v1` ships (the `test` extra;
`tvopd_trl.testing.real_vocabulary_tokenizer`), not timed. For each direction (student -> teacher) it times what the
trainer's construction does with the pair: one `check_shared_vocabulary` (its verdict is computed once per teacher) and
`TokenizerAlignment(...)`, whose byte tables are timed inside it; the rest of the alignment's setup is the teacher's
end-of-turn and the probe texts. It counts the reads of a whole vocabulary (`get_vocab()`, 0.15 s each here). The median
of the rounds is reported against the target: at most 3 s. Prints a Markdown table and writes it, with every number and
the machine, to results/cross_tokenizer_setup.{md,json} beside this script.
"""

import argparse
import collections
import contextlib
import importlib.metadata
import os
import statistics
import time

import tokenizers
from common import fmt, machine_info, machine_markdown, markdown_table, write_outputs
from transformers import PreTrainedTokenizerFast

import tvopd_trl.cross_tokenizer
from tvopd_trl.cross_tokenizer import TokenizerAlignment
from tvopd_trl.testing import real_vocabulary_tokenizer
from tvopd_trl.tokenizers import check_shared_vocabulary


TARGET_SECONDS = 3.0


@contextlib.contextmanager
def instrumented(times, reads):
    """Adds the seconds of every `byte_table` call to `times["byte_tables"]` and counts `get_vocab()` calls."""
    byte_table, get_vocab = tvopd_trl.cross_tokenizer.byte_table, PreTrainedTokenizerFast.get_vocab

    def timed_byte_table(tokenizer):
        start = time.perf_counter()
        try:
            return byte_table(tokenizer)
        finally:
            times["byte_tables"] += time.perf_counter() - start

    def counted_get_vocab(tokenizer):
        reads[0] += 1
        return get_vocab(tokenizer)

    tvopd_trl.cross_tokenizer.byte_table, PreTrainedTokenizerFast.get_vocab = timed_byte_table, counted_get_vocab
    try:
        yield
    finally:
        tvopd_trl.cross_tokenizer.byte_table, PreTrainedTokenizerFast.get_vocab = byte_table, get_vocab


def setup_once(student, teacher):
    """Seconds of each part of one setup, and the vocabulary reads."""
    times, reads = collections.Counter(), [0]
    with instrumented(times, reads):
        start = time.perf_counter()
        if check_shared_vocabulary(student, teacher, cross_tokenizer=True):
            raise ValueError("the two tokenizers share one vocabulary")
        times["check_shared_vocabulary"] = time.perf_counter() - start
        start = time.perf_counter()
        TokenizerAlignment(student, teacher, [student.eos_token_id])
        times["alignment"] = time.perf_counter() - start
    times["rest"] = times["alignment"] - times["byte_tables"]
    times["setup"] = times["check_shared_vocabulary"] + times["alignment"]
    return dict(times), reads[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="folder of the results (default: results/ beside this script)")
    cli = parser.parse_args()
    start = time.perf_counter()
    real = {name: real_vocabulary_tokenizer(name) for name in ("qwen3", "llama3")}
    build_seconds = time.perf_counter() - start
    parts = ("setup", "check_shared_vocabulary", "byte_tables", "rest")
    machine = machine_info() | {
        "tokenizers": tokenizers.__version__,
        "quicktok-v1": importlib.metadata.version("quicktok-v1"),
    }
    rows, results = [], {"machine": machine, "rounds": cli.rounds, "build_seconds": build_seconds, "pairs": {}}
    for student, teacher in (("qwen3", "llama3"), ("llama3", "qwen3")):
        rounds = [setup_once(real[student], real[teacher]) for _ in range(cli.rounds)]
        medians = {part: statistics.median(times[part] for times, _ in rounds) for part in parts}
        reads = rounds[0][1]
        pair = f"{student} ({len(real[student]):,}) -> {teacher} ({len(real[teacher]):,})"
        met = "yes" if medians["setup"] <= TARGET_SECONDS else "NO"
        rows.append([pair, *(fmt(medians[part]) for part in parts), reads, met])
        results["pairs"][pair] = {"rounds": [times for times, _ in rounds], "get_vocab_calls": reads}
    table = markdown_table(
        [
            "student -> teacher (ids)",
            "setup s",
            "check_shared_vocabulary s",
            "byte tables s",
            "rest of TokenizerAlignment s",
            "get_vocab() calls",
            f"<= {TARGET_SECONDS:g} s",
        ],
        rows,
    )
    markdown = (
        f"{table}\n\nMedian of {cli.rounds} rounds. Target: the setup at most {TARGET_SECONDS:g} s. (Building both "
        f"tokenizers, not part of the setup: {build_seconds:.1f} s.)\n\n{machine_markdown(results['machine'])}"
    )
    print(markdown)
    out = cli.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    write_outputs(out, "cross_tokenizer_setup", results, markdown)


if __name__ == "__main__":
    main()
