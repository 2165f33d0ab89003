"""The embedded tool-using pair (`tvopd_trl.tiny.tools_paths`): four-digit addition with an `add` tool, a chat template
that renders tool calls and results, a response template that TRL's tool loop reads them back with, a teacher that
calls the tool right and a student, an earlier checkpoint of its run, that makes mistakes of more than one kind."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

from tvopd_trl.tiny import TOOLS_DIR, tool_prompt_dataset, tool_task, tools_paths


QUESTION = [{"role": "user", "content": "Compute 4721 + 8635."}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 4721, "b": 8635}}</tool_call>'


@pytest.fixture(scope="module")
def pair():
    return {
        member: (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        for member, path in tools_paths().items()
    }


@pytest.fixture(scope="module")
def tokenizer(pair):
    return pair["teacher"][1]


@pytest.fixture(scope="module")
def build():
    with open(os.path.join(TOOLS_DIR, "build.json")) as f:
        return json.load(f)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages=QUESTION):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def architecture(model):
    config = model.config.to_dict()
    config.pop("_name_or_path")
    return config


def test_the_pair_is_one_vllm_ready_qwen2_architecture_with_room_for_the_longest_transcript(pair, build):
    (teacher, teacher_tokenizer), (student, student_tokenizer) = pair["teacher"], pair["student"]
    for model in (teacher, student):
        assert isinstance(model, Qwen2ForCausalLM)
        # vLLM's CPU attention serves heads of 32 and more
        assert (model.config.num_attention_heads, model.config.hidden_size) == (2, 64)
        assert model.config.vocab_size == len(teacher_tokenizer)
        assert model.generation_config.eos_token_id == teacher_tokenizer.eos_token_id
    assert architecture(teacher) == architecture(student)
    assert teacher_tokenizer.get_vocab() == student_tokenizer.get_vocab()
    texts = tool_task.transcript_texts(teacher_tokenizer, tool_task.problems("test"))
    longest = max(len(ids(teacher_tokenizer, text)) for text in texts)
    assert longest <= build["longest_transcript_tokens"] < teacher.config.max_position_embeddings == 128


def test_the_chat_template_renders_calls_and_results_as_chatml_without_a_tools_block(tokenizer):
    row = tool_task.problems("test")[0]
    messages = tool_task.transcript(row["a"], row["b"])
    rendered = tokenizer.apply_chat_template(messages, tools=tool_task.TOOLS, tokenize=False)
    assert rendered == (
        f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n{row['call']}<|im_end|>\n"
        f"<|im_start|>tool\n{row['answer']}<|im_end|>\n<|im_start|>assistant\n\\boxed{{{row['answer']}}}<|im_end|>\n"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    # The family's own BPE: every piece of the call's JSON is one token, digits one each.
    assert len(ids(tokenizer, CALL)) == 32
    assert len(ids(tokenizer, tool_task.transcript_texts(tokenizer, [row])[0])) <= 77


def test_the_response_template_is_saved_with_the_tokenizer_and_reads_a_call_back(tokenizer):
    for path in tools_paths().values():
        assert AutoTokenizer.from_pretrained(path).response_template == tool_task.RESPONSE_TEMPLATE
    prompt = prompt_ids(tokenizer)
    # What TRL's tool loop calls (`tokenizer.parse_response(ids, prefix=..., tools=...)`, a missing content made "")
    call = parse_response(tokenizer, ids(tokenizer, CALL + "<|im_end|>"), prefix=prompt, tools=tool_task.TOOLS)
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 4721, "b": 8635}}}],
    }
    answer = parse_response(
        tokenizer, ids(tokenizer, "\\boxed{13356}<|im_end|>"), prefix=prompt, tools=tool_task.TOOLS
    )
    assert answer == {"role": "assistant", "content": "\\boxed{13356}"}
    # A leading zero is not JSON: the turn stays text, as TRL's tool loop reads it.
    bad = parse_response(tokenizer, ids(tokenizer, CALL.replace("4721", "0472") + "<|im_end|>"), prefix=prompt)
    assert "tool_calls" not in bad and bad["content"].startswith("<tool_call>")


def test_the_tool_loop_rebuilds_the_reference_transcript_as_trls_does(pair, tokenizer):
    # Prompt + calling turn + TRL's tool suffix + answering turn: the chat template's rendering, token for token
    rows = tool_task.problems("test")[:8]
    prompts = [[{"role": "user", "content": row["question"]}] for row in rows]
    records = tool_task.run_tool_loop(pair["teacher"][0], tokenizer, prompts, dict(do_sample=False))
    for row, record, text in zip(rows, records, tool_task.transcript_texts(tokenizer, rows), strict=True):
        _, call, _, answer = tool_task.transcript(row["a"], row["b"])
        assert record["ids"] == ids(tokenizer, text)
        assert record["turns"] == [call, answer]
        assert record["texts"] == [row["call"] + "<|im_end|>", row["response"] + "<|im_end|>"]
        assert record["results"] == [[int(row["answer"])]] and (record["calls"], record["failures"]) == (1, 0)


def test_mistakes_are_named_by_what_went_wrong_first():
    def record(first, results=(), last=None):
        texts = [first] if last is None else [first, last]
        return {"texts": texts, "results": list(results)}

    assert tool_task.mistake(record("\\boxed{13356}"), "13356") == "no_call"
    assert tool_task.mistake(record('<tool_call>{"name": "add", "arguments": {"a": 0472'), "13356") == "unparsed_call"
    assert tool_task.mistake(record("<tool_call>", [[{"error": "Tool ad not found."}]], "x"), "13356") == "failed_call"
    assert tool_task.mistake(record("<tool_call>", [[13357]], "\\boxed{13357}"), "13356") == "wrong_arguments"
    assert tool_task.mistake(record("<tool_call>", [[13356]], "\\boxed{1335}"), "13356") == "wrong_final_answer"


def test_the_build_reports_a_teacher_that_uses_the_tool_and_a_student_that_errs_in_several_ways(build):
    teacher, student = build["teacher_heldout"], build["student_heldout"]
    assert teacher["k4"] >= 0.95 and teacher["greedy"] >= 0.95
    assert teacher["tools"]["k4"]["call_frequency"] == 1.0 and teacher["tools"]["k4"]["failure_frequency"] == 0.0
    assert student["k4"] <= 0.6 and student["greedy"] <= 0.6
    mistakes = student["tools"]["k4"]["mistakes"]
    assert set(mistakes) == set(tool_task.MISTAKE_KINDS)
    assert sum(mistakes.values()) == round((1 - student["k4"]) * 4 * 500)
    assert sum(count > 0 for count in mistakes.values()) >= 2
    assert build["student_step"] < build["settings"]["total_steps"]
    assert build["wall_time_s"] > 0


def test_a_held_out_sample_with_the_tool(pair):
    teacher = tool_task.evaluate_with_tool(*pair["teacher"], "test", k=4, n=100)
    assert teacher["accuracy"] >= 0.95 and teacher["call_frequency"] == 1.0
    student = tool_task.evaluate_with_tool(*pair["student"], "test", k=4, n=100)
    assert student["accuracy"] <= 0.6
    assert sum(count > 0 for count in student["mistakes"].values()) >= 2


def test_the_prompt_dataset_has_disjoint_splits_of_chat_prompts_and_solutions():
    dataset = tool_prompt_dataset("opd", 4)
    assert dataset.column_names == ["prompt", "solution"] and len(dataset) == 4
    row = dataset[0]
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Compute ")
    a, b = map(int, row["prompt"][0]["content"].removeprefix("Compute ").removesuffix(".").split(" + "))
    assert 1000 <= a <= 9999 and 1000 <= b <= 9999 and row["solution"] == str(a + b)
    splits = {split: {(p["a"], p["b"]) for p in tool_task.problems(split)} for split in ("test", "dev", "opd", "sft")}
    assert [len(pairs) for pairs in splits.values()] == [500, 500, 2000, 20_000]
    assert len(set.union(*splits.values())) == sum(map(len, splits.values()))


def test_the_tiny_tools_benchmark_scores_as_the_build_does(pair, tmp_path):
    """`tvopd-trl eval --benchmarks tiny-tools`, the main job and the callback answer through `ToolLoopGenerator`:
    the same conversations, grades and tool frequencies as the build's `evaluate_with_tool`."""
    from tvopd_trl.eval import SamplingSettings, evaluate, get_benchmark, local_generator

    model, tokenizer = pair["student"]
    generator = local_generator([get_benchmark("tiny-tools")], model, tokenizer, batch_size=512)
    assert isinstance(generator, tool_task.ToolLoopGenerator)
    settings = SamplingSettings(k=2, max_new_tokens=tool_task.MAX_NEW_TOKENS)
    results = evaluate(generator, ["tiny-tools"], settings, tmp_path, limit=40)
    expected = tool_task.evaluate_with_tool(model, tokenizer, k=2, n=40)
    scores = results["benchmarks"]["tiny-tools"]
    assert 0 < scores["mean@2"] == expected["accuracy"] < 1
    assert scores["tools"] == {key: expected[key] for key in ("call_frequency", "failure_frequency")}
    assert json.loads((tmp_path / "results.json").read_text())["benchmarks"]["tiny-tools"]["tools"] == scores["tools"]


def test_the_tool_loop_generator_refuses_a_shard_and_a_mix_with_plain_benchmarks(pair):
    from tvopd_trl.eval import SamplingSettings, TransformersGenerator, get_benchmark, local_generator

    model, tokenizer = pair["student"]
    with pytest.raises(ValueError, match="evaluated in one process"):
        tool_task.ToolLoopGenerator(model, tokenizer)([QUESTION], SamplingSettings(k=1), shard=(0, 2))
    with pytest.raises(ValueError, match="answered in different ways"):
        local_generator([get_benchmark("tiny"), get_benchmark("tiny-tools")], model, tokenizer)
    assert isinstance(local_generator([get_benchmark("tiny")], model, tokenizer), TransformersGenerator)
