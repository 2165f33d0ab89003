"""The evaluation protocol (`tvopd_trl.eval`): benchmarks, grading, mean@k / pass@k, records, callback, CLI."""

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl.cli import main as cli_main
from tvopd_trl.eval import (
    BENCHMARKS,
    DEFAULT_PROMPT_TEMPLATE,
    PAPER_BENCHMARKS,
    BenchmarkEvalCallback,
    SamplingSettings,
    TransformersGenerator,
    VLLMGenerator,
    evaluate,
    get_benchmark,
    grade,
    grade_responses,
    load_problems,
    pass_at_k,
    register_benchmark,
    summarize,
)
from tvopd_trl.eval.benchmarks import HUB, PACKAGED_DIR
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import student_path

from .timeouts import time_limit


DATA_DIR = PACKAGED_DIR  # the copies that ship in the package, used as a `data_dir` like any folder
SIZES = {"aime24": 30, "aime25": 30, "aime26": 30, "amc23": 40, "hmmt_feb_2025": 30, "math500": 500}


def all_gold_answers():
    return [problem.answer for name in PAPER_BENCHMARKS for problem in load_problems(name, DATA_DIR)]


def perturb(answer):
    return str(int(answer) + 1) if re.fullmatch(r"-?\d+", answer) else f"{answer}+1"


# Benchmarks


def test_every_paper_benchmark_loads_from_local_files():
    for name, size in SIZES.items():
        problems = load_problems(name, DATA_DIR)
        assert len(problems) == size and len({p.id for p in problems}) == size, name
        assert all(p.problem and p.answer for p in problems)
    assert load_problems("aime24", DATA_DIR)[0].answer == "204"
    assert len(load_problems("math500", DATA_DIR, limit=7)) == 7
    assert len(load_problems("tiny")) == 500


def test_data_dir_from_the_environment(monkeypatch, tmp_path):
    (tmp_path / "amc23.jsonl").write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n')
    monkeypatch.setenv("TVOPD_BENCHMARK_DIR", str(tmp_path))
    assert load_problems("amc23") == [("a", "1+1?", "2")]


def test_without_data_dir_the_packaged_copies_load_offline(monkeypatch):
    def offline(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr("datasets.load_dataset", offline)
    monkeypatch.delenv("TVOPD_BENCHMARK_DIR", raising=False)
    for name, size in SIZES.items():
        assert load_problems(name) == load_problems(name, DATA_DIR) and len(load_problems(name)) == size, name
    readme = open(os.path.join(PACKAGED_DIR, "README.md"), encoding="utf-8").read()
    assert all(f"`{name}.jsonl`" in readme for name in PAPER_BENCHMARKS)  # provenance travels with the files


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown benchmark 'aime2024'.*aime24, aime25, aime26, amc23"):
        get_benchmark("aime2024")


def test_local_file_missing_a_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "b", "problem": "2+2?"}\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 2: missing field 'answer'"):
        load_problems(str(path))
    path.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "a", "problem": "2+2?", "answer": "4"}\n')
    with pytest.raises(ValueError, match="duplicate ids"):
        load_problems(str(path))


def test_missing_local_benchmark_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="No aime24.jsonl in .*or `hub` to load HuggingFaceH4/aime_2024"):
        load_problems("aime24", str(tmp_path))


def test_user_benchmark_from_a_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": 1, "problem": "What is 6*7?", "answer": 42}\n')
    try:
        benchmark = register_benchmark("mine", str(path), title="Mine")
        assert load_problems("mine")[0] == ("1", "What is 6*7?", "42")
        assert benchmark.prompt(load_problems("mine")[0])[0]["content"].startswith("What is 6*7?\nPlease reason")
        with pytest.raises(ValueError, match="already registered"):
            register_benchmark("mine", str(path))
    finally:
        BENCHMARKS.pop("mine", None)
    assert get_benchmark(str(path)).name == "mine"  # a path works without registering
    with pytest.raises(ValueError, match="must contain `{problem}`"):
        register_benchmark("other", str(path), prompt_template="no placeholder")


def test_prompts_use_the_boxed_instruction_and_the_chat_template():
    problem = load_problems("aime25", DATA_DIR)[0]
    messages = get_benchmark("aime25").prompt(problem)
    assert messages == [{"role": "user", "content": DEFAULT_PROMPT_TEMPLATE.replace("{problem}", problem.problem)}]
    assert "\\boxed{}" in messages[0]["content"]
    assert get_benchmark("aime25").prompt(problem, "Q: {problem} {A}")[0]["content"] == f"Q: {problem.problem} {{A}}"
    # The tiny pair was trained on the bare question.
    assert get_benchmark("tiny").prompt(load_problems("tiny")[0])[0]["content"] == "Compute 22 + 13."


def test_the_tiny_task_registers_its_benchmark_by_reference():
    # `tvopd_trl.eval` imports nothing of `tvopd_trl.tiny` (tests/test_layout.py): its registry names the function that
    # builds the benchmark, imported on the first lookup.
    from tvopd_trl import tiny

    assert "tiny" in BENCHMARKS and get_benchmark("tiny") is BENCHMARKS["tiny"]
    assert (get_benchmark("tiny").name, get_benchmark("tiny").title) == ("tiny", "Tiny")
    assert [p.id for p in load_problems("tiny")] == [f"{p['a']}+{p['b']}" for p in tiny.problems("test")]


def test_hub_loading_maps_the_published_columns(monkeypatch):
    from datasets import Dataset

    tables = {
        "MathArena/aime_2025": {"problem_idx": [1, 2], "problem": ["p1", "p2"], "answer": [70, 588]},
        "math-ai/amc23": {"id": [0], "question": ["q"], "answer": [27.0]},
        "HuggingFaceH4/MATH-500": {"unique_id": ["test/x.json"], "problem": ["p"], "answer": ["\\frac{1}{2}"]},
    }
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return Dataset.from_dict(tables[name])

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    monkeypatch.setenv("TVOPD_BENCHMARK_DIR", HUB)
    assert load_problems("aime25") == [("1", "p1", "70"), ("2", "p2", "588")]
    assert load_problems("amc23") == [("0", "q", "27")]  # float answers become the integers a model writes
    assert load_problems("math500", HUB) == [("test/x.json", "p", "\\frac{1}{2}")]
    assert calls == [("MathArena/aime_2025", "train"), ("math-ai/amc23", "test"), ("HuggingFaceH4/MATH-500", "test")]


def test_hub_failure_says_how_to_load_locally(monkeypatch):
    def offline(name, split):
        raise ConnectionError("no network")

    monkeypatch.setattr("datasets.load_dataset", offline)
    monkeypatch.delenv("TVOPD_BENCHMARK_DIR", raising=False)
    with pytest.raises(ConnectionError, match="HuggingFaceH4/aime_2024.*Leave `data_dir` unset.*aime24.jsonl"):
        load_problems("aime24", HUB)


# Grading


def test_every_gold_answer_written_as_a_model_would_is_correct():
    golds = all_gold_answers()
    assert len(golds) == 660
    answers, statuses = grade_responses([f"Thus, so the answer is \\boxed{{{g}}}." for g in golds], golds)
    assert answers == golds
    assert statuses.count("correct") == 660, [g for g, s in zip(golds, statuses, strict=True) if s != "correct"]


def test_perturbed_answers_are_wrong():
    golds = all_gold_answers()
    statuses = grade([perturb(g) for g in golds], golds)
    assert statuses.count("correct") == 0, [g for g, s in zip(golds, statuses, strict=True) if s == "correct"]
    assert statuses.count("incorrect") == 660


def test_grading_statuses():
    responses = [
        "\\boxed{12} then \\boxed{133}.",  # the last box counts
        "\\boxed{133.0}",
        "\\boxed{134}",
        "\\boxed{133} no wait \\boxed{123}",
        "133",  # no box
        "\\boxed{ }",  # empty box
        "\\boxed{",  # unclosed box
        "\\boxed{\\frac{266}{2}}",  # nested braces
    ]
    answers, statuses = grade_responses(responses, ["133"] * len(responses))
    assert answers == ["133", "133.0", "134", "123", None, " ", None, "\\frac{266}{2}"]
    expected = ["correct", "correct", "incorrect", "incorrect", "no_answer", "no_answer", "no_answer", "correct"]
    assert statuses == expected


def test_a_grading_timeout_counts_as_wrong_and_is_recorded():
    # A 10-microsecond budget: sympy cannot parse and compare anything that fast, so every item times out.
    statuses = grade(["\\frac{1}{2}", "(x+1)^{12}"], ["0.5", "(1+x)^{12}"], timeout_seconds=1e-5)
    assert statuses == ["timeout", "timeout"]


def test_results_do_not_depend_on_the_number_of_workers():
    golds = all_gold_answers()[:150]
    answers = [g if i % 3 else perturb(g) for i, g in enumerate(golds)]
    one = grade(answers, golds, workers=1)
    assert one == grade(answers, golds, workers=2) == grade(answers, golds, workers=3)
    assert one.count("correct") == 100


def test_grading_workers_are_not_forks_of_the_caller_and_find_its_imports_done(tmp_path):
    """A fork of a caller with other threads can hang (CPython gh-112275: an evaluation in a 2-process run never
    ended), so no worker is forked from the caller. Each worker runs the caller's `python -m` main module again: its
    imports are done once, in the forkserver. `heavy` logs each process that imports it: the caller and the forkserver
    (a fork of the caller would log 1; workers importing anew, 5, over 2 calls of 2 workers), and nothing warns."""
    package = tmp_path / "caller"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text(f"open({str(tmp_path / 'imports.log')!r}, 'a').write('import\\n')\n")
    (package / "main.py").write_text(
        "import threading\n"
        "from caller import heavy\n"
        "from tvopd_trl.eval.grading import grade\n"
        "if __name__ == '__main__':\n"
        "    threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "    for _ in range(2):\n"
        "        assert grade(['1', '2'], ['1', '3'], workers=2) == ['correct', 'incorrect']\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "caller.main"], cwd=tmp_path, capture_output=True, text=True, timeout=time_limit(120)
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert (tmp_path / "imports.log").read_text().count("import") == 2


def test_grading_rejects_bad_arguments():
    with pytest.raises(ValueError, match="one gold answer per answer"):
        grade(["1"], ["1", "2"])
    with pytest.raises(ValueError, match="at least 1"):
        grade(["1"], ["1"], workers=0)


# Metrics


def test_pass_at_k_matches_the_combinatorial_formula():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(16, 0, 8) == 0.0
    assert pass_at_k(16, 9, 8) == 1.0  # fewer wrong samples than k
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)  # pass@1 is the share of correct samples
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_mean_at_k_stderr_and_pass_at_k_by_hand():
    scores = summarize([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    per_problem = [0.25, 1.0, 0.0]
    mean = sum(per_problem) / 3
    stderr = math.sqrt(sum((p - mean) ** 2 for p in per_problem) / 2) / math.sqrt(3)
    assert scores["k"] == 4 and scores["problems"] == 3
    assert scores["mean@4"] == pytest.approx(5 / 12) and scores["stderr"] == pytest.approx(stderr)
    assert scores["pass@1"] == pytest.approx(5 / 12)
    assert scores["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert scores["pass@4"] == pytest.approx(2 / 3)
    assert summarize([[1, 0]])["stderr"] is None
    with pytest.raises(ValueError, match="same positive number"):
        summarize([[1, 0], [1]])


# Generation


def test_transformers_generator_is_seeded_and_restores_the_model(tokenizer, model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    model.train()
    tokenizer.padding_side = "right"
    prompts = [[{"role": "user", "content": "Compute 12 + 34."}], [{"role": "user", "content": "Compute 50 + 50."}]]
    generator = TransformersGenerator(model, tokenizer, batch_size=3)
    settings = SamplingSettings(k=3, max_new_tokens=5, temperature=1.0, top_k=0, top_p=1.0)
    first = generator(prompts, settings)
    assert [len(responses) for responses in first] == [3, 3]
    assert first == generator(prompts, settings)  # same seed, same responses
    assert first != generator(prompts, SamplingSettings(**{**settings.to_dict(), "seed": 1}))
    greedy = generator(prompts, SamplingSettings(k=3, temperature=0, max_new_tokens=5))
    assert all(len(set(responses)) == 1 and len(responses) == 3 for responses in greedy)
    assert model.training and tokenizer.padding_side == "right"  # generation pads on the left, then restores
    tokenizer.padding_side = "left"


def stand_in_vllm(monkeypatch, vocab_size, cpu=False):
    """A stand-in `vllm` module (the real one runs in tests/test_vllm_eval.py) serving an output layer of `vocab_size`
    rows, on a GPU unless `cpu`: it records what it is asked, and each engine's liveness."""
    seen = {"engines": []}

    class SamplingParams:
        def __init__(self, **kwargs):
            seen["params"] = kwargs

    class LLM:
        def __init__(self, model, **kwargs):
            seen["llm"] = (model, kwargs)
            seen["engines"].append(weakref.ref(self))
            config = types.SimpleNamespace(vocab_size=vocab_size)
            self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(get_text_config=lambda: config))

        def generate(self, requests, params):
            seen["requests"] = requests
            n = seen["params"]["n"]
            completion = types.SimpleNamespace
            return [
                types.SimpleNamespace(outputs=[completion(text=f"{i}-{j}") for j in range(n)])
                for i in range(len(requests))
            ]

    platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))
    return seen


def test_vllm_generator_requests_token_ids_and_n_samples(monkeypatch, tokenizer):
    seen = stand_in_vllm(monkeypatch, len(tokenizer))
    generator = VLLMGenerator("some/model", tokenizer, tensor_parallel_size=2)
    prompts = [[{"role": "user", "content": "Compute 12 + 34."}], [{"role": "user", "content": "Compute 1 + 2."}]]
    responses = generator(prompts, SamplingSettings(k=3, max_new_tokens=100, seed=7))
    assert responses == [["0-0", "0-1", "0-2"], ["1-0", "1-1", "1-2"]]
    assert seen["llm"] == ("some/model", {"tensor_parallel_size": 2})
    assert seen["params"] == dict(n=3, temperature=0.6, top_p=0.95, top_k=20, max_tokens=100, seed=7, logit_bias=None)
    text = tokenizer.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True)
    assert seen["requests"][0] == {"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
    # vLLM refuses n > 1 at temperature 0: one greedy response, repeated
    assert generator(prompts, SamplingSettings(k=3, temperature=0))[1] == ["1-0"] * 3 and seen["params"]["n"] == 1


def test_vllm_generator_biases_padded_ids_away_and_closes_its_engine(monkeypatch, tokenizer):
    seen = stand_in_vllm(monkeypatch, len(tokenizer) + 3)
    generator = VLLMGenerator("some/model", tokenizer)
    generator([[{"role": "user", "content": "Compute 1 + 2."}]], SamplingSettings(k=2))
    assert seen["params"]["logit_bias"] == {len(tokenizer) + i: -100.0 for i in range(3)}
    generator.close()
    assert seen["engines"][0]() is None


def test_vllm_generator_on_a_cpu_schedules_whole_prompts(monkeypatch, tokenizer):
    # The real crash a split prompt causes there runs in tests/test_vllm_eval.py.
    seen = stand_in_vllm(monkeypatch, len(tokenizer), cpu=True)
    VLLMGenerator("some/model", tokenizer, max_num_batched_tokens=64)
    assert seen["llm"] == ("some/model", {"max_num_batched_tokens": 64, "enable_chunked_prefill": False})
    with pytest.raises(ValueError, match="leave it unset"):
        VLLMGenerator("some/model", tokenizer, enable_chunked_prefill=True)


def test_cli_closes_each_checkpoints_vllm_engine_before_the_next(monkeypatch, model_dirs, tokenizer, tmp_path):
    # Two engines would not fit: the first holds its memory share until it is shut down.
    seen = stand_in_vllm(monkeypatch, len(tokenizer))
    import vllm

    build = vllm.LLM.__init__

    def one_at_a_time(self, model, **kwargs):
        assert not [engine for engine in seen["engines"] if engine() is not None]
        build(self, model, **kwargs)

    monkeypatch.setattr(vllm.LLM, "__init__", one_at_a_time)
    for step in (1, 2):
        shutil.copytree(model_dirs["student"], tmp_path / f"checkpoint-{step}")
    argv = ["eval", "--model", str(tmp_path), "--benchmarks", "tiny", "--limit", "2", "--k", "1", "--backend", "vllm"]
    assert cli_main([*argv, "--dtype", "float32", "--workers", "1"]) == 0
    assert len(seen["engines"]) == 2 and seen["llm"][1]["dtype"] == "float32"  # `--dtype` reaches vLLM too


def test_vllm_generator_without_vllm_says_what_to_install(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[vllm\]"'):
        VLLMGenerator("some/model", tokenizer)


# Records


def fixed_generator(responses_for):
    def generate(prompts, settings):
        return [responses_for(prompt[0]["content"])[: settings.k] for prompt in prompts]

    return generate


def test_evaluate_writes_auditable_records(tmp_path):
    golds = {p.problem: p.answer for p in load_problems("tiny")}

    def responses_for(content):
        gold = golds[content]
        return [f"\\boxed{{{gold}}}", f"\\boxed{{{int(gold) + 1}}}", "I give up"]

    settings = SamplingSettings(k=3, max_new_tokens=8)
    results = evaluate(fixed_generator(responses_for), ["tiny"], settings, tmp_path, limit=10, save_responses=True)
    scores = results["benchmarks"]["tiny"]
    assert scores["mean@3"] == pytest.approx(1 / 3) and scores["pass@3"] == 1.0
    assert scores["no_answer"] == 10 and scores["timeouts"] == 0
    records = [json.loads(line) for line in (tmp_path / "tiny.jsonl").read_text().splitlines()]
    assert len(records) == 30
    assert records[0] == {
        "problem_id": "22+13",
        "sample": 0,
        "gold": "35",
        "answer": "35",
        "correct": True,
        "status": "correct",
        "response": "\\boxed{35}",
    }
    assert records[2]["answer"] is None and records[2]["status"] == "no_answer" and not records[2]["correct"]
    # Any number can be recomputed from the records.
    assert sum(r["correct"] for r in records) / len(records) == pytest.approx(scores["mean@3"])
    assert json.loads((tmp_path / "results.json").read_text())["benchmarks"]["tiny"] == scores


def test_evaluate_adds_benchmarks_and_refuses_to_mix_settings(tmp_path):
    always = fixed_generator(lambda content: ["\\boxed{0}"] * 2)
    settings = SamplingSettings(k=2)
    evaluate(always, ["tiny"], settings, tmp_path, limit=3)
    evaluate(always, ["amc23"], settings, tmp_path, data_dir=DATA_DIR, limit=3)
    assert set(json.loads((tmp_path / "results.json").read_text())["benchmarks"]) == {"tiny", "amc23"}
    with pytest.raises(ValueError, match=r"holds another evaluation: \(there, here\) = \{'settings'"):
        evaluate(always, ["tiny"], SamplingSettings(k=2, temperature=1.0), tmp_path, limit=3)
    with pytest.raises(ValueError, match=r"holds another evaluation: \(there, here\) = \{'model': \(None, 'other'\)"):
        evaluate(always, ["tiny"], settings, tmp_path, limit=3, model="other")  # another model never merges in
    assert not (tmp_path / "results.json.tmp").exists()  # written atomically
    with pytest.raises(ValueError, match="Unknown benchmark"):
        evaluate(always, ["tiny", "nope"], settings)


def test_sampling_defaults_are_the_papers():
    assert SamplingSettings().to_dict() == dict(
        k=16, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=31744, seed=0
    )
    with pytest.raises(ValueError):
        SamplingSettings(k=0)


def test_chat_template_kwargs_render_the_prompts_as_training_does(tokenizer):
    """Qwen3's `enable_thinking`, on a template that reads it: unset, the template's defaults."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}<no-think>"
        "{% endif %}={% endif %}"
    )
    prompt = [{"role": "user", "content": "1+2"}]
    assert SamplingSettings().prompt_text(tokenizer, prompt) == "1+2="
    settings = SamplingSettings(chat_template_kwargs={"enable_thinking": False})
    assert settings.prompt_text(tokenizer, prompt) == "1+2<no-think>="
    assert settings.to_dict()["chat_template_kwargs"] == {"enable_thinking": False}  # in the records' protocol
    assert "chat_template_kwargs" not in SamplingSettings().to_dict()  # as records written before it existed


# End to end


def test_eval_command_on_the_tiny_student_writes_records_and_a_table(tmp_path, capsys):
    output_dir = tmp_path / "student"
    argv = ["eval", "--model", student_path(), "--benchmarks", "tiny", "--k", "4", "--max_new_tokens", "16"]
    assert cli_main([*argv, "--limit", "100", "--output_dir", str(output_dir)]) == 0
    results = json.loads((output_dir / "results.json").read_text())
    scores = results["benchmarks"]["tiny"]
    assert scores["problems"] == 100 and scores["k"] == 4
    assert 0.15 < scores["mean@4"] < 0.55  # the shipped student solves about a third
    assert len((output_dir / "tiny.jsonl").read_text().splitlines()) == 400
    table = (output_dir / "table.md").read_text()
    assert "| tiny | 100 | 4 |" in table and table in capsys.readouterr().out


def test_eval_command_evaluates_each_checkpoint_of_a_run_once(tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(student_path())
    tokenizer = AutoTokenizer.from_pretrained(student_path())
    for step in (10, 20):
        model.save_pretrained(tmp_path / f"checkpoint-{step}")
        tokenizer.save_pretrained(tmp_path / f"checkpoint-{step}")
    argv = ["eval", "--model", str(tmp_path), "--benchmarks", "tiny", "--k", "2", "--max_new_tokens", "16"]
    assert cli_main([*argv, "--limit", "20"]) == 0
    records = [tmp_path / "eval" / "mean@2" / f"step-{step}" / "tiny.jsonl" for step in (10, 20)]
    assert all(path.is_file() for path in records)
    written = [path.stat().st_mtime_ns for path in records]
    assert cli_main([*argv, "--limit", "20"]) == 0
    assert [path.stat().st_mtime_ns for path in records] == written
    assert "already evaluated" in capsys.readouterr().out


def test_eval_command_makes_a_run_s_step_0_and_shares_its_checkpoints_out(tmp_path, capsys):
    """`--student` evaluates the model the run started from as its step 0 (the report's Student row); `--shard i/n`
    commands, one per GPU, evaluate disjoint checkpoints that cover the run."""
    model = AutoModelForCausalLM.from_pretrained(student_path())
    tokenizer = AutoTokenizer.from_pretrained(student_path())
    for step in (10, 20, 30):
        model.save_pretrained(tmp_path / f"checkpoint-{step}")
        tokenizer.save_pretrained(tmp_path / f"checkpoint-{step}")
    argv = ["eval", "--model", str(tmp_path), "--benchmarks", "tiny", "--k", "1", "--max_new_tokens", "8"]
    argv += ["--limit", "4"]
    assert cli_main([*argv, "--shard", "1/2"]) == 0  # steps 20 (and 0, once there is a student)
    assert "has no step-0 evaluation" in capsys.readouterr().out
    evaluated = sorted(path.name for path in (tmp_path / "eval" / "mean@1").iterdir())
    assert evaluated == ["step-20"]
    assert cli_main([*argv, "--shard", "0/2", "--student", student_path()]) == 0  # steps 0 and 20 of 0, 10, 20, 30
    evaluated = sorted(path.name for path in (tmp_path / "eval" / "mean@1").iterdir())
    assert evaluated == ["step-0", "step-20"]
    assert cli_main([*argv, "--shard", "1/2", "--student", student_path()]) == 0
    evaluated = sorted(path.name for path in (tmp_path / "eval" / "mean@1").iterdir())
    assert evaluated == ["step-0", "step-10", "step-20", "step-30"]
    step0 = json.loads((tmp_path / "eval" / "mean@1" / "step-0" / "results.json").read_text())
    assert step0["model"] == str(tmp_path)  # the run, as the main job records its own step 0
    assert cli_main([*argv, "--shard", "2/2"]) == 2
    assert "--shard is INDEX/COUNT" in capsys.readouterr().err


def test_eval_command_reports_bad_input_without_a_traceback(tmp_path, capsys):
    argv = ["eval", "--model", student_path(), "--benchmarks", "tiny", "--chat_template_kwargs", "thinking"]
    assert cli_main(argv) == 2
    assert "--chat_template_kwargs must be a JSON object" in capsys.readouterr().err
    assert cli_main(["eval", "--model", student_path(), "--benchmarks", "tiny,aime2024"]) == 2
    assert "Unknown benchmark 'aime2024'" in capsys.readouterr().err
    assert cli_main(["eval", "--model", str(tmp_path), "--benchmarks", "tiny"]) == 2
    assert "neither a model (no config.json) nor a run directory" in capsys.readouterr().err


# In-training evaluation


def test_callback_logs_eval_metrics_and_writes_records_beside_checkpoints(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, max_steps=4, logging_steps=3))
    settings = SamplingSettings(k=2, max_new_tokens=8)
    callback = BenchmarkEvalCallback(trainer, ["tiny"], eval_every_steps=2, settings=settings, limit=6)
    trainer.add_callback(callback)
    trainer.train()
    assert [step for step, _ in callback.history] == [0, 2, 4]
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "eval/tiny/mean@2" in entry}
    assert sorted(logged) == [0, 2, 4]
    assert "loss" in logged[2] and "tv/scale" in logged[2]  # logged with that step's training metrics
    for step, results in callback.history:
        folder = tmp_path / "eval" / "mean@2" / f"step-{step}"
        saved = json.loads((folder / "results.json").read_text())
        assert saved["step"] == step and saved["benchmarks"] == results["benchmarks"]
        assert logged[step]["eval/tiny/mean@2"] == results["benchmarks"]["tiny"]["mean@2"]
        assert len((folder / "tiny.jsonl").read_text().splitlines()) == 12


def test_callback_validates_its_benchmarks_before_training(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path))
    with pytest.raises(ValueError, match="Unknown benchmark"):
        BenchmarkEvalCallback(trainer, ["aime2024"], eval_every_steps=2)
    with pytest.raises(FileNotFoundError, match="No aime24.jsonl"):
        BenchmarkEvalCallback(trainer, ["aime24"], eval_every_steps=2, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="at least 1"):
        BenchmarkEvalCallback(trainer, ["tiny"], eval_every_steps=0)


def test_callback_refuses_evaluations_left_by_an_earlier_run(make_trainer, tmp_path):
    (tmp_path / "eval" / "mean@2" / "step-8").mkdir(parents=True)
    (tmp_path / "eval" / "mean@2" / "step-8" / "results.json").write_text('{"benchmarks": {}}')
    trainer = make_trainer(tiny_config(tmp_path, max_steps=2))
    trainer.add_callback(
        BenchmarkEvalCallback(trainer, ["tiny"], 2, settings=SamplingSettings(k=2, max_new_tokens=8), limit=2)
    )
    with pytest.raises(ValueError, match=r"evaluations of steps \[8\], beyond step 0 .* earlier run"):
        trainer.train()


def test_a_gold_answer_math_verify_cannot_parse_is_reported():
    assert grade(["5", "5"], ["5", "\\text{}"]) == ["correct", "invalid_gold"]


def test_the_jobs_accuracy_averages_its_own_benchmarks_only(tmp_path):
    # An earlier evaluation of the same model and protocol left another benchmark in the folder: it is kept in
    # results.json, and stays out of the job's accuracy.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tvopd_trl.job import Accuracy, MainJobArguments
    from tvopd_trl.tiny import student_path

    tokenizer = AutoTokenizer.from_pretrained(student_path())
    accuracy = Accuracy(MainJobArguments(eval_problems=3, eval_k=2, eval_benchmark="tiny"), tokenizer)
    perfect = {p.problem: p.answer for p in load_problems("tiny-subtraction")}
    generator = fixed_generator(lambda content: [f"\\boxed{{{perfect[content]}}}"] * 2)
    evaluate(generator, ["tiny-subtraction"], accuracy.settings, tmp_path, limit=3, model="student")
    student = AutoModelForCausalLM.from_pretrained(student_path())
    scores = accuracy.scores(student, output_dir=str(tmp_path), model_id="student")
    saved = json.loads((tmp_path / "results.json").read_text())["benchmarks"]
    assert set(saved) == {"tiny", "tiny-subtraction"} and saved["tiny-subtraction"]["mean@2"] == 1.0
    assert list(scores) == ["tiny"] and scores["tiny"] == saved["tiny"]["mean@2"]


def test_transformers_generator_never_samples_a_padded_id(tokenizer, model_dirs):
    # An output layer padded beyond the tokenizer (as Qwen's), whose padded rows carry a bias that makes them far
    # likelier than any real token
    model = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    model.resize_token_embeddings(len(tokenizer) + 20)
    weight = model.get_output_embeddings().weight
    head = torch.nn.Linear(weight.size(1), weight.size(0), bias=True)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
        head.bias[len(tokenizer) :] = 20.0
    model.lm_head = head
    prompts = [[{"role": "user", "content": f"Compute {a} + {a + 3}."}] for a in range(10, 18)]
    tokenizer.padding_side = "left"
    inputs = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_tensors="pt", padding=True)
    with torch.no_grad():
        first = model(**inputs).logits[:, -1].softmax(-1)
    assert first[:, len(tokenizer) :].sum(-1).min() > 0.99  # unsuppressed, nearly every draw would be padded

    sampled = []
    generate = model.generate

    def record(**kwargs):
        output = generate(**kwargs)
        sampled.append(output[:, kwargs["input_ids"].size(1) :])
        return output

    model.generate = record
    settings = SamplingSettings(k=4, max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    TransformersGenerator(model, tokenizer, batch_size=16)(prompts, settings)
    ids = torch.cat(sampled)
    assert ids.numel() == 32 * 6 and int(ids.max()) < len(tokenizer)
