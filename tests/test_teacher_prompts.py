"""Per-row teacher prompts (`teacher_prompt`) and the student as its own teacher (`self_distillation`): what each
teacher scores a completion after, checked against forwards by hand; the errors; the live and frozen self-teacher."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tvopd_trl.trainer
from tvopd_trl import TVOPDTrainer
from tvopd_trl.teacher_prompts import own_teacher_prompt
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import prompt_dataset


def hinted(rows, hint=lambda i: f"hint {i}", every=1):
    """The first `rows` OPD prompts, every `every`-th with a teacher prompt: a system turn with `hint(i)` before the
    student's conversation (the others `None`)."""
    dataset = prompt_dataset("opd", rows)
    teacher_prompts = [
        [{"role": "system", "content": hint(i)}, *row["prompt"]] if i % every == 0 else None
        for i, row in enumerate(dataset)
    ]
    return dataset.add_column("teacher_prompt", teacher_prompts)


def by_hand(model, tokenizer, prompt, completion):
    """log pi(completion token | prompt rendered by the tokenizer's chat template, tokens before it), one row alone."""
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = prompt_ids["input_ids"]
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def completions(batch, row):
    return batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()


def test_each_teacher_scores_after_the_row_s_teacher_prompt(make_trainer, model_dirs, tokenizer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path), train_dataset=hinted(8, every=2))
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(rows))
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"]).eval()
    for index, row in enumerate(rows):
        # Rows 0, 2, ... after their hinted prompt; rows 1, 3, ... (None) after the student's own
        prompt = row["teacher_prompt"] if index % 2 == 0 else row["prompt"]
        completion = completions(batch, index)
        expected = by_hand(teacher, tokenizer, prompt, completion)
        scored = batch["teacher_logps"][index][: len(completion)].double()
        torch.testing.assert_close(scored, expected, rtol=0, atol=1e-5)
        unhinted = by_hand(teacher, tokenizer, row["prompt"], completion)
        assert (index % 2 == 1) == torch.allclose(scored, unhinted, atol=1e-5), index


@pytest.mark.parametrize("empty", [None, "", []], ids=["none", "empty-text", "empty-conversation"])
def test_a_teacher_prompt_equal_to_the_prompt_or_empty_changes_nothing(make_trainer, tmp_path, empty):
    dataset = prompt_dataset("opd", 8)
    plain = make_trainer(tiny_config(tmp_path / "plain"), train_dataset=dataset)
    rows = [dataset[i] for i in range(8)]
    torch.manual_seed(0)
    reference = plain.score_completions(plain.generate_completions(rows))
    for teacher_prompts in ([row["prompt"] for row in rows], [empty] * 8):
        with_column = dataset.add_column("teacher_prompt", teacher_prompts)
        trainer = make_trainer(tiny_config(tmp_path / "column"), train_dataset=with_column)
        torch.manual_seed(0)
        batch = trainer.score_completions(trainer.generate_completions([with_column[i] for i in range(8)]))
        assert torch.equal(batch["completion_ids"], reference["completion_ids"])
        torch.testing.assert_close(batch["teacher_logps"], reference["teacher_logps"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("value", "message"),
    [(3, "got int '3'"), ([{"content": "no role"}], "got list"), (["two", "strings"], "got list")],
)
def test_a_teacher_prompt_of_the_wrong_type_is_refused_before_any_model_loads(value, message, tmp_path):
    dataset = prompt_dataset("opd", 8).add_column("teacher_prompt", [None] * 7 + [value])
    with pytest.raises(
        ValueError, match=rf"Row 7: The `teacher_prompt` column holds text or a conversation.*{message}"
    ):
        TVOPDTrainer(
            model="/missing/student",
            teacher_model="/missing/teacher",
            args=tiny_config(tmp_path),
            train_dataset=dataset,
        )


def test_own_teacher_prompt_reads_text_conversations_and_nothing():
    conversation = [{"role": "user", "content": "x"}]
    assert own_teacher_prompt({"teacher_prompt": "text"}) == "text"
    assert own_teacher_prompt({"teacher_prompt": conversation}) == conversation
    assert own_teacher_prompt({}) is None and own_teacher_prompt({"teacher_prompt": ""}) is None


def test_a_teacher_prompt_without_room_for_the_completion_names_the_fix(make_trainer, tmp_path):
    # The tiny teacher's context is 64 tokens; 8 completion tokens must fit after the teacher prompt
    long_hint = " ".join(["1"] * 60)
    trainer = make_trainer(tiny_config(tmp_path), train_dataset=hinted(8, hint=lambda i: long_hint))
    with pytest.raises(ValueError, match=r"leaves teacher 'teacher''s context of 64 tokens no room for "):
        trainer.train()


def test_exact_divergences_compare_the_student_after_its_prompt_with_the_teacher_after_its_own(
    make_trainer, model_dirs, tokenizer, tmp_path
):
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode="vopd"), train_dataset=hinted(4))
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.score_completions(trainer.generate_completions(rows), exact_divergences=True)
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"]).eval()
    student = AutoModelForCausalLM.from_pretrained(model_dirs["student"]).eval()
    for index, row in enumerate(rows):
        completion = completions(batch, index)
        logps = []
        for model, prompt in ((student, row["prompt"]), (teacher, row["teacher_prompt"])):
            prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt_ids + completion])).logits[0, len(prompt_ids) - 1 : -1]
            logps.append(logits.double().log_softmax(-1))
        reverse_kl = (logps[0].exp() * (logps[0] - logps[1])).sum(-1)
        tv = 0.5 * (logps[0].exp() - logps[1].exp()).abs().sum(-1)
        torch.testing.assert_close(
            batch["reverse_kl"][index][: len(completion)].double(), reverse_kl, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(batch["exact_tv"][index][: len(completion)].double(), tv, atol=1e-5, rtol=0)


def test_several_teachers_each_render_their_rows_teacher_prompts(make_trainer, model_dirs, tokenizer, tmp_path):
    dataset = hinted(8).add_column("teacher_id", ["wide", "self"] * 4)
    teachers = {"wide": model_dirs["teacher"], "self": model_dirs["student"]}
    trainer = make_trainer(tiny_config(tmp_path), teacher_model=teachers, train_dataset=dataset)
    rows = [dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(rows))
    models = {name: AutoModelForCausalLM.from_pretrained(path).eval() for name, path in teachers.items()}
    for index, row in enumerate(rows):
        completion = completions(batch, index)
        expected = by_hand(models[row["teacher_id"]], tokenizer, row["teacher_prompt"], completion)
        torch.testing.assert_close(
            batch["teacher_logps"][index][: len(completion)].double(), expected, atol=1e-5, rtol=0
        )


# ----------------------------------------------------------------------------------------------------------------------
# The student as its own teacher
# ----------------------------------------------------------------------------------------------------------------------


def student_scores(model, tokenizer, rows, batch, prompt_key):
    return [by_hand(model, tokenizer, row[prompt_key], completions(batch, i)) for i, row in enumerate(rows)]


@pytest.mark.parametrize("mode", ["live", "frozen"])
def test_the_self_teacher_is_the_student_after_the_teacher_prompt(mode, make_trainer, model_dirs, tokenizer, tmp_path):
    dataset = hinted(16)
    args = tiny_config(tmp_path, self_distillation=mode, max_steps=3, learning_rate=5e-2)
    trainer = make_trainer(args, teacher_model=None, train_dataset=dataset)
    assert [teacher.live for teacher in trainer.teachers.values()] == [mode == "live"]
    trainer.train()
    assert trainer.model.training  # scoring with the live student left it in its own mode

    rows = [dataset[i] for i in range(4)]
    batch = trainer.score_completions(trainer.generate_completions(rows), old_logps=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    initial = AutoModelForCausalLM.from_pretrained(model_dirs["student"]).eval()
    teacher = trained if mode == "live" else initial
    for index, expected in enumerate(student_scores(teacher, tokenizer, rows, batch, "teacher_prompt")):
        scored = batch["teacher_logps"][index][: len(expected)].double()
        torch.testing.assert_close(scored, expected, atol=1e-5, rtol=0)
    # The student's own pi_old is after its prompt: the hint is what moves the teacher
    for index, expected in enumerate(student_scores(trained, tokenizer, rows, batch, "prompt")):
        torch.testing.assert_close(batch["old_logps"][index][: len(expected)].double(), expected, atol=1e-5, rtol=0)
    moved = [entry["advantage/abs_mean"] for entry in trainer.state.log_history if "advantage/abs_mean" in entry]
    assert len(moved) == 3 and all(value > 0 for value in moved)


def test_a_live_self_teacher_without_teacher_prompts_gives_a_zero_delta(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, self_distillation="live", max_steps=2), teacher_model=None)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "advantage/abs_mean" in entry]
    # The same weights after the same prompt: delta is 0 up to the batch's rounding, and so is the reverse KL
    assert len(logs) == 2 and all(entry["advantage/abs_mean"] < 1e-5 for entry in logs)


@pytest.mark.parametrize(
    ("overrides", "teacher_model"),
    [({}, "some/teacher"), ({"teacher_model_server_url": "http://127.0.0.1:1"}, None)],
)
def test_self_distillation_beside_a_teacher_is_refused(overrides, teacher_model, make_trainer, tmp_path):
    with pytest.raises(ValueError, match="makes the student its own teacher"):
        make_trainer(tiny_config(tmp_path, self_distillation="live", **overrides), teacher_model=teacher_model)


def test_an_unknown_self_distillation_is_refused(tmp_path):
    with pytest.raises(ValueError, match="self_distillation must be 'live'"):
        tiny_config(tmp_path, self_distillation="ema")


def test_padding_free_scores_after_the_teacher_prompts_as_padded(make_trainer, tmp_path):
    # Rows with and without a hint, and the exact divergences: every forward after two prompts of other lengths
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode="vopd"), train_dataset=hinted(8, every=2))
    batch = trainer.generate_completions([trainer.train_dataset[i] for i in range(8)])
    scored = []
    for padding_free in (False, True):
        trainer.args.padding_free = padding_free
        scored.append(trainer.score_completions(dict(batch), exact_divergences=True))
    mask = batch["completion_mask"].bool()
    for key in ("teacher_logps", "reverse_kl", "exact_tv"):
        torch.testing.assert_close(scored[1][key][mask], scored[0][key][mask], atol=1e-5, rtol=0)


def recording_advantages(monkeypatch):
    """The advantages every `compute_loss` computes, appended to the returned list."""
    recorded, original = [], tvopd_trl.trainer.advantages_from_delta

    def record(*args, **kwargs):
        recorded.append(original(*args, **kwargs))
        return recorded[-1]

    monkeypatch.setattr(tvopd_trl.trainer, "advantages_from_delta", record)
    return recorded


@pytest.mark.parametrize("mode", ["tv", "raw"])
def test_a_live_self_teacher_gives_rows_without_a_teacher_prompt_advantage_0_and_no_gradient(
    mode, make_trainer, monkeypatch, tmp_path
):
    # Hinted and unhinted rows in one batch: the teacher's batch is padded to the hinted prompts, whose forward of the
    # same weights rounds the unhinted rows' log-probabilities otherwise (1e-6 apart, a full +-c_k each under tv)
    trainer = make_trainer(
        tiny_config(tmp_path, self_distillation="live", advantage_mode=mode, max_completion_length=16),
        teacher_model=None,
        train_dataset=hinted(16, every=2),
    )
    assert trainer.sign_tolerance == 1e-3  # the float32 self-teacher's default
    trainer.sign_tolerance = 0.0  # the paper's sign: only an exact 0 is a tie
    rows = [trainer.train_dataset[i] for i in range(16)]
    batch = trainer.score_completions(trainer.generate_completions(rows))
    unhinted = torch.arange(16) % 2 == 1
    assert batch["self_scored"].bool().tolist() == unhinted.tolist()
    recorded = recording_advantages(monkeypatch)
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch))
    active = batch["completion_mask"].bool()
    assert (recorded[0][unhinted] == 0).all()
    assert (recorded[0][~unhinted][active[~unhinted]] != 0).any()
    # The unhinted rows alone: loss 0 and no gradient at all
    rows_only = {key: value[unhinted] for key, value in batch.items() if value.dim() > 0}
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, rows_only)
    loss.backward()
    assert loss.item() == 0
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())


QWEN3_LIKE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize("teacher", ["self-live", "path"])
def test_a_teacher_prompt_is_rendered_as_the_student_s_prompt(teacher, make_trainer, model_dirs, tmp_path):
    # A template whose generation prompt depends on `chat_template_kwargs` (Qwen3's empty think block)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["student"], padding_side="left")
    tokenizer.chat_template = QWEN3_LIKE
    dataset = prompt_dataset("opd", 8)
    teacher_prompts = [
        row["prompt"] if i % 2 else [{"role": "system", "content": "hint"}, *row["prompt"]]
        for i, row in enumerate(dataset)
    ]
    dataset = dataset.add_column("teacher_prompt", teacher_prompts)
    overrides = {"self_distillation": "live"} if teacher == "self-live" else {}
    args = tiny_config(tmp_path, chat_template_kwargs={"enable_thinking": False}, **overrides)
    kwargs = {"teacher_model": None} if teacher == "self-live" else {}
    trainer = make_trainer(args, train_dataset=dataset, processing_class=tokenizer, **kwargs)
    if teacher == "path":  # its own tokenizer, in its folder, has the plain template: not used
        assert AutoTokenizer.from_pretrained(model_dirs["teacher"]).chat_template != QWEN3_LIKE
    rows = [dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(rows), old_logps=True)
    for index, row in enumerate(rows):
        own = batch["teacher_prompt_ids"][index][batch["teacher_prompt_mask"][index].bool()].tolist()
        if index % 2:  # the student's own prompt: none of its own, the teacher scores after the student's
            assert own == []
        else:
            expected = tokenizer.apply_chat_template(
                row["teacher_prompt"], add_generation_prompt=True, enable_thinking=False, return_dict=False
            )
            assert own == expected and tokenizer.decode(own).endswith("<think>\n\n</think>\n\n")
    if teacher == "self-live":
        # A teacher prompt that renders to the student's prompt is none: the same model after the same ids, up to the
        # rounding of the teacher batch's padding (which the loss replaces by pi_old itself), where the think block
        # dropped from one side made 7 nats
        unhinted = torch.arange(8) % 2 == 1
        assert batch["self_scored"].bool().tolist() == unhinted.tolist()
        real = batch["completion_mask"].bool() & unhinted.unsqueeze(1)
        assert (batch["teacher_logps"] - batch["old_logps"])[real].abs().max() < 1e-4


def test_a_frozen_self_teacher_from_a_path_loads_as_the_student(make_trainer, tmp_path):
    args = tiny_config(tmp_path, self_distillation="frozen", model_init_kwargs={"dtype": "bfloat16"})
    trainer = make_trainer(args, teacher_model=None)
    teacher = trainer.teachers["teacher"].model
    assert next(teacher.parameters()).dtype == next(trainer.model.parameters()).dtype == torch.bfloat16
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.score_completions(trainer.generate_completions(rows), old_logps=True)
    real = batch["completion_mask"].bool()
    # The student at step 0 after the same prompt: the same numbers, before any update
    assert torch.equal(batch["teacher_logps"][real], batch["old_logps"][real])


def test_teacher_model_init_kwargs_beside_self_distillation_are_refused(tmp_path):
    with pytest.raises(ValueError, match="remove teacher_model_init_kwargs"):
        tiny_config(tmp_path, self_distillation="frozen", teacher_model_init_kwargs={"dtype": "bfloat16"})
