"""The CPU LM-head kernel: exact against log_softmax, and the trainer's choice between it and TRL's fused head."""

import math

import pytest
import torch

from tvopd_trl.chunked_logprob import ChunkedSampledLogProb, sampled_token_logprobs
from tvopd_trl.testing import tiny_config


def reference(hidden, weight, bias, targets, temperature):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [5, 7, 64])  # several chunks with a ragged last one, and a single chunk
def test_matches_log_softmax_and_its_gradients_in_float64(chunk_size, with_bias):
    generator = torch.Generator().manual_seed(0)
    vocab, hidden_size, rows = 23, 6, 9
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.tensor([0, 22, 4, 5, 6, 7, 13, 14, 21])  # both edges of every chunk width above
    upstream = torch.randn(rows, generator=generator, dtype=torch.float64)

    got, entropy = ChunkedSampledLogProb.apply(hidden, weight, bias, targets, 0.7, chunk_size, True)
    want = reference(hidden, weight, bias, targets, 0.7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    log_p = torch.log_softmax((hidden @ weight.T + (0 if bias is None else bias)) / 0.7, dim=-1)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), rtol=0, atol=1e-12)
    assert not entropy.requires_grad

    inputs = [t for t in (hidden, weight, bias) if t is not None]
    got_grads = torch.autograd.grad(got, inputs, upstream)
    want_grads = torch.autograd.grad(want, inputs, upstream)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-13)


def test_entropy_is_exact_for_peaked_and_flat_rows_in_float32():
    # A row whose mass sits in one chunk (others underflow to 0) and a uniform row (entropy log V)
    vocab = 50
    hidden = torch.tensor([[80.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    weight = torch.zeros(vocab, 4)
    weight[3, 0] = 1.0
    targets = torch.tensor([3, 7])
    logps, entropy = sampled_token_logprobs(hidden, weight, None, targets, chunk_size=16, return_entropy=True)
    log_p = torch.log_softmax(hidden @ weight.T, dim=-1)
    want = -(torch.special.xlogy(log_p.exp(), log_p.exp())).sum(-1)
    torch.testing.assert_close(entropy, want, rtol=0, atol=1e-5)
    assert entropy[1].item() == pytest.approx(torch.log(torch.tensor(50.0)).item(), abs=1e-5)
    torch.testing.assert_close(logps, log_p.gather(-1, targets[:, None])[:, 0], rtol=0, atol=1e-5)


def test_scores_in_float32_whatever_the_input_dtype_and_keeps_the_target_shape():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 8, generator=generator).to(torch.bfloat16)
    weight = torch.randn(40, 8, generator=generator).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 40, (2, 3), generator=generator)

    logps = sampled_token_logprobs(hidden, weight, None, targets, chunk_size=16)
    assert logps.dtype == torch.float32 and logps.shape == (2, 3)
    torch.testing.assert_close(logps, reference(hidden.float(), weight.float(), None, targets, 1.0), rtol=0, atol=1e-5)
    logps.sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and torch.isfinite(weight.grad.float()).all()


def test_bf16_operands_give_their_exact_products_summed_in_float32():
    """`compute_dtype=torch.bfloat16`: the log-probabilities of the operands rounded to bf16, with the logits never
    rounded; the gradients are those of the bf16 operands, summed in float32 (on CPU the logits' gradient stays float32:
    the operands are upcast there anyway)."""
    generator = torch.Generator().manual_seed(2)
    vocab, hidden_size, rows = 37, 16, 11
    hidden = (torch.randn(rows, hidden_size, generator=generator) * 3).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).requires_grad_()
    bias = torch.randn(vocab, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    upstream = torch.randn(rows, generator=generator)

    logps, entropy = sampled_token_logprobs(
        hidden, weight, bias, targets, 0.7, chunk_size=10, return_entropy=True, compute_dtype=torch.bfloat16
    )
    assert logps.dtype == entropy.dtype == torch.float32
    rounded_hidden, rounded_weight = (t.detach().bfloat16().double().requires_grad_() for t in (hidden, weight))
    exact_bias = bias.detach().double().requires_grad_()
    logits = (rounded_hidden @ rounded_weight.T + exact_bias) / 0.7
    want = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logps.double(), want, rtol=1e-6, atol=1e-6)  # float32 sums of exact products
    # Not the float32 head's values: the operands' rounding moves them by far more than float32's
    assert (logps - sampled_token_logprobs(hidden, weight, bias, targets, 0.7, chunk_size=10)).abs().max() > 1e-3

    grads = torch.autograd.grad(logps, [hidden, weight, bias], upstream)
    (logits_grad,) = torch.autograd.grad(want, logits, upstream.double())
    logits_grad = logits_grad / 0.7
    want_grads = [logits_grad @ rounded_weight.detach(), logits_grad.T @ rounded_hidden.detach(), logits_grad.sum(0)]
    # The hidden states' gradient leaves the head as bf16 (the operand's dtype), as autocast's matmul gives it: one
    # bf16 rounding of the float32 sum, so within half an ulp (2^-9 relative); the head's own gradients stay float32
    for got, expected, rtol in zip(grads, want_grads, (2**-8, 1e-5, 1e-5), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=1e-5)


def test_the_trainer_s_head_precision_follows_the_config(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, lm_head_precision="float32"))
    weight = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert trainer._lm_head_dtype(weight) == torch.float32
    assert trainer._scores_with_trl_kernels(trainer.model, torch.device("cuda"))  # TRL's Triton kernels
    trainer.args.lm_head_precision = "model"
    assert trainer._lm_head_dtype(weight) == torch.bfloat16
    assert trainer._lm_head_dtype(weight.float()) == torch.float32  # a float32 model without autocast (CPU)
    # On a GPU, TRL's head cannot keep float32 logits from bf16 operands: this module's head takes over
    assert not trainer._scores_with_trl_kernels(trainer.model, torch.device("cuda"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_scores_like_trls_fused_head_on_cpu(make_trainer, tmp_path, monkeypatch, temperature):
    """On CPU the trainer uses the kernel above; its values and gradients equal those of TRL's fused head."""
    trainer = make_trainer(tiny_config(tmp_path, temperature=temperature))
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    attention_mask[0, -3:] = 0  # a padded completion
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]

    def score(use_trl):
        monkeypatch.setattr(type(trainer), "_scores_with_trl_kernels", lambda self, model, device: use_trl)
        logps = trainer._sampled_token_logps(trainer.model, input_ids, attention_mask, keep)
        return logps, torch.autograd.grad(logps.sum(), parameters)

    ours, our_grads = score(use_trl=False)
    trls, trl_grads = score(use_trl=True)
    torch.testing.assert_close(ours, trls, rtol=1e-5, atol=1e-5)
    assert (ours[attention_mask[:, -keep:] == 0] == 0).all()  # padding scores 0, as in TRL's head
    for got, want in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_trainer_keeps_trls_head_where_ours_does_not_apply(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path))
    cpu = torch.device("cpu")
    assert not trainer._scores_with_trl_kernels(trainer.model, cpu)
    trainer.accelerator.unwrap_model(trainer.model).config.final_logit_softcapping = 30.0
    assert trainer._scores_with_trl_kernels(trainer.model, cpu)  # post-processed logits: only TRL reproduces them


def test_an_unknown_head_precision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lm_head_precision must be 'float32' or 'model'"):
        tiny_config(tmp_path, lm_head_precision="bfloat16")


def test_a_bf16_autocast_student_trains_with_the_head_at_its_precision(make_trainer, tmp_path, monkeypatch):
    """Under bf16 autocast (float32 weights), `"model"` feeds the head bf16 operands; the first step's log-probabilities
    then differ from the float32 head's by the operands' rounding only, and the run trains."""
    import tvopd_trl.scoring as scoring

    dtypes = []

    def spy(*args, compute_dtype, **kwargs):
        dtypes.append(compute_dtype)
        return sampled_token_logprobs(*args, compute_dtype=compute_dtype, **kwargs)

    monkeypatch.setattr(scoring, "sampled_token_logprobs", spy)
    runs = {}
    for precision in ("float32", "model"):
        dtypes.clear()
        trainer = make_trainer(tiny_config(tmp_path / precision, bf16=True, lm_head_precision=precision, max_steps=2))
        trainer.train()
        runs[precision] = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert set(dtypes) == {torch.float32 if precision == "float32" else torch.bfloat16}
    assert all(math.isfinite(entry["loss"]) for entry in runs["model"])
    # The same rollout and weights at the first step: kl/reverse_estimate (a mean of -delta) within bf16 rounding
    first = {precision: runs[precision][0] for precision in runs}
    assert first["model"]["kl/reverse_estimate"] == pytest.approx(first["float32"]["kl/reverse_estimate"], abs=0.05)
    assert first["model"]["kl/reverse_estimate"] != first["float32"]["kl/reverse_estimate"]
