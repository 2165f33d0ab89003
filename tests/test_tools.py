"""The sampler's log-probabilities of TRL's multi-turn tool completions, put back in order (`tvopd_trl.tools`), on
enumerated tool loops. The trainer against a real vLLM server: tests/test_vllm_tools.py."""

import inspect

import pytest

from tvopd_trl.checks import check_inputs
from tvopd_trl.rewards import accuracy_reward, final_answer
from tvopd_trl.testing import tiny_config
from tvopd_trl.tiny import prompt_dataset
from tvopd_trl.tools import ToolLoopMixin, assemble_sampler_logps, mask_runs, turn_requests


def test_mask_runs():
    assert mask_runs([1, 1, 0, 0, 0, 1]) == [(1, 2), (0, 3), (1, 1)]
    assert mask_runs([]) == []


def test_turn_requests_ask_no_more_tokens_than_fit_in_the_context():
    # Context 64, 40 tokens per turn: prompts of 10 and 24 tokens leave room for 40; 30 for 34; 60 for 4
    assert turn_requests([10, 30, 24, 60, 30], 40, 64) == [(40, [0, 2]), (34, [1, 4]), (4, [3])]
    assert turn_requests([10, 30], 40, None) == [(40, [0, 1])]
    assert turn_requests([70], 40, 64) == [(1, [0])]  # no room at all: vLLM's own error names the context


@pytest.mark.parametrize(("served", "context"), [(48, 48), (None, 128), (256, 128)])
def test_tool_turns_on_a_server_fit_its_max_model_len(served, context):
    """In server mode, TRL's tool loop checks tool results against the model's `max_position_embeddings` (128 here),
    and each turn's requests were split against it too: a server started with a shorter `--max-model-len` (48) then
    refused the next turn (HTTP 400), stopping the run. Both now read the smaller of the two, the server's from vLLM's
    model card (`GET /v1/models`, here a stand-in; a server that gives none leaves the model's)."""
    import http.server
    import json
    import threading
    import types

    import requests

    card = {"id": "student", "object": "model", **({} if served is None else {"max_model_len": served})}

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [card]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Loop:  # TRL's trainer under the mixin: its loop's context check, then a turn's sampling
        def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, images, multimodal_fields):
            self.checked_against = self.model.config.max_position_embeddings
            self._sample_tool_turn(prompt_ids)
            return prompt_ids, completions, None, None, None

    class Trainer(ToolLoopMixin, Loop):
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sent = []

    def generate(prompts, images, num_generations):
        sent.append((generation.max_completion_length, len(prompts)))
        return None, [[7]] * len(prompts), [[[-0.5]]] * len(prompts), None

    client = types.SimpleNamespace(session=requests.Session(), base_url=f"http://127.0.0.1:{server.server_address[1]}")
    generation = types.SimpleNamespace(max_completion_length=40, vllm_client=client, generate=generate)
    trainer = Trainer()
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "server", generation
    trainer.accelerator = types.SimpleNamespace(is_main_process=True, num_processes=1)
    trainer.model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=128))
    try:
        trainer._tool_call_loop(None, [[1] * 10, [1] * 30], None, ["conversation"], None, None)
    finally:
        server.shutdown()
        server.server_close()
    assert trainer.checked_against == context
    # Prompts of 10 and 30 tokens, 40 per turn: within 48 positions, room for 38 and 18
    assert sent == ([(38, 1), (18, 1)] if context == 48 else [(40, 2)])
    assert trainer.model.config.max_position_embeddings == 128 and generation.max_completion_length == 40
    assert trainer._tool_completions == ["conversation"]


def test_every_process_takes_the_served_context_from_the_main_process(monkeypatch):
    """Only the main process holds TRL's client in server mode: the others take its answer from a broadcast (each
    process splits its turns alike, as TRL's generation gathers them), and never ask the server."""
    import types

    from tvopd_trl import tools

    broadcasts = []
    monkeypatch.setattr(tools, "broadcast_object_list", lambda objects: broadcasts.append(objects) or [48])
    trainer = ToolLoopMixin()
    trainer.vllm_mode = "server"
    trainer.vllm_generation = types.SimpleNamespace()  # no `vllm_client`, as on a process other than the main one
    trainer.accelerator = types.SimpleNamespace(is_main_process=False, num_processes=2)
    trainer.model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=128))
    assert trainer._tool_context == 48 and broadcasts == [[None]]


def test_trl_s_tool_loop_reads_the_context_the_mixin_lends_it():
    """The mixin lends TRL's tool-result check the served context through the model config's
    `max_position_embeddings`, which TRL 1.16 reads outside colocate mode: a TRL that reads it elsewhere fails here."""
    from trl.trainer.distillation_trainer import DistillationTrainer

    source = inspect.getsource(DistillationTrainer._tool_call_loop)
    assert "max_model_len = config.max_position_embeddings" in source


def test_without_tools_the_single_turn_is_the_completion():
    assert assemble_sampler_logps([[[-0.5, -1.0], [-2.0]]], None) == [[-0.5, -1.0], [-2.0]]


def test_each_rows_turns_in_order_around_its_tool_results():
    # Row 0 calls a tool once; row 1 calls none (or its tool result would not fit); row 2 calls one twice and its last
    # turn is cut from 3 tokens to 1 by max_completion_length; row 3 calls one and its next turn is cut to nothing.
    first = [[-1.0, -1.1], [-2.0, -2.1, -2.2], [-3.0], [-4.0, -4.1]]
    second = [[-1.5], [-3.5, -3.6], [-4.5]]  # rows 0, 2, 3
    third = [[-3.7, -3.8, -3.9]]  # row 2
    masks = [
        [1, 1, 0, 0, 1],
        [1, 1, 1],
        [1, 0, 1, 1, 0, 0, 0, 1],
        [1, 1, 0, 0],
    ]
    assert assemble_sampler_logps([first, second, third], masks) == [
        [-1.0, -1.1, 0.0, 0.0, -1.5],
        [-2.0, -2.1, -2.2],
        [-3.0, 0.0, -3.5, -3.6, 0.0, 0.0, 0.0, -3.7],
        [-4.0, -4.1, 0.0, 0.0],
    ]


def test_turns_that_do_not_line_up_with_the_masks_are_refused():
    first = [[-1.0], [-2.0]]
    with pytest.raises(RuntimeError, match="call 1 of the tool loop sampled 2 rows, but the tool masks say 1"):
        assemble_sampler_logps([first, [[-1.5], [-2.5]]], [[1, 0, 1], [1]])
    # An earlier turn shorter in the completion than sampled: only the last turn is ever cut
    with pytest.raises(RuntimeError, match="Row 0's turn 0 has 1 sampled tokens in the completion but 2"):
        assemble_sampler_logps([[[-1.0, -1.1]], [[-1.5]]], [[1, 0, 1]])
    with pytest.raises(RuntimeError, match="Row 0's turn 1 has 2 sampled tokens in the completion but 1"):
        assemble_sampler_logps([[[-1.0]], [[-1.5]]], [[1, 0, 1, 1]])


def test_rewards_grade_the_answer_after_the_last_tool_result():
    conversation = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
        {"role": "tool", "name": "add", "content": "\\boxed{7}"},
        {"role": "assistant", "content": "\\boxed{46}"},
    ]
    assert final_answer(conversation) == "\\boxed{46}"
    assert final_answer(conversation[:2]) == ""  # the turn after the tool result was cut to nothing
    assert accuracy_reward([conversation, conversation[:2]], solution=["46", "7"]) == [1.0, 0.0]


def test_tools_with_several_processes_on_one_rollout_server_are_refused(tmp_path, monkeypatch):
    args = tiny_config(tmp_path, use_vllm=True, vllm_mode="server")
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda: True)  # refused before vLLM is needed
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        check_inputs(args, prompt_dataset("opd", 8), None, [max], "some/teacher")


def test_tools_with_tensor_parallel_colocated_vllm_are_refused(tmp_path, monkeypatch):
    args = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    monkeypatch.setattr("tvopd_trl.checks.is_vllm_available", lambda: True)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=1"):
        check_inputs(args, prompt_dataset("opd", 8), None, [max], "some/teacher")


def test_async_tools_are_refused_before_any_model_loads(tmp_path):
    async def add(a: int, b: int) -> int:
        return a + b

    assert inspect.iscoroutinefunction(add)
    with pytest.raises(ValueError, match="Async tools"):
        check_inputs(tiny_config(tmp_path), prompt_dataset("opd", 8), None, [add], "some/teacher")
