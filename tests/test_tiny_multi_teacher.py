"""The embedded multi-teacher family (`tvopd_trl.tiny`): the subtraction skill, the mixed prompts, the shipped
student and per-skill teachers, and the builder's determinism."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.tiny import (
    MULTI_TEACHER_DIR,
    SKILLS,
    SPLITS,
    evaluate_accuracy,
    multi_skill_prompt_dataset,
    multi_teacher_paths,
    problems,
    prompt_dataset,
    student_path,
    tiny_benchmark,
)
from tvopd_trl.tiny.build import DEFAULTS, build_model, sample_batch, sft_data, train_steps
from tvopd_trl.tokenizers import check_shared_vocabulary


@pytest.fixture(scope="module")
def family():
    paths = multi_teacher_paths()
    members = {"student": paths["student"], **paths["teachers"]}
    return {
        name: (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        for name, path in members.items()
    }


def test_addition_stays_the_default_skill():
    for split in SPLITS:
        assert problems(split) == problems(split, "addition")
    assert prompt_dataset("opd", n=3).to_dict() == prompt_dataset("opd", n=3, skill="addition").to_dict()
    assert [tiny_benchmark().name, tiny_benchmark("dev").name] == ["tiny", "tiny-dev"]
    assert tiny_benchmark("test", "subtraction").name == "tiny-subtraction"
    with pytest.raises(ValueError):
        problems("test", "multiplication")


def test_subtraction_splits_are_disjoint_sized_and_answered():
    splits = {split: problems(split, "subtraction") for split in SPLITS}
    assert {split: len(rows) for split, rows in splits.items()} == {"test": 500, "dev": 500, "opd": 1000, "sft": 2005}
    pairs = [(row["a"], row["b"]) for rows in splits.values() for row in rows]
    assert len(set(pairs)) == len(pairs) == 90 * 89 // 2  # every a > b of 10..99 exactly once
    for row in splits["test"]:
        assert 10 <= row["b"] < row["a"] <= 99
        assert row["question"] == f"Compute {row['a']} - {row['b']}."
        assert row["answer"] == str(row["a"] - row["b"])
        assert row["response"] == f"\\boxed{{{row['a'] - row['b']}}}"
    assert problems("test", "subtraction") == splits["test"]


def test_the_mixed_prompts_name_each_rows_teacher():
    dataset = multi_skill_prompt_dataset("opd", n=50)
    assert dataset.column_names == ["prompt", "answer", "skill", "teacher_id"]
    assert dataset["teacher_id"] == dataset["skill"]
    assert sorted(set(dataset["teacher_id"])) == list(SKILLS)
    assert dataset["skill"].count("subtraction") == 50 and len(dataset) == 100
    assert set(dataset["skill"][:10]) == set(SKILLS)  # shuffled together, not one skill after the other
    for row in dataset:
        assert (" - " in row["prompt"][0]["content"]) == (row["skill"] == "subtraction")
    assert dataset.to_dict() == multi_skill_prompt_dataset("opd", n=50).to_dict()
    assert len(multi_skill_prompt_dataset("opd")) == 1600 + 1000


def test_shipped_family_shares_the_default_tokenizer_and_architecture(family):
    paths = multi_teacher_paths()
    assert sorted(paths["teachers"]) == sorted(SKILLS)
    with open(os.path.join(student_path(), "tokenizer.json")) as f:
        default_tokenizer = f.read()
    student, student_tokenizer = family["student"]
    student_config = student.config.to_dict()
    student_config.pop("_name_or_path")
    for name, (model, tokenizer) in family.items():
        with open(os.path.join(MULTI_TEACHER_DIR, name, "tokenizer.json")) as f:
            assert f.read() == default_tokenizer, name
        check_shared_vocabulary(student_tokenizer, tokenizer)
        config = model.config.to_dict()
        config.pop("_name_or_path")
        assert config == student_config, name
        ids = tokenizer("Compute 86 - 47.", add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.convert_ids_to_tokens(ids)[-5:] == ["Ġ-", "Ġ", "4", "7", "."]


def test_shipped_family_meets_the_accuracy_bounds(family):
    # Greedy on each skill's whole held-out split (build.json has mean@4 too): each teacher masters its own skill only.
    accuracy = {
        (name, skill): evaluate_accuracy(model, tokenizer, "test", greedy=True, skill=skill)
        for name, (model, tokenizer) in family.items()
        for skill in SKILLS
    }
    for skill in SKILLS:
        assert accuracy["student", skill] <= 0.4, accuracy
        assert accuracy[skill, skill] >= 0.9, accuracy
        for other in set(SKILLS) - {skill}:
            assert accuracy[skill, other] <= 0.2, accuracy
    with open(os.path.join(MULTI_TEACHER_DIR, "build.json")) as f:
        heldout = json.load(f)["heldout"]
    assert sorted(heldout) == sorted(["student", *SKILLS])
    for skill in SKILLS:
        assert heldout["student"][skill]["k4"] <= 0.4 and heldout[skill][skill]["k4"] >= 0.9, heldout


def test_mixed_batches_draw_each_skill_equally_and_one_skill_as_before():
    index = sample_batch([5500, 2005], 128, torch.Generator().manual_seed(0))
    assert (index[:64] < 5500).all() and (index[64:] >= 5500).all() and (index[64:] < 7505).all()
    # One skill: the very draws the default pair was built with, so it rebuilds bit-identically.
    single = sample_batch([5500], 128, torch.Generator().manual_seed(0))
    assert torch.equal(single, torch.randint(0, 5500, (128,), generator=torch.Generator().manual_seed(0)))


def test_builder_training_is_deterministic(tokenizer):
    settings = {**DEFAULTS, "batch_size": 8, "warmup_steps": 2, "constant_until": 3, "total_steps": 4}
    data = sft_data(tokenizer, SKILLS)
    states = []
    for _ in range(2):
        model = build_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0)
        losses = [loss for _, loss in train_steps(model, data, settings)]
        states.append((losses, model.state_dict()))
    (first_losses, first), (second_losses, second) = states
    assert first_losses == second_losses
    assert all(torch.equal(first[key], second[key]) for key in first)
