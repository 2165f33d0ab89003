"""The speculative-sampling acceptance rate (`tvopd_trl.speculative`): the formulas on enumerated cases, the exact and
estimated acceptance of tiny random models against an enumeration prefix by prefix, the counting of transformers'
assisted generation, and, on the real SmolLM2-135M-Instruct with its first 4 layers as the draft, the library's
estimate against the acceptance transformers' verifier measures at the same states."""

import copy

import pytest
import torch
import transformers.generation.utils as generation_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.speculative import (
    estimate_acceptance,
    expected_tokens_per_verification,
    measure_assisted_acceptance,
    own_state_acceptance,
    truncated_draft,
    wilson_interval,
)
from tvopd_trl.testing import build_model


def test_expected_tokens_per_verification():
    assert expected_tokens_per_verification(0.0, 4) == 1.0
    assert expected_tokens_per_verification(1.0, 4) == 5.0
    # 1 + a + a^2 at a = 1/2
    assert expected_tokens_per_verification(0.5, 2) == pytest.approx(1.75, abs=1e-12)
    assert expected_tokens_per_verification(1 - 1e-9, 3) == pytest.approx(4.0, abs=1e-6)


def test_wilson_interval():
    # No successes in 10 trials: the upper bound is z^2 / (n + z^2)
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(1.959964**2 / (10 + 1.959964**2), abs=1e-6)
    low, high = wilson_interval(50, 100)
    assert (low + high) / 2 == pytest.approx(0.5, abs=1e-12) and high - low == pytest.approx(0.1920, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def padded(sequences, pad_id, left=False):
    """Rows of different lengths as one `(B, T)` batch and its attention mask."""
    length = max(len(row) for row in sequences)
    input_ids = torch.full((len(sequences), length), pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(sequences):
        span = slice(length - len(row), length) if left else slice(0, len(row))
        input_ids[index, span] = torch.tensor(row)
        attention_mask[index, span] = 1
    return input_ids, attention_mask


def enumerated_acceptance(target, draft, prefix, temperature):
    """sum_v min(p_v, q_v) after `prefix`, from each model's forward over the prefix alone."""
    with torch.no_grad():
        p = (target(input_ids=torch.tensor([prefix])).logits[0, -1].double() / temperature).softmax(-1)
        q = (draft(input_ids=torch.tensor([prefix])).logits[0, -1].double() / temperature).softmax(-1)
    return sum(min(pv, qv) for pv, qv in zip(p.tolist(), q.tolist(), strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("left", [False, True])
def test_estimate_acceptance_matches_an_enumeration(tokenizer, temperature, left):
    target = build_model(tokenizer, seed=1, hidden_size=48)
    draft = build_model(tokenizer, seed=0)
    rows = [[1, 277, 201, 19, 13, 20, 31, 2, 201, 40, 41, 42], [1, 268, 201, 50, 51, 52, 53]]
    prompt_lengths = [9, 3]
    input_ids, attention_mask = padded(rows, tokenizer.pad_token_id, left=left)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    expected = []
    for index, (row, prompt_length) in enumerate(zip(rows, prompt_lengths, strict=True)):
        offset = input_ids.shape[1] - len(row) if left else 0
        mask[index, offset + prompt_length : offset + len(row)] = True
        expected += [
            enumerated_acceptance(target, draft, row[:t], temperature) for t in range(prompt_length, len(row))
        ]
    generator = torch.Generator().manual_seed(0)

    result = estimate_acceptance(target, draft, input_ids, attention_mask, mask, temperature, 1, generator)
    assert result.states == len(expected) == 7
    assert result.exact == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert 0 <= result.estimate <= 1
    # Many draws per state: the estimate's mean over y ~ q is the exact acceptance
    many = estimate_acceptance(target, draft, input_ids, attention_mask, mask, temperature, 20000, generator)
    assert many.estimate == pytest.approx(result.exact, abs=0.01)


def test_a_draft_identical_to_the_target_is_always_accepted(tokenizer):
    target = build_model(tokenizer, seed=1)
    input_ids, attention_mask = padded([[1, 277, 201, 19, 13, 20]], tokenizer.pad_token_id)
    mask = torch.tensor([[False, False, True, True, True, True]])
    result = estimate_acceptance(target, copy.deepcopy(target), input_ids, attention_mask, mask)
    assert result.estimate == 1.0 and result.exact == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="mask"):
        estimate_acceptance(target, target, input_ids, attention_mask, torch.ones_like(mask))


def test_measure_assisted_acceptance_counts_the_verifier(tokenizer):
    target = build_model(tokenizer, seed=1, hidden_size=48)
    draft = truncated_draft(target, 1)
    assert draft.config.num_hidden_layers == 1 and len(draft.config.layer_types) == 1
    original, draft_config = generation_utils._speculative_sampling, draft.generation_config
    prompts = ["1+2=", "3+4=", "5+6="]

    result = measure_assisted_acceptance(target, draft, tokenizer, prompts, gamma=3, max_new_tokens=12)
    assert generation_utils._speculative_sampling is original and draft.generation_config is draft_config
    assert result.tested == sum(int(mask.sum()) for mask in result.tested_mask)
    assert 0 <= result.accepted <= result.tested
    assert result.interval[0] <= result.acceptance <= result.interval[1]
    prompt_lengths = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ].__len__()
        for p in prompts
    ]
    assert result.generated_tokens == sum(
        s.shape[1] - n for s, n in zip(result.sequences, prompt_lengths, strict=True)
    )
    # Each forward adds its accepted drafts and one token of the target's; an accepted EOS draft drops that token
    assert result.accepted + result.target_forwards - len(prompts) <= result.generated_tokens
    assert result.generated_tokens <= result.accepted + result.target_forwards


def test_a_copy_of_the_target_as_draft_is_accepted_gamma_plus_one_tokens_a_forward(tokenizer):
    target = build_model(tokenizer, seed=1)
    result = measure_assisted_acceptance(
        target, copy.deepcopy(target), tokenizer, ["1+2="], gamma=3, max_new_tokens=16
    )
    assert result.accepted == result.tested > 0
    assert result.tokens_per_forward <= expected_tokens_per_verification(1.0, 3)
    # The token after 3 accepted drafts is the target's own sample: no draft tests it
    with pytest.raises(ValueError, match="model of its own"):
        measure_assisted_acceptance(target, target, tokenizer, ["1+2="], gamma=3)
    assert "1111" not in "".join("1" if tested else "0" for tested in result.tested_mask[0][0].tolist())


def test_the_own_state_rate_is_taken_at_the_drafts_own_samples(tokenizer):
    target = build_model(tokenizer, seed=1)
    same = own_state_acceptance(target, copy.deepcopy(target), tokenizer, ["1+2=", "3+4="], 1.0, max_new_tokens=6)
    assert same.estimate == pytest.approx(1.0) and same.exact == pytest.approx(1.0) and 2 <= same.states <= 12
    other = build_model(tokenizer, seed=2)
    apart = own_state_acceptance(target, other, tokenizer, ["1+2=", "3+4="], 1.0, max_new_tokens=6, seed=5)
    # The states are the draft's own samples: each prompt's tokens up to its end of turn
    torch.manual_seed(5)
    expected = 0
    for prompt in ["1+2=", "3+4="]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = other.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        expected += out.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in out else len(out)
    assert apart.states == expected and 0 < apart.exact < 1


def test_a_prompt_already_chat_templated_is_refused(tokenizer):
    target, draft = build_model(tokenizer, seed=1), build_model(tokenizer, seed=2)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False)
    with pytest.raises(ValueError, match="Prompt 1 holds the chat template's '<\\|im_.*plain text"):
        measure_assisted_acceptance(target, draft, tokenizer, ["1+2=", templated], gamma=3)


PROMPTS = [
    "What is the capital of France?",
    "How can I sleep better?",
    "Name a red fruit.",
    "Why is the sky blue?",
    "What is a volcano?",
    "Give me a tip for studying.",
    "How do plants grow?",
    "What is rain?",
]


def trained_draft(target_dir, draft, output_dir):
    """`draft` after 4 TV-OPD steps of 8 general questions on its own rollouts, `target_dir` its teacher (at a
    learning rate that moves it: 3e-4)."""
    from datasets import Dataset

    from tvopd_trl import TVOPDConfig, TVOPDTrainer
    from tvopd_trl.terse_task import conversation, questions

    draft.save_pretrained(output_dir / "draft")
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(output_dir / "draft")
    config = TVOPDConfig(
        output_dir=str(output_dir / "run"), temperature=1.0, max_completion_length=32, per_device_train_batch_size=8,
        learning_rate=3e-4, lr_scheduler_type="constant", max_steps=4, weight_decay=0.0, seed=0, report_to="none",
        save_strategy="no", bf16=False, disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [conversation(q, False) for q in questions("train")]})
    trainer = TVOPDTrainer(
        model=str(output_dir / "draft"), teacher_model=target_dir, args=config, train_dataset=prompts
    )
    trainer.train()
    return trainer.model.eval()


# About 50 s on one core each (8 prompts of 32 tokens, one target forward per tested draft token), and 40 s of training
@pytest.mark.long
@pytest.mark.parametrize("trained", [False, True], ids=["untrained", "trained"])
def test_the_estimate_agrees_with_assisted_generation_on_the_real_model(smollm2_dir, trained, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    draft = truncated_draft(target, 4)
    if trained:
        draft = trained_draft(smollm2_dir, draft, tmp_path)

    measured = measure_assisted_acceptance(target, draft, tokenizer, PROMPTS, gamma=1, max_new_tokens=32)
    # gamma = 1 tests one draft per verification; after an accepted one the target samples the next token alone,
    # so the tested states are the verified positions, not every generated one
    assert measured.tested < measured.generated_tokens
    input_ids, attention_mask = padded([row[0].tolist() for row in measured.sequences], tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for index, tested in enumerate(measured.tested_mask):
        mask[index, : tested.shape[1]] = tested[0]
    generator = torch.Generator().manual_seed(0)
    one_draw = estimate_acceptance(target, draft, input_ids, attention_mask, mask, generator=generator)
    many_draws = estimate_acceptance(
        target, draft, input_ids, attention_mask, mask, samples_per_state=16, generator=generator
    )
    print(
        f"measured {measured.acceptance:.4f} {measured.interval} ({measured.accepted}/{measured.tested}), "
        f"estimate (1 draw) {one_draw.estimate:.4f}, estimate (16 draws) {many_draws.estimate:.4f}, "
        f"exact {one_draw.exact:.4f}, states {one_draw.states}, tokens per forward {measured.tokens_per_forward:.3f} "
        f"(eq. 1: {expected_tokens_per_verification(measured.acceptance, 1):.3f}), {measured.wall_seconds:.1f} s"
    )
    assert one_draw.states == measured.tested
    low, high = measured.interval
    assert low <= many_draws.estimate <= high
    assert low <= one_draw.exact <= high
    # One draw per state, as in training, adds the estimate's own sampling noise to the measurement's: 99%
    low, high = wilson_interval(measured.accepted, measured.tested, confidence=0.99)
    assert low <= one_draw.estimate <= high
