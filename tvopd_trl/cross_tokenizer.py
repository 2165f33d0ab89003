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
"""A teacher with another tokenizer (`cross_tokenizer=True`): the student's sampled completion as text, the teacher's
tokenization of that text, and the spans on which both agree (docs/cross-tokenizer.md).

Everything is in bytes, from a per-id byte table of each vocabulary: a byte-level token may hold part of a character,
so neither `decode()` nor character offsets can place its boundaries. Spans are the intervals between consecutive byte
positions where both tokenizations cut, plus one span of its own for the end token of a completion that ended. A cut
where only one side's pre-tokenizer would end a word whatever came next is no boundary: a teacher's "4" that can only be
the number four (Llama 3 groups digits by three) and a student's "4" that may begin any number make different
decisions, and the "}" after them belongs to their span.

The teacher does not score a span where the student wrote what no text of the teacher can hold: invalid UTF-8, a
special token inside the completion, or tokens that are not the student tokenizer's own tokenization of the text (a
re-tokenized non-canonical sample would get the score of other tokens: tens of nats of bias). Such a span is ruled out,
delta = -inf, as a teacher that gives a token no mass rules it out. A span is masked (no loss, no statistics) where the
teacher's score would be of another text than the student's: in a truncated completion from the start of the teacher's
last pre-token (its next bytes would change that token), and in a completion whose text the teacher's tokenizer does
not give back byte for byte.
"""

import bisect
import collections
import functools
import itertools
import json
import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .advantages import ADVANTAGE_MODE_REGISTRY, across_tokenizers_hint
from .spans import broadcast_spans, last_of_span, span_sums
from .teacher_prompts import render_prompt_ids
from .tokenizers import check_shared_vocabulary


_BYTE_OF_CHARACTER = {character: byte for byte, character in bytes_to_unicode().items()}
# What the teacher must tokenize back into exactly its bytes at setup: spaces, digits in groups, punctuation, LaTeX,
# accents, an emoji (4 bytes), newlines and a special token's name written as text
PROBES = (
    "Compute 47 + 86.",
    " \\boxed{133}",
    "The answer is 1234567.\n\nSo  x = -3, y=4; done!",
    "café naïve 👍 über",
    "x<|endoftext|>y<|im_end|>z<|eot_id|>",
    "\tindented\r\nline",
)
# One character of each class that may follow a pre-token: whether it would extend the pre-token tells whether a
# token that ends there carries the next character's class in its own probability (Llama 3's `\p{N}{1,3}` ends "1" in
# "1}" only because "}" follows: its "1" is the number one, where a digit tokenizer's "1" is any number's first digit)
LOOKAHEAD_PROBES = ("a", "é", "0", " ", "\n", ".", "'")
# Why the teacher does not score a span, as counted per batch: the first reason found counts
MASK_REASONS = ("unreproduced", "invalid_utf8", "special_token", "non_canonical", "truncated_tail")
# The spans the student wrote that the teacher's text cannot hold: they are ruled out (delta = -inf), not left out.
# A span left out of the loss has no gradient, so probability pushed off the scored tokens flows into it and stays
# there: Raw OPD distilling from the embedded Llama teacher collapsed into invalid bytes in 2 of 3 seeds that way.
RULED_OUT = ("invalid_utf8", "special_token", "non_canonical")


def byte_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """
    The bytes each id of `tokenizer` stands for, `None` for a special token (it has no text).

    Byte-level BPE (GPT-2, Llama 3, Qwen) spells bytes with the GPT-2 byte-to-unicode table; SentencePiece-style
    vocabularies (Llama 2, Mistral) write a space as `▁` and a byte as `<0xNN>`. Raises a `ValueError` for any other
    kind of tokenizer, or a slow one.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"Cross-tokenizer distillation needs fast tokenizers, got a slow {type(tokenizer).__name__}: load it with "
            "`AutoTokenizer.from_pretrained(..., use_fast=True)` (a checkpoint with a tokenizer.json)."
        )
    # The decoder's own JSON: the whole tokenizer's holds the vocabulary and merges (7 MB and 2 s for Qwen3's)
    decoder = tokenizer.backend_tokenizer.decoder
    decoder = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds = {step["type"] for step in decoder.get("decoders", [decoder]) if step}
    special = special_ids(tokenizer)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    vocab = tokenizer.get_vocab()  # a new dict of every token at each call: 0.15 s for 150k ids
    table = [None] * (max(vocab.values()) + 1)
    for piece, index in vocab.items():
        if index in special:
            continue
        if index in added:  # added tokens are stored as their text, not in the model's spelling
            table[index] = added[index].encode()
        elif "ByteLevel" in kinds:
            table[index] = bytes(_BYTE_OF_CHARACTER[character] for character in piece)
        elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table[index] = bytes([int(piece[3:5], 16)])
            else:
                table[index] = piece.replace("▁", " ").encode()
        else:
            raise ValueError(
                f"{type(tokenizer).__name__} is neither a byte-level BPE nor a SentencePiece-style tokenizer (its "
                f"decoder: {sorted(kinds) or 'none'}): the bytes of its tokens are unknown, so it cannot be aligned "
                "with another tokenizer. Use a teacher with the student's tokenizer."
            )
    return table


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids of `tokenizer`'s special tokens: its named ones and every added token marked special (Llama 3's
    `<|eot_id|>` is one without a name in its base tokenizer)."""
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that closes an assistant message in `tokenizer`'s chat template (Llama 3: `<|eot_id|>`, ChatML:
    `<|im_end|>`), or its EOS without a template. Raises a `ValueError` when that token is not a special token."""
    if tokenizer.chat_template is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"The teacher's tokenizer ({tokenizer.name_or_path}) has neither a chat template nor an EOS token: "
                "nothing scores the student's end of completion. Set its `eos_token` or `chat_template`."
            )
        return tokenizer.eos_token_id
    content = "TVOPD_END_PROBE"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1"}, {"role": "assistant", "content": content}], tokenize=False
    )
    after = rendered[rendered.index(content) + len(content) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids or ids[0] not in special_ids(tokenizer):
        raise ValueError(
            f"The teacher's chat template closes an assistant message with {after[:20]!r}, not a special token: its "
            "end of turn is unknown, so the student's end of completion cannot be scored. Give the teacher a template "
            "that ends each message with its end-of-turn token."
        )
    return ids[0]


def _ends(lengths):
    return list(itertools.accumulate(lengths))


def _decode(raw: bytes):
    """The text of `raw` (U+FFFD for each invalid stretch) and its segments `(start, end, text_start, valid)`: where each
    stretch of `raw` lands in the text's UTF-8 bytes."""
    parts, segments, start, text_start = [], [], 0, 0
    while start < len(raw):
        try:
            parts.append(raw[start:].decode("utf-8"))
            segments.append((start, len(raw), text_start, True))
            break
        except UnicodeDecodeError as error:
            good = raw[start : start + error.start]
            parts.append(good.decode("utf-8"))
            segments.append((start, start + error.start, text_start, True))
            text_start += len(good)
            segments.append((start + error.start, start + error.end, text_start, False))
            parts.append("\ufffd")
            text_start += 3
            start += error.end
    return "".join(parts), segments


def _text_position(position, segments):
    """Where byte `position` of the sampled bytes lands in the text's bytes, and whether the text can be cut there
    (not inside an invalid stretch, which became one U+FFFD)."""
    for start, end, text_start, valid in segments:
        if start <= position <= end:
            if valid or position == start:
                return text_start + position - start, True
            return text_start + 3, position == end
    return 0, True  # the empty text


def _spans_of(ends, lengths, common):
    """The span of each token: the one in which it ends, the following one for a token of no bytes (a special token),
    -1 where there is none."""
    spans, last = [], len(common) - 2
    for end, length in zip(ends, lengths, strict=True):
        span = bisect.bisect_left(common, end) - 1 if length else bisect.bisect_right(common, end) - 1
        spans.append(span if 0 <= span <= last else -1)
    return spans


class _PreTokenizer:
    """A tokenizer's pre-tokenization (the words its tokens never cross), with, at the end of each pre-token, the
    `LOOKAHEAD_PROBES` that would have extended it."""

    def __init__(self, tokenizer):
        self.pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
        self.extenders = functools.lru_cache(maxsize=1 << 16)(self._extenders)

    def _extenders(self, word):
        return frozenset(
            probe
            for probe in LOOKAHEAD_PROBES
            if all(end != len(word) for _, (_, end) in self.pre_tokenizer.pre_tokenize_str(word + probe))
        )

    def lookahead(self, text):
        """`{byte position where a pre-token of text ends: the probes that would have extended it}`, or None for a
        tokenizer without a pre-tokenizer (nothing known: every boundary is taken as it is)."""
        if self.pre_tokenizer is None:
            return None
        offsets = list(itertools.accumulate((len(character.encode()) for character in text), initial=0))
        return {
            offsets[end]: self.extenders(text[start:end])
            for _, (start, end) in self.pre_tokenizer.pre_tokenize_str(text)
        }


@dataclass
class AlignedRow:
    """One completion aligned with a teacher: the teacher's completion ids (its end-of-turn last when the completion
    ended), the span of each student and teacher token (-1: masked; a ruled-out span's teacher tokens are -1 too), the
    ruled-out spans, and the student tokens the teacher does not score, by reason."""

    teacher_ids: list[int]
    student_spans: list[int]
    teacher_spans: list[int]
    masked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MASK_REASONS, 0))
    ruled_out: set[int] = field(default_factory=set)


@dataclass
class AlignedBatch:
    """Rows of a batch aligned with a teacher: `teacher_batch` (its `prompt_ids`, `prompt_mask`, `completion_ids`,
    `completion_mask`, as TRL's batches hold the student's) to score, each student and teacher completion token's
    span (`(B, T)` and `(B, T')`, -1: masked), and the process's own `rows` (for the statistics)."""

    teacher_batch: dict
    span_ids: torch.Tensor
    teacher_span_ids: torch.Tensor
    ruled_out: torch.Tensor
    rows: list[AlignedRow]

    def student_teacher_logps(self, teacher_token_logps: torch.Tensor) -> torch.Tensor:
        """`(B, T)` on the student's tokens, from the teacher's `(B, T')` log-probabilities of its own tokens: each
        span's sum on its last student token, 0 on its others, -inf on a ruled-out span's last token, NaN on masked
        tokens (see `align_teacher_logps`)."""
        count = int(max(self.span_ids.max(), self.teacher_span_ids.max()).item()) + 1
        sums = span_sums(teacher_token_logps.float(), self.teacher_span_ids, count)
        sums = torch.where(span_sums(self.ruled_out.float(), self.span_ids, count) > 0, -math.inf, sums)
        on_last = torch.where(last_of_span(self.span_ids), broadcast_spans(sums, self.span_ids), 0.0)
        return torch.where(self.span_ids >= 0, on_last, math.nan)

    def statistics(self) -> list[float]:
        """The process's `STATISTICS`, summed over its rows (the largest span: its maximum)."""
        spans = student = teacher = largest = masked = scored = 0
        for row in self.rows:
            kept = [span for span in row.student_spans if span >= 0 and span not in row.ruled_out]
            sizes = collections.Counter(kept)
            spans += len(sizes)
            student += len(kept)
            teacher += sum(span >= 0 for span in row.teacher_spans)
            largest = max(largest, *sizes.values(), 0)
            masked += len(row.student_spans) - len(kept)
            scored += len(row.student_spans)
        return [spans, student, teacher, largest, masked, scored]


# What each process counts of its aligned rows, and how the counts pool over processes
STATISTICS = {
    "spans": "sum",
    "student_tokens": "sum",
    "teacher_tokens": "sum",
    "max_span_tokens": "max",
    "masked_tokens": "sum",
    "scored_tokens": "sum",
}


class TokenizerAlignment:
    """
    Aligns the student's sampled completions with one teacher's tokenization of the same text.

    Args:
        student (`PreTrainedTokenizerBase`):
            The student's tokenizer (fast).
        teacher (`PreTrainedTokenizerBase`):
            The teacher's tokenizer (fast, byte-level BPE or SentencePiece-style).
        student_end_ids (`list[int]`):
            Every id that ends a student completion (its EOS and its `generation_config.eos_token_id`).
        name (`str`, *optional*, defaults to `"teacher"`):
            The teacher's name in errors.

    Raises a `ValueError` naming the fix when a tokenizer is slow or of an unknown kind, when the teacher has no
    end-of-turn token, or when either tokenizer does not tokenize the probe texts back into their exact bytes (a
    prefix space, a lossy normalizer).
    """

    def __init__(self, student, teacher, student_end_ids, name="teacher"):
        self.student, self.teacher = student, teacher
        self.student_bytes, self.teacher_bytes = byte_table(student), byte_table(teacher)
        self.student_end_ids = set(student_end_ids)
        self.teacher_end_id = end_of_turn_id(teacher)
        self.pre_tokenizers = (_PreTokenizer(student), _PreTokenizer(teacher))
        for who, tokenizer, table in (("student", student, self.student_bytes), (name, teacher, self.teacher_bytes)):
            for probe, ids in zip(PROBES, self._tokenize(tokenizer, list(PROBES)), strict=True):
                pieces = [table[i] for i in ids]
                if None in pieces or b"".join(pieces) != probe.encode():
                    spelled = b"".join(piece or b"<special>" for piece in pieces)
                    raise ValueError(
                        f"The {who}'s tokenizer ({tokenizer.name_or_path}) does not tokenize text back into its own "
                        f"bytes: {probe!r} became {spelled!r}. A prefix space (`add_prefix_space`, a Metaspace "
                        "`prepend_scheme`) or a normalizer that rewrites text makes its scores those of another text: "
                        "load it with `add_prefix_space=False` (SentencePiece: `legacy=False`, `prepend_scheme='never'`) "
                        "or use another teacher."
                    )

    @staticmethod
    def _tokenize(tokenizer, texts):
        # No special token added, and none parsed from the text: a student that writes "<|eot_id|>" as characters
        # must not end the teacher's turn
        return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def teacher_prompt_ids(self, prompt, **chat_template_kwargs) -> list[int]:
        """The teacher's prompt: a conversation rendered with the teacher's chat template (which holds its BOS) and
        `chat_template_kwargs`, or a plain-text prompt tokenized as TRL tokenizes the student's."""
        return render_prompt_ids(self.teacher, prompt, **chat_template_kwargs)

    def align(self, completions: list[list[int]]) -> list[AlignedRow]:
        """Aligns each completion (the student's sampled ids, padding removed) with the teacher."""
        bodies, texts, decoded = [], [], []
        for ids in completions:
            body = ids[:-1] if ids and ids[-1] in self.student_end_ids else ids
            pieces = [self.student_bytes[i] if i < len(self.student_bytes) else None for i in body]
            raw = b"".join(piece or b"" for piece in pieces)
            text, segments = _decode(raw)
            bodies.append((body, pieces, len(body) < len(ids)))
            texts.append(text)
            decoded.append(segments)
        # One batched call per tokenizer: per-call overhead is the alignment's largest cost
        teacher_ids = self._tokenize(self.teacher, texts)
        canonical_ids = self._tokenize(self.student, texts)
        return [
            self._align_row(*body, text, segments, teacher, canonical)
            for body, text, segments, teacher, canonical in zip(
                bodies, texts, decoded, teacher_ids, canonical_ids, strict=True
            )
        ]

    def _align_row(self, body, pieces, ended, text, segments, teacher_ids, canonical_ids):
        length = len(text.encode())
        masked = dict.fromkeys(MASK_REASONS, 0)
        lengths = [len(piece or b"") for piece in pieces]
        positions = [_text_position(end, segments) for end in _ends(lengths)]
        student_ends = [position for position, _ in positions]
        teacher_pieces = [self.teacher_bytes[i] for i in teacher_ids]
        canonical_pieces = [self.student_bytes[i] for i in canonical_ids]
        text_bytes = text.encode()
        reproduced = None not in teacher_pieces and b"".join(teacher_pieces) == text_bytes
        canonical_ok = None not in canonical_pieces and b"".join(canonical_pieces) == text_bytes
        teacher_ends = _ends(map(len, teacher_pieces)) if reproduced else []
        # Where both cut, and both would end a pre-token for the same next characters (or neither ends one): else one
        # side's token before the cut holds the decision that the other's token after it makes, and each span's
        # log-ratio would credit it to another token ("1" then "}" to a digit student, "1" the number one to a
        # triplets teacher: the cut between them would reward "}" for ending every number after its first digit)
        lookaheads = [pre_tokenizer.lookahead(text) for pre_tokenizer in self.pre_tokenizers]

        def agreed(position):
            return None in lookaheads or lookaheads[0].get(position) == lookaheads[1].get(position)

        boundaries = {end for end, cut in positions if cut and agreed(end)} & set(teacher_ends)
        common = sorted(boundaries | {0, length})
        student_spans = _spans_of(student_ends, lengths, common)
        teacher_spans = _spans_of(teacher_ends, [1] * len(teacher_ends), common) if reproduced else []

        # Masked stretches of the text, as [start, end) byte intervals, by reason (the first reason found counts)
        bad = {reason: [] for reason in MASK_REASONS}
        bad["invalid_utf8"] = [(start, start + 3) for _, _, start, valid in segments if not valid]
        # A special token has no bytes: it joins the span that follows it
        bad["special_token"] = [
            (end, end + 1) for end, piece in zip(student_ends, pieces, strict=True) if piece is None
        ]
        if canonical_ok:
            bad["non_canonical"] = _non_canonical(student_ends, lengths, _ends(map(len, canonical_pieces)), length)
        else:
            bad["non_canonical"] = [(0, length)]
        if not ended and length:
            bad["truncated_tail"] = [(self._last_pretoken_start(text), length)]
        if not reproduced:
            bad["unreproduced"] = [(0, length)]
        masked_spans = {}
        for reason, intervals in bad.items():
            for start, end in intervals:
                span = max(bisect.bisect_right(common, start) - 1, 0)
                while span < len(common) - 1 and common[span] < end:
                    masked_spans.setdefault(span, reason)
                    span += 1

        ruled_out = {span for span, reason in masked_spans.items() if reason in RULED_OUT}
        spans = [-1 if s in masked_spans and s not in ruled_out else s for s in student_spans]
        for span, kept, piece in zip(student_spans, spans, pieces, strict=True):
            if kept < 0 or span in ruled_out:
                masked[masked_spans.get(span, "special_token" if piece is None else "unreproduced")] += 1
        teacher_spans = [-1 if s in masked_spans else s for s in teacher_spans]
        teacher_ids = list(teacher_ids) if reproduced else []
        if ended and reproduced:  # the end token, scored as the teacher's end of turn: a span of its own, or the last
            # text span's where the sides disagree on what may follow it (as between two text spans)
            end_span = len(common) - 1 if not length or agreed(length) else len(common) - 2
            spans.append(-1 if end_span in masked_spans and end_span not in ruled_out else end_span)
            if end_span in masked_spans:
                masked[masked_spans[end_span]] += 1
            teacher_ids.append(self.teacher_end_id)
            teacher_spans.append(-1 if end_span in masked_spans else end_span)
        elif ended:
            spans.append(-1)
            masked["unreproduced"] += 1
        return AlignedRow(teacher_ids, spans, teacher_spans, masked, ruled_out)

    def align_batch(self, batch, rows, real):
        """
        Aligns the completions of `batch`'s `rows` (the first `real` of them the process's own) with the teacher.

        `batch` holds the student's `completion_ids` / `completion_mask` and the teacher's rendered prompts
        (`teacher_prompt_ids` / `teacher_prompt_mask`, see `tvopd_trl.teacher_prompts.teacher_prompt_batch`). Returns an [`AlignedBatch`].
        """
        if "teacher_prompt_ids" not in batch:
            raise ValueError(
                "A teacher with another tokenizer scores its own rendering of each prompt, which this batch lacks "
                "(`teacher_prompt_ids`): generate it with `generate_completions`."
            )
        completion_ids, completion_mask = batch["completion_ids"][rows], batch["completion_mask"][rows]
        completions = [
            ids[mask.bool()].tolist() for ids, mask in zip(completion_ids.cpu(), completion_mask.cpu(), strict=True)
        ]
        aligned = self.align(completions)
        device = completion_ids.device
        padding = self.teacher.pad_token_id if self.teacher.pad_token_id is not None else self.teacher_end_id
        # At least one column: a forward that keeps 0 logits keeps them all
        width = max(1, *(len(row.teacher_ids) for row in aligned))
        teacher_ids = torch.full((len(aligned), width), padding, dtype=torch.long)
        teacher_spans = torch.full((len(aligned), width), -1, dtype=torch.long)
        student_spans = torch.full(completion_ids.shape, -1, dtype=torch.long)
        ruled_out = torch.zeros(completion_ids.shape, dtype=torch.bool)
        for index, (row, positions) in enumerate(zip(aligned, completion_mask.cpu().bool(), strict=True)):
            teacher_ids[index, : len(row.teacher_ids)] = torch.tensor(row.teacher_ids, dtype=torch.long)
            teacher_spans[index, : len(row.teacher_spans)] = torch.tensor(row.teacher_spans, dtype=torch.long)
            positions = positions.nonzero().squeeze(1)
            student_spans[index, positions] = torch.tensor(row.student_spans, dtype=torch.long)
            ruled_out[index, positions] = torch.tensor(
                [span in row.ruled_out for span in row.student_spans], dtype=torch.bool
            )
        lengths = torch.tensor([len(row.teacher_ids) for row in aligned])
        teacher_mask = (torch.arange(width) < lengths[:, None]).long()
        teacher_batch = {
            "prompt_ids": batch["teacher_prompt_ids"][rows],
            "prompt_mask": batch["teacher_prompt_mask"][rows],
            "completion_ids": teacher_ids.to(device),
            "completion_mask": teacher_mask.to(device),
        }
        return AlignedBatch(
            teacher_batch, student_spans.to(device), teacher_spans.to(device), ruled_out.to(device), aligned[:real]
        )

    def _last_pretoken_start(self, text):
        # The teacher's pre-tokenizer splits the text into words its tokens never cross; the last may go on
        pre_tokenizer = self.teacher.backend_tokenizer.pre_tokenizer
        if pre_tokenizer is None:
            return 0
        splits = pre_tokenizer.pre_tokenize_str(text)
        return len(text[: splits[-1][1][0]].encode()) if splits else 0


def _non_canonical(sampled_ends, sampled_lengths, canonical_ends, length):
    """The byte intervals where the sampled tokens are not the canonical tokens one for one."""
    sampled = [end for end, size in zip(sampled_ends, sampled_lengths, strict=True) if size]
    common = sorted((set(sampled) & set(canonical_ends)) | {0, length})
    intervals = []
    for start, end in itertools.pairwise(common):
        inside = [
            bisect.bisect_right(ends, end) - bisect.bisect_right(ends, start) for ends in (sampled, canonical_ends)
        ]
        if inside != [1, 1]:
            intervals.append((start, end))
    return intervals


def teacher_alignments(trainer, teacher_tokenizers, shared_vocabulary=None) -> dict[str, TokenizerAlignment]:
    """`{name: TokenizerAlignment}` of `trainer`'s teachers whose tokenizer differs from the student's (with
    `cross_tokenizer`; `teacher_tokenizers`: name -> tokenizer or None; `shared_vocabulary`: name ->
    `check_shared_vocabulary`'s verdict, where the caller has it). Refuses what such a teacher cannot do."""
    args = trainer.args
    if not args.cross_tokenizer:
        return {}
    student = trainer._tokenizer

    def shares_vocabulary(name, tokenizer):
        verdict = (shared_vocabulary or {}).get(name)
        return check_shared_vocabulary(student, tokenizer, cross_tokenizer=True) if verdict is None else verdict

    alignments = {
        name: TokenizerAlignment(student, tokenizer, trainer.eos_token_ids, name=repr(name))
        for name, tokenizer in teacher_tokenizers.items()
        if tokenizer is not None and not shares_vocabulary(name, tokenizer)
    }
    if not alignments:
        return alignments
    spec = ADVANTAGE_MODE_REGISTRY[args.advantage_mode]
    if not spec.across_tokenizers or args.log_exact_tv:
        what = "log_exact_tv=True" if spec.across_tokenizers else f"advantage_mode={args.advantage_mode!r}"
        raise ValueError(
            f"{what} compares per-token probabilities over one vocabulary, which teacher {next(iter(alignments))!r} "
            f"(another tokenizer) does not share: {across_tokenizers_hint()}"
        )
    if trainer.tools:
        raise ValueError(
            "Tool calling with a teacher of another tokenizer is not supported: a tool's result would have to be "
            "aligned too. Use a teacher of the student's family with tools."
        )
    return alignments
