"""The embedded default pair (`tvopd_trl.tiny`): shipped checkpoints, splits, grading and a quick accuracy smoke."""

import copy
import re
import warnings

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.tiny import (
    SPLITS,
    evaluate_accuracy,
    problems,
    prompt_dataset,
    student_path,
    teacher_path,
)
from tvopd_trl.tokenizers import check_shared_vocabulary


@pytest.fixture(scope="module")
def pair():
    loaded = {}
    for name, path in (("teacher", teacher_path()), ("student", student_path())):
        loaded[name] = (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    return loaded


def test_checkpoints_load_like_hub_checkpoints(pair):
    for model, tokenizer in pair.values():
        assert model.config.model_type == "qwen2"
        assert tokenizer.eos_token == "<|im_end|>"
        assert tokenizer.pad_token is not None and tokenizer.pad_token != tokenizer.eos_token
        assert tokenizer.padding_side == "left"
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.pad_token_id == tokenizer.pad_token_id
        assert model.config.vocab_size == len(tokenizer)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Compute 47 + 86."}], tokenize=False, add_generation_prompt=True
        )
        assert text == "<|im_start|>user\nCompute 47 + 86.<|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer(text + "\\boxed{133}<|im_end|>", add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text + "\\boxed{133}<|im_end|>"
        assert tokenizer.convert_ids_to_tokens(ids[-5:-1]) == ["1", "3", "3", "}"]  # one token per digit
    (teacher, teacher_tokenizer), (student, student_tokenizer) = pair["teacher"], pair["student"]
    check_shared_vocabulary(student_tokenizer, teacher_tokenizer)
    teacher_config, student_config = teacher.config.to_dict(), student.config.to_dict()
    teacher_config.pop("_name_or_path"), student_config.pop("_name_or_path")
    assert teacher_config == student_config  # one architecture: the student is an earlier checkpoint of the same run


def test_splits_are_disjoint_and_deterministic():
    pairs = {split: {(p["a"], p["b"]) for p in problems(split)} for split in SPLITS}
    assert len(pairs["test"]) == 500
    for i, first in enumerate(SPLITS):
        for second in SPLITS[i + 1 :]:
            assert not pairs[first] & pairs[second], (first, second)
    assert sum(len(p) for p in pairs.values()) == 90 * 90
    assert problems("test") == problems("test")
    dataset = prompt_dataset("opd", n=3)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset[0]["prompt"] == [{"role": "user", "content": problems("opd")[0]["question"]}]
    assert dataset[0]["answer"] == problems("opd")[0]["answer"]
    with pytest.raises(ValueError):
        problems("validation")


def test_shipped_pair_meets_the_accuracy_bounds_on_the_whole_held_out_split(pair):
    # mean@4 at the paper's evaluation settings (temperature 0.6, top-p 0.95, top-k 20), all 500 problems.
    teacher = evaluate_accuracy(*pair["teacher"], "test", k=4)
    student = evaluate_accuracy(*pair["student"], "test", k=4)
    assert teacher >= 0.9 and student <= 0.4, (teacher, student)


def test_a_student_that_ends_with_another_eos_than_its_teacher_is_warned_about(pair):
    """A base student beside its instruct teacher (Qwen3-8B-Base: `<|endoftext|>`, Qwen3-8B: `<|im_end|>`) shares
    their ids, but its rollouts would stop at its own EOS only."""
    teacher_tokenizer = pair["teacher"][1]
    student_tokenizer = copy.deepcopy(pair["student"][1])
    other = next(token for token in student_tokenizer.all_special_tokens if token != student_tokenizer.eos_token)
    student_tokenizer.eos_token = other
    with pytest.warns(UserWarning, match=rf"ends its responses with '{re.escape(other)}'.* `eos_token`"):
        assert check_shared_vocabulary(student_tokenizer, teacher_tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_shared_vocabulary(pair["student"][1], teacher_tokenizer)
