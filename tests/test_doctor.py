"""`tvopd-trl doctor`: exact statistics, and the deliberate bugs it must catch on the embedded pair."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from tvopd_trl import tiny
from tvopd_trl.cli import main as cli
from tvopd_trl.doctor import FAIL, PASS, SKIP, WARN, check_padded_vocabulary, diagnose, sampling_moments, z_score
from tvopd_trl.scripts.doctor import make_parser


RECIPE = "recipes/tiny/tvopd.yaml"


def _diagnose(*flags, prompts=32, recipe=RECIPE):
    _, job_args, training_args, model_args = make_parser().parse_args_and_config(
        args=["--config", recipe, *flags], fail_with_unknown_args=False
    )[:4]
    return {check.name: check for check in diagnose(job_args, training_args, model_args, num_prompts=prompts)}


def test_sampling_moments_on_an_enumerated_distribution():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    log_probs = probs.log()
    sampled, entropy, variance = sampling_moments(log_probs, torch.tensor([1]))
    expected_entropy = 0.5 * math.log(2) + 0.5 * math.log(4)
    expected_second = 0.5 * math.log(2) ** 2 + 0.5 * math.log(4) ** 2
    assert sampled.item() == pytest.approx(math.log(0.25))
    assert entropy.item() == pytest.approx(expected_entropy)  # the zero-probability token adds nothing, not NaN
    assert variance.item() == pytest.approx(expected_second - expected_entropy**2)
    # E[log p(y) + H] = 0 under the distribution: the exact expectation over the three reachable tokens.
    deviations = [sampling_moments(log_probs, torch.tensor([t]))[0] + entropy for t in range(3)]
    assert sum(p * d.item() for p, d in zip(probs[0, :3].tolist(), deviations, strict=True)) == pytest.approx(
        0.0, abs=1e-7
    )
    assert z_score(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 5.0])) == pytest.approx(1.0)
    assert math.isnan(z_score(torch.tensor([0.0]), torch.tensor([0.0])))


def test_padded_vocabulary_mass_is_measured_exactly():
    # A stand-in teacher with 6 output rows for a 4-token tokenizer: padded ids 4 and 5 get known mass.
    logits = torch.log(torch.tensor([0.4, 0.3, 0.1, 0.1, 0.06, 0.04]))

    class Teacher(torch.nn.Module):
        config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=6))

        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(logits=logits.expand(*input_ids.shape, 6))

    batch = {
        "input_ids": torch.zeros(1, 5, dtype=torch.long),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "keep": 2,
        "active": torch.tensor([[True, True]]),
    }
    check = check_padded_vocabulary(Teacher(), batch, tokenizer_size=4, temperature=1.0)
    assert check.status == FAIL and "1.00e-01" in check.detail
    assert check_padded_vocabulary(Teacher(), batch, tokenizer_size=4, temperature=1.0, tolerance=0.2).status == PASS


def test_the_embedded_pair_is_healthy():
    checks = _diagnose()
    for name in ("tokenizers", "chat template", "vocabulary size", "self-delta", "sampling temperature", "dtype"):
        assert checks[name].status == PASS, checks[name]
    assert "max |delta| 0.00e+00" in checks["self-delta"].detail  # one scoring path, bit for bit
    pair = checks["teacher vs student"]
    assert pair.status == PASS and "exact TV" in pair.detail
    assert not any(check.status == FAIL for check in checks.values())


def test_a_shifted_sampling_temperature_is_caught():
    # `generation_kwargs` overrides the sampler's temperature while the trainer scores at `temperature` 1.0.
    checks = _diagnose("--generation_kwargs", '{"temperature": 2.0}')
    check = checks["sampling temperature"]
    assert check.status == FAIL and "less likely" in check.detail and "generation_kwargs" in check.fix
    assert checks["self-delta"].status == PASS  # the scoring itself is consistent
    assert any(c.status == WARN for c in checks.values())  # and the trainer's own construction warning is shown


def test_a_mismatched_chat_template_is_caught(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny.teacher_path(), teacher)
    template = (teacher / "chat_template.jinja").read_text()
    (teacher / "chat_template.jinja").write_text(
        template.replace("<|im_start|>{{ message['role'] }}\n", "{{ message['role'] }}: ")
    )
    checks = _diagnose(
        "--model_name_or_path", tiny.student_path(), "--teacher_model_name_or_path", str(teacher), prompts=4
    )
    check = checks["chat template"]
    assert check.status == FAIL and "4 of 4 prompts" in check.detail and "chat_template" in check.fix


def test_a_low_precision_teacher_path_fails_the_self_check():
    checks = _diagnose("--teacher_model_init_kwargs", '{"dtype": "bfloat16"}', prompts=8)
    check = checks["self-delta"]
    assert check.status == FAIL and "bfloat16" in check.detail and "teacher_model_init_kwargs" in check.fix
    assert checks["dtype"].status == WARN


def test_a_vocabulary_mismatch_stops_before_loading_models(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny.teacher_path(), teacher)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    checks = _diagnose(
        "--model_name_or_path", tiny.student_path(), "--teacher_model_name_or_path", str(teacher), prompts=2
    )
    assert checks["tokenizers"].status == FAIL and "different ids" in checks["tokenizers"].detail
    assert checks["model checks"].status == SKIP


def test_the_command_exits_1_on_a_failure_and_writes_json(tmp_path, capsys):
    output = tmp_path / "doctor.json"
    argv = ["doctor", "--config", RECIPE, "--doctor_prompts", "16", "--doctor_output_json", str(output)]
    assert cli([*argv, "--generation_kwargs", '{"temperature": 2.0}']) == 1
    verdicts = {c["name"]: c["status"] for c in json.loads(output.read_text())}
    assert verdicts["sampling temperature"] == FAIL
    assert "tvopd-trl doctor" in capsys.readouterr().out


def test_rollouts_score_the_teacher_once(make_trainer, tmp_path, monkeypatch):
    from tvopd_trl import TVOPDTrainer
    from tvopd_trl.doctor import rollouts
    from tvopd_trl.testing import tiny_config

    trainer = make_trainer(tiny_config(tmp_path))
    scored = []
    original = TVOPDTrainer._sampled_token_logps

    def counting(self, model, *args, **kwargs):
        scored.append("teacher" if model is self.teacher_model else "student")
        return original(self, model, *args, **kwargs)

    monkeypatch.setattr(TVOPDTrainer, "_sampled_token_logps", counting)
    batch = rollouts(trainer, [trainer.train_dataset[i] for i in range(4)])
    assert sorted(scored) == ["student", "teacher"]  # pi_old and the teacher, once each
    assert batch["teacher_logps"].shape == batch["old_logps"].shape == batch["completion_ids"].shape


def test_padded_siblings_pass_the_vocabulary_check_and_short_heads_fail():
    from tvopd_trl.doctor import check_vocab_sizes

    def config(rows):
        return SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=rows))

    sibling = check_vocab_sizes(config(151936), config(152064), tokenizer_size=151665)
    assert sibling.status == PASS and "padded siblings" in sibling.detail
    assert check_vocab_sizes(config(151936), config(151000), tokenizer_size=151665).status == FAIL


def test_each_teacher_is_checked_on_its_own_prompts():
    checks = _diagnose("--embedded_task", "multi_teacher", prompts=8)
    for teacher in ("addition", "subtraction"):
        for name in ("tokenizers", "self-delta", "teacher vs student"):
            assert checks[f"{name} ({teacher})"].status == PASS, checks[f"{name} ({teacher})"]
    assert not any(check.status == FAIL for check in checks.values())


def test_the_long_completion_pair_passes_the_doctor():
    checks = _diagnose(prompts=8, recipe="recipes/tiny/long_tvopd.yaml")
    assert not any(check.status == FAIL for check in checks.values()), checks
    assert checks["teacher vs student"].status == PASS


@pytest.mark.parametrize("mode", ["live", "frozen"])
def test_a_student_that_teaches_itself_passes_the_doctor_and_the_hint_moves_its_teacher(mode):
    """`self_distillation`: the self-check scores the bare prompts (delta exactly 0), the pair check the hinted ones,
    where the hint moves the student's own scores (the hint family: 0.25 accuracy without it, 0.98 with)."""
    checks = _diagnose("--self_distillation", mode, prompts=8, recipe="recipes/tiny/self_distill.yaml")
    assert checks["tokenizers"].status == SKIP and f"self_distillation: {mode}" in checks["tokenizers"].detail
    assert "vocabulary size" not in checks
    assert checks["self-delta"].status == PASS and "max |delta| 0.00e+00" in checks["self-delta"].detail
    for name in ("dtype", "padded vocabulary", "teacher vs student"):
        assert checks[name].status == PASS, checks[name]
    mean_delta = float(checks["teacher vs student"].detail.split("mean delta ")[1].split()[0])
    assert mean_delta < -0.05 and "exact TV" in checks["teacher vs student"].detail
