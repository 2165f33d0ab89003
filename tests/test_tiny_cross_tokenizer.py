"""The embedded cross-tokenizer teachers (`tvopd_trl.tiny.cross_tokenizer_paths`): Llama models with Llama-3-like
tokenizers of their own, teachers of the default pair's task for its student."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tvopd_trl.tiny import CROSS_TOKENIZER_DIR, cross_tokenizer_paths, evaluate_accuracy, problems, student_path


QUESTION = [{"role": "user", "content": "Compute 47 + 86."}]


@pytest.fixture(scope="module")
def teachers():
    return {
        name: (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        for name, path in cross_tokenizer_paths().items()
    }


@pytest.fixture(scope="module")
def student_tokenizer():
    return AutoTokenizer.from_pretrained(student_path())


def pieces(tokenizer, text):
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_teachers_are_llama_models_with_fast_tokenizers_of_their_own(teachers, student_tokenizer):
    assert set(teachers) == {"digits", "triplets"}
    vocabularies = [student_tokenizer.get_vocab()]
    for model, tokenizer in teachers.values():
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.num_attention_heads == 2 and model.config.head_dim == 32  # vLLM's CPU attention serves 32
        assert tokenizer.is_fast and model.config.vocab_size == len(tokenizer)
        assert tokenizer.backend_tokenizer.normalizer is None  # Llama 3's: the student's NFC is not the teachers'
        assert tokenizer.get_vocab() not in vocabularies
        vocabularies.append(tokenizer.get_vocab())
    assert [len(vocabulary) for vocabulary in vocabularies] == [300, 400, 600]


def test_numbers_are_cut_into_digits_or_groups_of_three_and_words_otherwise_than_by_the_student(
    teachers, student_tokenizer
):
    digits, triplets = teachers["digits"][1], teachers["triplets"][1]
    assert pieces(digits, "1234") == pieces(student_tokenizer, "1234") == ["1", "2", "3", "4"]
    assert pieces(triplets, "1234") == ["123", "4"]
    assert all(len(pieces(triplets, str(number))) == 1 for number in range(200))  # every operand and answer
    assert pieces(triplets, "\\boxed{133}") == ["\\boxed", "{", "133", "}"]
    assert pieces(student_tokenizer, "\\boxed{133}") == ["\\boxed", "{", "1", "3", "3", "}"]
    # Words, spaces and punctuation are cut otherwise than by the student, by both teachers
    for teacher in (digits, triplets):
        assert pieces(teacher, " The answer") == ["ĠThe", "Ġanswer"]
        assert pieces(teacher, " \\boxed{1")[:2] == ["Ġ\\", "boxed"]
    assert pieces(student_tokenizer, " The answer") == ["Ġ", "The", "Ġ", "an", "sw", "er"]
    assert pieces(student_tokenizer, " \\boxed{1")[:5] == ["Ġ", "\\", "b", "ox", "ed"]


def test_the_pieces_spell_the_text_byte_for_byte(teachers):
    # What cross-tokenizer alignment relies on: the bytes of the teacher's pieces (through GPT-2's byte <-> unicode
    # table) are the text's, special-token names included (`split_special_tokens`: text, not markers).
    byte_of = {character: byte for byte, character in bytes_to_unicode().items()}
    texts = [row["response"] for row in problems("test")[:100]]
    texts += ["The answer is \\boxed{133}.", " \\boxed{1335}", "café naïve 👍", "x<|eot_id|>y", "a\n\n\tb  "]
    for _, tokenizer in teachers.values():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            spelled = b"".join(bytes(byte_of[c] for c in piece) for piece in tokenizer.convert_ids_to_tokens(ids))
            assert spelled == text.encode(), text


def test_the_chat_template_renders_one_bos_and_ends_turns_with_eot(teachers):
    for model, tokenizer in teachers.values():
        prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        assert prompt == (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nCompute 47 + 86.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"] == ids
        assert tokenizer("x")["input_ids"] == [
            tokenizer.bos_token_id,
            *tokenizer("x", add_special_tokens=False)["input_ids"],
        ]
        turn = tokenizer.apply_chat_template(
            [*QUESTION, {"role": "assistant", "content": "\\boxed{133}"}], tokenize=False
        )
        assert turn == prompt + "\\boxed{133}<|eot_id|>"
        eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
        assert tokenizer.eos_token_id == model.generation_config.eos_token_id == model.config.eos_token_id == eot
        assert (
            tokenizer.pad_token == "<|end_of_text|>" and model.generation_config.pad_token_id == tokenizer.pad_token_id
        )
        assert tokenizer.padding_side == "left"


def test_the_build_reports_the_teachers_solve_the_held_out_split(teachers):
    with open(os.path.join(CROSS_TOKENIZER_DIR, "build.json")) as f:
        build = json.load(f)
    assert set(build["teachers"]) == set(teachers)
    for name, (_, tokenizer) in teachers.items():
        report = build["teachers"][name]
        assert report["heldout"]["k4"] >= 0.95 and report["vocab_size"] == len(tokenizer), name


def test_each_teacher_answers_the_held_out_split_greedily_with_its_own_template(teachers):
    for name, (model, tokenizer) in teachers.items():
        assert evaluate_accuracy(model, tokenizer, greedy=True) >= 0.95, name
