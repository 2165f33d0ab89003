"""Cross-tokenizer alignment on real vocabularies: Qwen3's (151,669 ids) and Llama 3's (128,256), built offline from the
ranks that `quicktok-v1` ships (`tvopd_trl.testing.real_vocabulary_tokenizer`, a few seconds each). The setup's time
is benchmarked in benchmarks/bench_cross_tokenizer_setup.py."""

import collections

import pytest
import quicktok

from tvopd_trl.cross_tokenizer import PROBES, TokenizerAlignment, byte_table, special_ids
from tvopd_trl.testing import real_vocabulary_tokenizer
from tvopd_trl.tiny import task
from tvopd_trl.tokenizers import check_shared_vocabulary


# The task's text, the setup's probes, and what neither holds: other scripts, code, typography, emoji of 4 bytes that
# each vocabulary cuts into other byte tokens, runs of spaces and newlines
TEXTS = [
    *PROBES,
    *(row["response"] for row in task.problems("test")[:100]),
    "数学题：计算 1234 + 5678 = 6912。答案是 6912。",
    "def f(x):\n    return x ** 2  # карта\n\n\n",
    "Ünïcödé — “quotes” … ½ ∑ 🤖🎉👍🏽",
    "   leading spaces\t\ttabs\r\n\nI'm sure we'll see THEY'VE 1,000,000.5",
]


@pytest.fixture(scope="module")
def tokenizers():
    return {name: real_vocabulary_tokenizer(name) for name in ("qwen3", "llama3")}


def encode(tokenizer, text):
    # As the alignment tokenizes: a special token's name in the text is text
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def span_bytes(table, ids, spans):
    """The bytes of each span, from the tokens' `ids`, their `spans` and the vocabulary's byte `table`."""
    pieces = collections.defaultdict(bytes)
    for index, span in zip(ids, spans, strict=True):
        pieces[span] += table[index] or b""  # a special token (an end token) has no bytes
    return dict(pieces)


@pytest.mark.parametrize("name, ids, special", [("qwen3", 151669, 20), ("llama3", 128256, 256)])
def test_the_real_tokenizer_and_its_byte_table_spell_every_id_as_the_ranks_do(tokenizers, name, ids, special):
    tokenizer, encoding = tokenizers[name], quicktok.get_encoding(name)
    # The converted tokenizer is the model's: the same ids as the reference BPE on every text
    assert [encode(tokenizer, text) for text in TEXTS] == [encoding.encode_ordinary(text) for text in TEXTS]
    # Qwen3's six tool and thinking markers are added tokens but not special: their text is their bytes
    specials = special_ids(tokenizer)
    assert len(tokenizer) == ids and len(specials) == special
    expected = [None if i in specials else encoding.decode_single_token_bytes(i) for i in range(ids)]
    assert byte_table(tokenizer) == expected


@pytest.mark.parametrize("student, teacher", [("qwen3", "llama3"), ("llama3", "qwen3")])
def test_the_alignment_of_real_vocabularies_is_exact_both_ways(tokenizers, student, teacher):
    student, teacher = tokenizers[student], tokenizers[teacher]
    assert not check_shared_vocabulary(student, teacher, cross_tokenizer=True)
    alignment = TokenizerAlignment(student, teacher, [student.eos_token_id])
    completions = [encode(student, text) + [student.eos_token_id] for text in TEXTS]
    for text, completion, row in zip(TEXTS, completions, alignment.align(completions), strict=True):
        assert sum(row.masked.values()) == 0 and not row.ruled_out
        assert row.teacher_ids == encode(teacher, text) + [alignment.teacher_end_id]
        # Spans in order on both sides, each the same bytes in both tokenizations, the end tokens in the last
        spans = sorted(set(row.student_spans))
        assert row.student_spans == sorted(row.student_spans) and row.teacher_spans == sorted(row.teacher_spans)
        assert spans == sorted(set(row.teacher_spans)) == list(range(len(spans)))
        student_bytes = span_bytes(alignment.student_bytes, completion, row.student_spans)
        assert student_bytes == span_bytes(alignment.teacher_bytes, row.teacher_ids, row.teacher_spans)
        assert row.student_spans[-1] == row.teacher_spans[-1] == spans[-1]
