"""A teacher of another family (`cross_tokenizer`): byte tables, spans, masking, span log-ratios and the trainer."""

import collections
import dataclasses
import math

import pytest
import torch
from tokenizers import normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizer, PreTrainedTokenizerFast

from tests.other_family import other_family_teacher, other_family_tokenizer, save_other_family_teacher
from tvopd_trl.advantages import compute_advantages
from tvopd_trl.cross_tokenizer import PROBES, TokenizerAlignment, byte_table, end_of_turn_id, teacher_alignments
from tvopd_trl.spans import align_teacher_logps
from tvopd_trl.testing import tiny_config, tiny_pair_trainer
from tvopd_trl.tiny import prompt_dataset, student_path, task, teacher_path
from tvopd_trl.tiny.build import LLAMA3, PRETOKENIZE_REGEXES, build_tokenizer
from tvopd_trl.tv import tv_estimate


@pytest.fixture(scope="module")
def student():
    return AutoTokenizer.from_pretrained(student_path())


@pytest.fixture(scope="module")
def triplets():
    return other_family_tokenizer(digits=3)


@pytest.fixture(scope="module")
def digits():
    return other_family_tokenizer(digits=1, vocab_size=380)


@pytest.fixture(scope="module")
def aligned(student, triplets):
    return TokenizerAlignment(student, triplets, [student.eos_token_id])


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_other_family_teacher(tmp_path_factory.mktemp("other_family") / "teacher")


def ids(tokenizer, *tokens):
    return tokenizer.convert_tokens_to_ids(list(tokens))


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------------------------------
# Byte tables and setup checks
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["student", "triplets", "digits"])
def test_the_byte_table_spells_every_token_of_the_text(name, request):
    tokenizer = request.getfixturevalue(name)
    table = byte_table(tokenizer)
    texts = [*PROBES, *(row["response"] for row in task.problems("test")[:50])]
    for text in texts:
        pieces = [table[i] for i in tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
        assert b"".join(pieces) == text.encode()
    assert all(table[i] is None for i in tokenizer.all_special_ids)


def test_a_sentencepiece_style_table_reads_spaces_and_byte_tokens():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁a": 1, "b": 2, "▁": 3, "<0xC3>": 4, "<0xA9>": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert byte_table(tokenizer)[1:] == [b" a", b"b", b" ", b"\xc3", b"\xa9"]


def test_a_tokenizer_without_a_decoder_is_refused_naming_it():
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(ValueError, match=r"neither a byte-level BPE nor a SentencePiece.*its decoder: none"):
        byte_table(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))


class _CharTokenizer(PreTrainedTokenizer):
    """A slow (Python) tokenizer: one token per character."""

    def __init__(self, **kwargs):
        self.vocab = {chr(i): i for i in range(32, 127)}
        super().__init__(**kwargs)

    def get_vocab(self):
        return dict(self.vocab)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, 32)

    def _convert_id_to_token(self, index):
        return chr(index)


def test_a_slow_tokenizer_is_refused_naming_the_fix(student):
    with pytest.raises(ValueError, match=r"fast tokenizers.*use_fast=True"):
        TokenizerAlignment(student, _CharTokenizer(), [student.eos_token_id])


@pytest.mark.parametrize(
    "damage, lost",
    [
        (lambda t: setattr(t.backend_tokenizer, "normalizer", normalizers.Lowercase()), "Compute"),
        (lambda t: setattr(t.backend_tokenizer, "pre_tokenizer", pre_tokenizers.Metaspace()), "prefix space"),
    ],
)
def test_a_teacher_whose_pieces_lose_the_texts_bytes_is_refused_at_construction(damage, lost, teacher_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    damage(tokenizer)
    with pytest.raises(ValueError, match=rf"does not tokenize text back into its own bytes.*(?s:.*){lost}"):
        tiny_pair_trainer(
            tiny_config(tmp_path, cross_tokenizer=True),
            teacher_model=teacher_dir,
            teacher_processing_class=tokenizer,
        )


def test_the_end_of_turn_is_the_templates_not_the_eos(triplets):
    tokenizer = other_family_tokenizer(digits=3)
    tokenizer.eos_token = "<|end_of_text|>"  # a base model's EOS
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|eot_id|>") != tokenizer.eos_token_id
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id


def test_without_the_flag_another_tokenizer_is_refused_naming_it(teacher_dir, tmp_path):
    with pytest.raises(ValueError, match=r"must share one tokenizer.*Set `cross_tokenizer=True`"):
        tiny_pair_trainer(tiny_config(tmp_path), teacher_model=teacher_dir)


@pytest.mark.parametrize("setting", [{"advantage_mode": "power"}, {"advantage_mode": "vopd"}, {"log_exact_tv": True}])
def test_modes_of_one_vocabulary_are_refused_naming_those_that_work(setting, teacher_dir, tmp_path):
    with pytest.raises(ValueError, match=r"one vocabulary.*use one of raw, clip, sign, tv, relative_power"):
        tiny_pair_trainer(tiny_config(tmp_path, cross_tokenizer=True, **setting), teacher_model=teacher_dir)


# ----------------------------------------------------------------------------------------------------------------------
# Spans and masking, one completion at a time
# ----------------------------------------------------------------------------------------------------------------------


def test_the_student_aligned_with_itself_is_one_to_one_on_canonical_samples(student):
    alignment = TokenizerAlignment(student, student, [student.eos_token_id])
    completions = [encode(student, row["response"]) + [student.eos_token_id] for row in task.problems("test")[:100]]
    for completion, row in zip(completions, alignment.align(completions), strict=True):
        assert row.teacher_ids == completion
        assert row.student_spans == row.teacher_spans == list(range(len(completion)))


def test_a_three_digit_teacher_puts_the_answers_digits_in_one_span(student, aligned, triplets):
    completion = encode(student, " \\boxed{133}") + [student.eos_token_id]
    row = aligned.align([completion])[0]
    pieces = triplets.convert_ids_to_tokens(row.teacher_ids)
    digits = [i for i, token in enumerate(student.convert_ids_to_tokens(completion)) if token.isdigit()]
    assert len({row.student_spans[i] for i in digits}) < len(digits)  # the teacher's "13" or "133" spans digits
    assert pieces[-1] == "<|eot_id|>" and row.teacher_spans[-1] == row.student_spans[-1] == max(row.student_spans)
    assert sum(row.masked.values()) == 0


def test_no_span_ends_where_only_one_side_would_end_its_word_whatever_came_next(student, aligned, digits):
    # To a triplets teacher "47" in "{47}" is the number forty-seven (one more digit would have made "47x"); to the
    # digit student "7" is a digit that any other may follow. The cut after it is both tokenizations', but the "}"
    # (and an end token) after it belongs to the number's span: else it alone would be credited with ending the number
    eos = student.eos_token_id
    for text, spans, teacher_spans in (
        ("\\boxed{47}", [0, 1, 2, 2, 2, 3], [0, 1, 2, 2, 3]),  # "47", "}" in one span
        ("\\boxed{133}", [0, 1, 2, 2, 2, 3, 4], [0, 1, 2, 3, 4]),  # three digits: no fourth could follow
    ):
        completion = encode(student, text) + [eos]
        assert student.convert_ids_to_tokens(completion)[2:-2] == list(text[7:-1])
        row = aligned.align([completion])[0]
        assert (row.student_spans, row.teacher_spans) == (spans, teacher_spans) and sum(row.masked.values()) == 0
        # A teacher that cuts digits as the student does agrees on every cut
        same = TokenizerAlignment(student, digits, [eos]).align([completion])[0]
        assert same.student_spans == same.teacher_spans == list(range(len(completion)))
    # A completion that ends inside the teacher's number: its end token joins the number's span
    completion = encode(student, "\\boxed{1} 47") + [eos]
    row = aligned.align([completion])[0]
    assert row.student_spans[-1] == row.student_spans[-2] == row.student_spans[-3] == row.teacher_spans[-1]
    assert row.teacher_spans[-2] == row.teacher_spans[-1]


def test_a_character_split_across_student_tokens_stays_whole_in_its_span(student):
    # A teacher whose vocabulary holds "é" whole, and one that cuts it into its two bytes where the student does
    accented = dataclasses.replace(LLAMA3, spare_lines=(*LLAMA3.spare_lines, "café naïve über " * 20))
    whole = build_tokenizer(420, PRETOKENIZE_REGEXES["triplets"], accented)
    completion = encode(student, " café") + [student.eos_token_id]
    assert student.convert_ids_to_tokens(completion)[-3:-1] == ["Ã", "©"]  # é is two byte tokens
    for teacher, cut in ((whole, False), (other_family_tokenizer(digits=3), True)):
        assert ("Ã" in teacher.convert_ids_to_tokens(encode(teacher, " café"))) == cut
        row = TokenizerAlignment(student, teacher, [student.eos_token_id]).align([completion])[0]
        assert row.student_spans[-3] >= 0 and sum(row.masked.values()) == 0
        # One span unless both cut at the same byte, a boundary both agree on
        assert (row.student_spans[-3] != row.student_spans[-2]) == cut


def test_invalid_utf8_is_ruled_out_span_by_span_and_counted(student, aligned):
    good = encode(student, " The answer is 7")
    completion = good[:2] + ids(student, "©") + good[2:] + [student.eos_token_id]  # a lone continuation byte
    row = aligned.align([completion])[0]
    assert row.student_spans[2] in row.ruled_out and row.masked["invalid_utf8"] >= 1
    assert {row.student_spans[0], row.student_spans[-2]}.isdisjoint(row.ruled_out)  # the rest is scored
    assert row.student_spans[2] not in row.teacher_spans  # the teacher's U+FFFD is never its score
    assert sum(row.masked.values()) == sum(span in row.ruled_out for span in row.student_spans)


def test_a_special_token_inside_is_ruled_out_and_never_rendered_as_text(student, aligned, triplets):
    good = encode(student, " The answer is 7")
    completion = good[:2] + [student.convert_tokens_to_ids("<|im_start|>")] + good[2:] + [student.eos_token_id]
    row = aligned.align([completion])[0]
    assert row.student_spans[2] in row.ruled_out and row.masked["special_token"] >= 1
    assert "im_start" not in triplets.decode(row.teacher_ids)


def test_a_special_tokens_name_written_as_text_is_text_to_the_teacher(student, aligned, triplets):
    completion = encode(student, "x<|eot_id|>y") + [student.eos_token_id]
    row = aligned.align([completion])[0]
    eot = triplets.convert_tokens_to_ids("<|eot_id|>")
    assert row.teacher_ids.count(eot) == 1 and row.teacher_ids[-1] == eot  # only the real end of turn
    assert sum(row.masked.values()) == 0


def test_a_non_canonical_sample_is_ruled_out_and_counted(student, aligned):
    canonical = encode(student, " The answer is 7")
    assert student.convert_ids_to_tokens(canonical)[2:6] == ["Ġ", "an", "sw", "er"]
    completion = canonical[:3] + ids(student, "a", "n") + canonical[4:] + [student.eos_token_id]
    row = aligned.align([completion])[0]
    assert {row.student_spans[3], row.student_spans[4]} <= row.ruled_out and row.masked["non_canonical"] >= 2
    assert row.student_spans[-1] not in row.ruled_out  # the end is still scored


def test_ruled_out_spans_reach_the_loss_as_the_teacher_ruling_them_out(teacher_dir, tmp_path):
    # Left out of the loss, such spans would absorb the probability pushed off the scored tokens (docs/method.md §11)
    trainer = cross_trainer(teacher_dir, tmp_path)
    student = trainer.processing_class
    batch = trainer.generate_completions([trainer.train_dataset[i] for i in range(2)])
    good = encode(student, " The answer is 7")
    crafted = [good[:2] + ids(student, "©") + good[2:] + [student.eos_token_id], good + [student.eos_token_id]]
    width = max(map(len, crafted))
    batch["completion_ids"] = torch.tensor([row + [student.pad_token_id] * (width - len(row)) for row in crafted])
    batch["completion_mask"] = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in crafted])
    scored = trainer.score_completions(batch, old_logps=True)
    delta = scored["teacher_logps"] - scored["old_logps"]
    assert torch.isneginf(delta[0, 2]) and torch.isfinite(delta[0, :2]).all() and torch.isfinite(delta[1, :7]).all()
    advantages = compute_advantages(
        "sign",
        teacher_logps=scored["teacher_logps"],
        old_logps=scored["old_logps"],
        mask=scored["completion_mask"],
        span_ids=scored["span_ids"],
    )
    assert advantages[0, 2] == -1


def test_a_truncated_completion_gets_no_end_and_its_last_pre_token_is_masked(student, aligned, triplets):
    completion = encode(student, "The answer is \\boxed{13")  # cut off inside the number
    row = aligned.align([completion])[0]
    assert triplets.convert_tokens_to_ids("<|eot_id|>") not in row.teacher_ids
    tokens = student.convert_ids_to_tokens(completion)
    assert [row.student_spans[i] for i in (-2, -1)] == [-1, -1] and tokens[-2:] == ["1", "3"]
    assert row.masked["truncated_tail"] == 2 and row.student_spans[0] >= 0


def test_an_empty_completion_is_its_end_span_alone(student, aligned, triplets):
    (row,) = aligned.align([[student.eos_token_id]])
    assert row.teacher_ids == [triplets.convert_tokens_to_ids("<|eot_id|>")]
    assert row.student_spans == row.teacher_spans == [0]


# ----------------------------------------------------------------------------------------------------------------------
# Span statistics, on enumerated values
# ----------------------------------------------------------------------------------------------------------------------


def test_each_span_counts_once_in_the_tv_estimate_and_the_sequence_scale():
    old = torch.tensor([[-0.5, -0.2, -0.1, -0.6]])
    teacher_sums = torch.tensor([[-1.0, 0.0, -3.0, -0.5]])  # span 1's teacher sum on its last token
    span_ids = torch.tensor([[0, 1, 1, 2]])
    mask = torch.ones(1, 4)
    teacher = align_teacher_logps(teacher_sums, old, span_ids)
    delta = [-0.5, -3.0 - (-0.3), 0.1]  # per span
    torch.testing.assert_close(teacher - old, torch.tensor([[delta[0], delta[1], delta[1], delta[2]]]))
    u, n = tv_estimate(teacher, old, mask, span_ids=span_ids)
    assert n == 3 and u.item() == pytest.approx(sum(-math.expm1(min(d, 0.0)) for d in delta), rel=1e-6)
    scale = sum(map(abs, delta)) / 3  # S over spans, not tokens
    advantages = compute_advantages(
        "sequence_constant", teacher_logps=teacher, old_logps=old, mask=mask, span_ids=span_ids
    )
    torch.testing.assert_close(advantages, torch.tensor([[-scale, -scale, -scale, scale]]))
    shuffled = compute_advantages(
        "shuffle",
        teacher_logps=teacher,
        old_logps=old,
        mask=mask,
        span_ids=span_ids,
        generator=torch.Generator().manual_seed(0),
    )
    assert shuffled[0, 1] == shuffled[0, 2]  # a span's tokens keep one coefficient
    with pytest.raises(ValueError, match="not defined on span log-ratios"):
        compute_advantages("power", teacher_logps=teacher, old_logps=old, mask=mask, span_ids=span_ids, gamma=0.5)


# ----------------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------------


def cross_trainer(teacher_dir, tmp_path, **overrides):
    return tiny_pair_trainer(tiny_config(tmp_path, cross_tokenizer=True, **overrides), teacher_model=teacher_dir)


def test_the_setup_reads_each_vocabulary_twice(teacher_dir, tmp_path, monkeypatch):
    # Each read builds a dict of every token (0.15 s for 150k ids): one for the shared-vocabulary check, computed
    # once per teacher, and one for the byte table (tests/test_real_vocabularies.py, docs/performance.md §14)
    reads = collections.Counter()
    get_vocab = PreTrainedTokenizerFast.get_vocab

    def counted(tokenizer):
        reads[tokenizer.name_or_path] += 1
        return get_vocab(tokenizer)

    monkeypatch.setattr(PreTrainedTokenizerFast, "get_vocab", counted)
    cross_trainer(teacher_dir, tmp_path)
    assert reads == {student_path(): 2, teacher_dir: 2}


def test_span_log_ratios_are_the_teachers_sums_minus_the_students(teacher_dir, tmp_path):
    trainer = cross_trainer(teacher_dir, tmp_path)
    prompts = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(prompts), old_logps=True)
    teacher = trainer.teachers["teacher"].model
    alignment = trainer.alignments["teacher"]
    delta = batch["teacher_logps"] - batch["old_logps"]
    checked = 0
    for row in range(len(prompts)):
        length = int(batch["completion_mask"][row].sum())
        completion = batch["completion_ids"][row, :length].tolist()
        (aligned,) = alignment.align([completion])
        prompt = alignment.teacher_prompt_ids(prompts[row]["prompt"])
        ids = torch.tensor([prompt + aligned.teacher_ids])
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / trainer.temperature
        token_logps = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        for span in set(aligned.student_spans) - {-1}:
            teacher_sum = sum(
                lp for lp, s in zip(token_logps.tolist(), aligned.teacher_spans, strict=True) if s == span
            )
            tokens = [t for t, s in enumerate(aligned.student_spans) if s == span]
            student_sum = batch["old_logps"][row, tokens].sum().item()
            for t in tokens:
                assert delta[row, t].item() == pytest.approx(teacher_sum - student_sum, abs=1e-4)
                checked += 1
        masked = [t for t, s in enumerate(aligned.student_spans) if s == -1]
        assert torch.isnan(batch["teacher_logps"][row, masked]).all()
    assert checked >= 8

    # Without pi_old, the loss pass aligns the teacher's span sums to its own pi_old the same way
    unaligned = trainer.score_completions({k: v for k, v in batch.items() if k not in ("old_logps", "teacher_logps")})
    torch.testing.assert_close(
        align_teacher_logps(unaligned["teacher_logps"], batch["old_logps"], unaligned["span_ids"]),
        batch["teacher_logps"],
        equal_nan=True,
    )


def test_a_teacher_with_the_students_vocabulary_keeps_the_token_path_flag_or_not(tmp_path):
    scored = []
    for flag in (False, True):
        trainer = tiny_pair_trainer(tiny_config(tmp_path / str(flag), cross_tokenizer=flag))
        assert trainer.alignments == {}
        torch.manual_seed(0)
        batch = trainer.generate_and_score([trainer.train_dataset[i] for i in range(4)])
        assert "span_ids" not in batch and "teacher_prompt_ids" not in batch
        scored.append(batch)
    for key in ("completion_ids", "teacher_logps"):
        torch.testing.assert_close(scored[0][key], scored[1][key], rtol=0, atol=0)


def test_a_cross_tokenizer_run_trains_and_logs_its_span_metrics(teacher_dir, tmp_path):
    trainer = cross_trainer(teacher_dir, tmp_path, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)
    for entry in logs:
        assert entry["cross_tokenizer/student_tokens_per_span"] >= 1
        assert entry["cross_tokenizer/teacher_tokens_per_span"] >= 1
        assert entry["cross_tokenizer/max_span_tokens"] >= 1
        assert 0 <= entry["cross_tokenizer/masked_fraction"] <= 1
        assert 0 < entry["tv/estimate"] <= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_teachers_of_both_kinds_are_routed_each_to_its_own_path(teacher_dir, tmp_path):
    dataset = prompt_dataset("opd", 8).add_column("teacher_id", ["same", "other"] * 4)
    trainer = tiny_pair_trainer(
        tiny_config(tmp_path, cross_tokenizer=True, max_steps=1),
        teacher_model={"same": teacher_path(), "other": teacher_dir},
        teacher_processing_class={"other": other_family_tokenizer(digits=3)},
        train_dataset=dataset,
    )
    assert list(trainer.alignments) == ["other"]
    batch = trainer.score_completions(trainer.generate_completions([dataset[i] for i in range(8)]))
    same = batch["teacher_index"] == 0
    assert (batch["teacher_prompt_mask"][same] == 0).all() and (batch["teacher_prompt_mask"][~same].sum(1) > 0).all()
    mask = batch["completion_mask"][same].bool()
    positions = torch.arange(mask.size(1)).expand_as(mask)
    assert torch.equal(batch["span_ids"][same], torch.where(mask, positions, -1))  # a span per token
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)[same]
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)[same]
    alone = trainer._sampled_token_logps(trainer.teachers["same"].model, ids, attention, mask.size(1))
    torch.testing.assert_close(batch["teacher_logps"][same], alone, rtol=0, atol=0)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert "cross_tokenizer/other/masked_fraction" in logged and "cross_tokenizer/same/masked_fraction" not in logged


def test_tools_with_another_tokenizer_are_refused(teacher_dir, tmp_path):
    # The embedded student's template renders no tool call (TRL refuses tools for it): the check is called as the
    # trainer calls it, on a trainer given tools afterwards
    trainer = cross_trainer(teacher_dir, tmp_path)
    trainer.tools = [max]
    with pytest.raises(ValueError, match="Tool calling with a teacher of another tokenizer"):
        teacher_alignments(trainer, {"teacher": AutoTokenizer.from_pretrained(teacher_dir)})


def test_a_teacher_with_a_smaller_vocabulary_than_the_students_scores_its_own(tmp_path):
    tokenizer = other_family_tokenizer(digits=1, vocab_size=280)
    path = tmp_path / "small"
    other_family_teacher(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = cross_trainer(str(path), tmp_path / "out", max_steps=1)
    assert len(tokenizer) < len(trainer.processing_class)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_teacher_prompts_reach_teachers_of_both_kinds(teacher_dir, tmp_path):
    dataset = prompt_dataset("opd", 8).add_column("teacher_id", ["same", "other"] * 4)
    hints = [[{"role": "system", "content": f"hint {i}"}, *row["prompt"]] for i, row in enumerate(dataset)]
    dataset = dataset.add_column("teacher_prompt", hints)
    trainer = tiny_pair_trainer(
        tiny_config(tmp_path, cross_tokenizer=True),
        teacher_model={"same": teacher_path(), "other": teacher_dir},
        teacher_processing_class={"other": other_family_tokenizer(digits=3)},
        train_dataset=dataset,
    )
    rows = [dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(rows))
    teacher = trainer.teachers["same"].model
    for index, row in enumerate(rows):
        own = batch["teacher_prompt_ids"][index][batch["teacher_prompt_mask"][index].bool()].tolist()
        if row["teacher_id"] == "other":  # rendered by the other family's tokenizer and chat template
            assert own == trainer.alignments["other"].teacher_prompt_ids(row["teacher_prompt"])
            continue
        rendered = trainer.processing_class.apply_chat_template(
            row["teacher_prompt"], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert own == rendered
        length = int(batch["completion_mask"][index].sum())
        ids = torch.tensor([rendered + batch["completion_ids"][index, :length].tolist()])
        alone = trainer._sampled_token_logps(teacher, ids, torch.ones_like(ids), length)
        torch.testing.assert_close(batch["teacher_logps"][index, :length], alone[0], rtol=0, atol=1e-5)
