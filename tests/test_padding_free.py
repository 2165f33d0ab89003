"""`padding_free` and `max_tokens_per_micro_batch`: the loss phase's forwards packed by token budget give the padded
log-probabilities, losses, gradients and updates (tiny Qwen2 models built from configs, CPU, one process)."""

import pytest
import torch
from peft import LoraConfig
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.test_multi_teacher import routed
from tests.test_served_teacher import served_trainer, teacher_server  # noqa: F401  (a fixture)
from tvopd_trl import TVOPDTrainer
from tvopd_trl.advantages import ADVANTAGE_MODES
from tvopd_trl.packing import pack_rows, token_budget_chunks, unpack_completions
from tvopd_trl.testing import build_model, tiny_config, tiny_pair_trainer


def uneven(batch, lengths):
    """`batch` with completion i cut to `lengths[i]` tokens (the rest padding), as rows that stopped early are."""
    batch = dict(batch)
    width = batch["completion_ids"].size(1)
    keep = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).to(batch["completion_mask"].dtype)
    batch["completion_mask"] = batch["completion_mask"] * keep
    batch["completion_ids"] = batch["completion_ids"].masked_fill(keep == 0, 0)
    return batch


def generated(trainer, rows=4, lengths=None):
    """A generated batch of `rows` prompts (uneven prompts, left-padded), its completions cut to `lengths`."""
    batch = trainer.generate_completions([trainer.train_dataset[i] for i in range(rows)])
    return uneven(batch, lengths or [8, 1, 5, 3, 8, 2, 7, 4][:rows])


def sequences(batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return ids, mask, batch["completion_ids"].size(1)


def both_layouts(trainer, function, max_tokens_per_micro_batch=None):
    """`function()` run padded, then packed (in forwards of at most `max_tokens_per_micro_batch` tokens)."""
    args = trainer.args
    outputs = [function()]
    args.padding_free, args.max_tokens_per_micro_batch = True, max_tokens_per_micro_batch
    try:
        outputs.append(function())
    finally:
        args.padding_free, args.max_tokens_per_micro_batch = False, None
    return outputs


def test_pack_rows_puts_each_rows_real_tokens_back_to_back():
    # Prompts left-padded, completions right-padded, as TRL's batches are
    input_ids = torch.tensor([[0, 11, 12, 13, 14, 0], [21, 22, 23, 24, 25, 26], [0, 0, 31, 32, 0, 0]])
    attention_mask = (input_ids != 0).long()
    packed = pack_rows(input_ids, attention_mask, logits_to_keep=3)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24, 25, 26, 31, 32]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert packed.targets.tolist() == [13, 14, 24, 25, 26, 32]
    # Each target is predicted by the packed position just before it, in its own row
    assert packed.input_ids[0, packed.predictors + 1].tolist() == packed.targets.tolist()
    assert packed.predictors.tolist() == [1, 2, 6, 7, 8, 10]
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    unpacked = unpack_completions(scores, packed)
    assert unpacked.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [6.0, 0.0, 0.0]]
    unpacked.sum().backward()
    assert scores.grad.tolist() == [1.0] * 6


@pytest.mark.parametrize("row", [0, 1])
def test_pack_rows_refuses_a_completion_with_no_token_before_it(row):
    # A prompt that tokenized to nothing: its first completion token would be scored from the previous row's last token
    # (from the pack's last one in row 0)
    input_ids = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
    input_ids[row, :2] = 0
    with pytest.raises(ValueError, match=rf"row {row} has no token before its first completion token.*BOS"):
        pack_rows(input_ids, (input_ids != 0).long(), logits_to_keep=2)
    # A row with neither a prompt nor a completion token scores nothing and is packed to nothing
    input_ids[row, 2:] = 0
    packed = pack_rows(input_ids, (input_ids != 0).long(), logits_to_keep=2)
    assert packed.input_ids.tolist() == [input_ids[1 - row].tolist()] and packed.targets.numel() == 2
    assert packed.scored[row].tolist() == [False, False]


def test_token_budget_chunks():
    lengths = torch.tensor([3, 4, 9, 1, 1, 2])
    assert token_budget_chunks(lengths, 8) == [slice(0, 2), slice(2, 3), slice(3, 6)]  # the 9-token row goes alone
    assert token_budget_chunks(lengths, 100) == [slice(0, 6)]
    # As many forwards as another process needs: the costliest chunks are halved
    assert token_budget_chunks(lengths, 100, count=3) == [slice(0, 1), slice(1, 3), slice(3, 6)]


@pytest.mark.parametrize("trl_kernels", [False, True], ids=["chunked_logprob", "trl_fused_head"])
def test_packed_log_probs_equal_the_padded_ones_row_by_row(make_trainer, tmp_path, monkeypatch, trl_kernels):
    monkeypatch.setattr(TVOPDTrainer, "_scores_with_trl_kernels", lambda self, model, device: trl_kernels)
    trainer = make_trainer(tiny_config(tmp_path, per_device_train_batch_size=2))
    batch = generated(trainer, rows=6)
    ids, mask, keep = sequences(batch)
    real = batch["completion_mask"].bool()
    assert len(set(mask.sum(1).tolist())) > 2, "the rows must be uneven"
    for model, with_entropy in ((trainer.model, True), (trainer.teacher_model, False)):
        padded, packed = both_layouts(
            trainer,
            lambda model=model, with_entropy=with_entropy: trainer._sampled_token_logps(
                model, ids, mask, keep, with_entropy=with_entropy
            ),
        )
        for got, want in zip(*(scores if with_entropy else [scores] for scores in (packed, padded)), strict=True):
            assert (got[~real] == 0).all()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The rollout's signals, exact divergences included, through a token budget of about two rows
    padded, packed = both_layouts(
        trainer,
        lambda: trainer.score_completions(dict(batch), old_logps=True, exact_divergences=True),
        max_tokens_per_micro_batch=int(mask.sum(1).max()) * 2,
    )
    for key in ("teacher_logps", "old_logps", "reverse_kl", "exact_tv"):
        torch.testing.assert_close(packed[key][real], padded[key][real], rtol=0, atol=1e-5)


def test_eager_attention_masks_packed_rows_too(make_trainer, model_dirs, tmp_path):
    # (flex_attention masks them as well, but has no backward on CPU and compiles for a minute)
    models = {
        role: AutoModelForCausalLM.from_pretrained(model_dirs[role], attn_implementation="eager")
        for role in ("student", "teacher")
    }
    trainer = make_trainer(tiny_config(tmp_path), model=models["student"], teacher_model=models["teacher"])
    ids, mask, keep = sequences(generated(trainer))
    for model in (trainer.model, trainer.teacher_model):
        assert model.config._attn_implementation == "eager"
        padded, packed = both_layouts(
            trainer, lambda model=model: trainer._sampled_token_logps(model, ids, mask, keep)
        )
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_a_token_budget_without_packing_counts_padded_rows(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, per_device_train_batch_size=8))
    ids, mask, keep = sequences(generated(trainer, rows=6))
    whole = trainer._sampled_token_logps(trainer.teacher_model, ids, mask, keep)
    trainer.args.max_tokens_per_micro_batch = 2 * ids.size(1) + 1  # two padded rows per forward, uneven or not
    assert trainer._row_chunks(mask, trainer.teacher_model) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    torch.testing.assert_close(trainer._sampled_token_logps(trainer.teacher_model, ids, mask, keep), whole)


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_losses_and_gradients_equal_the_padded_ones_in_every_mode(make_trainer, tmp_path, mode):
    trainer = make_trainer(tiny_config(tmp_path, advantage_mode=mode))
    trainer.model.train()
    batch = trainer.score_completions(generated(trainer), exact_divergences=mode == "vopd")
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def loss_and_grads():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        return loss, torch.autograd.grad(loss, params)

    (padded_loss, padded_grads), (packed_loss, packed_grads) = both_layouts(
        trainer,
        loss_and_grads,
        max_tokens_per_micro_batch=45,  # rows of 18 to 25 tokens: two per forward
    )
    assert padded_loss.abs() > 0
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_lora_student_scores_packed_as_padded_with_its_adapter(make_trainer, tmp_path):
    # A random adapter (init_lora_weights=False), so that leaving it out would change the scores
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = make_trainer(tiny_config(tmp_path), peft_config=lora)
    ids, mask, keep = sequences(generated(trainer))
    padded, packed = both_layouts(trainer, lambda: trainer._sampled_token_logps(trainer.model, ids, mask, keep))
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    with trainer.model.disable_adapter():
        _, without_adapter = both_layouts(
            trainer, lambda: trainer._sampled_token_logps(trainer.model, ids, mask, keep)
        )
    assert (without_adapter - packed).abs().max() > 1e-3


def test_several_teachers_score_their_rows_as_padded(make_trainer, model_dirs, tmp_path):
    teachers = {"wide": model_dirs["teacher"], "self": model_dirs["student"]}
    trainer = make_trainer(tiny_config(tmp_path), teacher_model=teachers, train_dataset=routed(8))
    batch = uneven(
        trainer.generate_completions([trainer.train_dataset[i] for i in range(8)]), [8, 1, 5, 3, 8, 2, 7, 4]
    )
    padded, packed = both_layouts(
        trainer, lambda: trainer.score_completions(dict(batch)), max_tokens_per_micro_batch=45
    )
    real = batch["completion_mask"].bool()
    torch.testing.assert_close(packed["teacher_logps"][real], padded["teacher_logps"][real], rtol=0, atol=1e-5)


def test_a_served_teacher_trains_padding_free_as_padded(make_trainer, teacher_server, tmp_path, tokenizer):  # noqa: F811
    runs = []
    for padding_free in (False, True):
        trainer = served_trainer(
            make_trainer,
            teacher_server,
            tmp_path / str(padding_free),
            tokenizer,
            padding_free=padding_free,
            max_steps=2,
            optim="sgd",
        )
        trainer.train()
        runs.append((trainer.state.log_history, dict(trainer.model.named_parameters())))
    (padded_logs, padded_params), (packed_logs, packed_params) = runs
    for padded, packed in zip(padded_logs, packed_logs, strict=True):
        if "loss" in padded:
            assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-4, abs=1e-6)
    for name, param in packed_params.items():
        torch.testing.assert_close(param, padded_params[name], rtol=1e-4, atol=1e-6)


def test_uneven_rows_over_gradient_accumulation_give_the_padded_update(tmp_path):
    """One rollout of 8 prompts per step: padded in one micro-batch of 8 rows, against packed in 2 micro-batches of 4
    rows of 23 or 24 tokens whose forwards a 50-token budget splits in two. The shipped tiny student stops at uneven lengths. The token
    mean over the step is exact in both, so the updates agree."""
    runs = []
    for padding_free, rows, accumulation in ((False, 8, 1), (True, 4, 2)):
        args = tiny_config(
            tmp_path / str(padding_free),
            padding_free=padding_free,
            max_tokens_per_micro_batch=50 if padding_free else None,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=accumulation,
            max_steps=2,
            advantage_mode="raw",
            optim="sgd",  # an update linear in the gradient: AdamW would magnify rounding where a gradient is ~0
        )
        trainer = tiny_pair_trainer(args)
        forwards = []

        def recording(mask, model, original=trainer._row_chunks, forwards=forwards):
            forwards.append((mask.sum(1), original(mask, model)))
            return forwards[-1][1]

        trainer._row_chunks = recording
        trainer.train()
        runs.append((trainer, forwards))
    (padded, _), (packed, forwards) = runs
    assert any(len(set(lengths.tolist())) > 1 for lengths, _ in forwards), "the rows must be uneven"
    assert any(len(chunks) > 1 and chunks[0].stop - chunks[0].start > 1 for _, chunks in forwards), (
        "the budget must split a micro-batch into forwards of several packed rows"
    )
    for padded_log, packed_log in zip(padded.state.log_history, packed.state.log_history, strict=True):
        for key in ("loss", "tv/estimate", "entropy"):
            if key in padded_log:
                assert packed_log[key] == pytest.approx(padded_log[key], rel=1e-4, abs=1e-6), key
    packed_params = dict(packed.model.named_parameters())
    for name, param in padded.model.named_parameters():
        torch.testing.assert_close(packed_params[name], param, rtol=1e-4, atol=1e-6)


def test_an_attention_that_cannot_mask_packed_rows_is_refused(make_trainer, model_dirs, tokenizer, tmp_path):
    # An implementation transformers' masking utilities do not know gets no mask at all: packed rows see each other
    AttentionInterface.register("unmasked_sdpa", sdpa_attention_forward)
    model = build_model(tokenizer, seed=0, hidden_size=16, num_layers=1).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    packed = pack_rows(ids, mask, logits_to_keep=3)
    with torch.no_grad():
        for implementation, separated in (("sdpa", True), ("unmasked_sdpa", False)):
            model.set_attn_implementation(implementation)
            hidden = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            second_row = model.model(input_ids=ids[1:], use_cache=False).last_hidden_state[0]
            assert torch.allclose(hidden.last_hidden_state[0, 6:], second_row, atol=1e-5) == separated

    student = AutoModelForCausalLM.from_pretrained(model_dirs["student"], attn_implementation="unmasked_sdpa")
    with pytest.raises(ValueError, match=r"the student runs attn_implementation='unmasked_sdpa'.*'sdpa'"):
        make_trainer(tiny_config(tmp_path, padding_free=True), model=student)
    make_trainer(tiny_config(tmp_path, padding_free=False), model=student)  # only padding_free refuses it
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs["teacher"], attn_implementation="unmasked_sdpa")
    with pytest.raises(ValueError, match=r"the teacher runs attn_implementation='unmasked_sdpa'"):
        make_trainer(tiny_config(tmp_path, padding_free=True), teacher_model=teacher)


def test_a_token_budget_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        tiny_config(tmp_path, max_tokens_per_micro_batch=0)
