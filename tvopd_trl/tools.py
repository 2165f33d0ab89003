# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Multi-turn completions of TRL's tool loop, under vLLM: the sampler's log-probabilities of each assistant turn, put
back in the completion's order.

TRL's `_tool_call_loop` samples the first turn of every row, then, while rows call a tool, appends each such row's
tool results to its completion (TRL's `tool_mask` is 0 there) and samples its next turn. A row leaves the loop for
good when it calls no tool, when a tool result would not fit, or after the last iteration; the rows of each turn keep
the batch's order; a turn cut to fit `max_completion_length` is the row's last. So row `i` took part in the first
`1 + T_i` generation calls, `T_i` being the number of tool-result stretches in its mask, and its assistant stretches
are its turns, in order, the last one possibly cut short (or cut to nothing).
"""

import functools
import itertools

from accelerate.utils import broadcast_object_list


def mask_runs(mask):
    """`[(value, length), ...]`: the runs of equal values of `mask`, in order."""
    return [(value, len(list(run))) for value, run in itertools.groupby(mask)]


def turn_requests(lengths, max_tokens, context):
    """`[(max_tokens, rows), ...]`: the requests that sample a turn for prompts of `lengths` tokens, none asking for
    more tokens than fit after its prompt in a `context` of that many positions (`None`: no limit). vLLM refuses a
    request whose prompt and `max_tokens` exceed its context, and a tool turn starts after the turns and results before
    it; TRL asks `max_completion_length` of every turn (and keeps what the completion budget leaves). One request
    where every prompt leaves room for `max_tokens`."""
    requests = {}
    for row, length in enumerate(lengths):
        room = max_tokens if context is None else max(min(max_tokens, context - length), 1)
        requests.setdefault(room, []).append(row)
    return sorted(requests.items(), reverse=True)


def served_max_model_len(client):
    """The context of the vLLM server of TRL's `VLLMClient` `client` (its `--max-model-len`), as vLLM's model card
    (`GET /v1/models`) gives it; `None` from a server that gives none."""
    response = client.session.get(f"{client.base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0].get("max_model_len")


def assemble_sampler_logps(turns, tool_masks):
    """Each row's sampler log-probabilities over its whole completion: its turns' in order, 0.0 on tool-result tokens
    (the loss, the TV estimate and the importance weights mask them out).

    `turns`: one list per generation call of the tool loop, in order, holding the per-token log-probabilities of the
    rows that took part (every row in the first, in the batch's order). `tool_masks`: TRL's per-row `tool_mask` (1 on
    sampled tokens, 0 on tool results), or `None` without tools. Raises if the two do not line up: a sampled token
    would otherwise be weighted with another token's log-probability."""
    if tool_masks is None:
        return [list(logps) for logps in turns[0]]
    runs = [mask_runs(mask) for mask in tool_masks]
    # Row i's index within each call it took part in: the calls after the first hold the rows with that many tool
    # stretches or more, in order.
    positions = [dict() for _ in tool_masks]
    for call in range(len(turns)):
        members = [i for i, row in enumerate(runs) if sum(value == 0 for value, _ in row) >= call]
        if len(members) != len(turns[call]):
            raise RuntimeError(
                f"Generation call {call} of the tool loop sampled {len(turns[call])} rows, but the tool masks say "
                f"{len(members)} took part: the sampler's log-probabilities cannot be matched to their tokens."
            )
        for position, i in enumerate(members):
            positions[i][call] = position
    assembled = []
    for i, row in enumerate(runs):
        logps, call = [], 0
        for value, length in row:
            if value == 0:  # a tool result, after which the row's next call sampled its next turn
                logps += [0.0] * length
                call += 1
                continue
            turn = turns[call][positions[i][call]]
            last = call == len(positions[i]) - 1
            if length > len(turn) or (length < len(turn) and not last):
                raise RuntimeError(
                    f"Row {i}'s turn {call} has {length} sampled tokens in the completion but {len(turn)} "
                    "log-probabilities from the sampler."
                )
            logps += list(turn[:length])
        assembled.append(logps)
    return assembled


class ToolLoopMixin:
    """The tool half of [`TVOPDTrainer`]'s rollouts, around TRL's `_generate` and `_tool_call_loop`: under vLLM, the
    trainer's `_generate_single_turn` appends each call's sampled log-probabilities to `_sampler_turns`, which
    `_generate` assembles into `_sampler_logps`; with tools, the conversations go to the reward functions
    (`_tool_completions`). It reads the trainer's `use_vllm`, `vllm_mode`, `vllm_generation` and `model`."""

    _sampler_turns = None
    _sampler_logps = None
    _tool_completions = None

    @functools.cached_property
    def _tool_context(self):
        """The positions a tool turn's prompt and sampled tokens must fit in under vLLM: the colocated engine's
        `max_model_len`, as TRL's tool loop reads it; on a server, the smaller of its `--max-model-len` and the model's
        `max_position_embeddings`, since the server samples the turn and the model scores it (`None`: no limit)."""
        generation = self.vllm_generation
        if self.vllm_mode == "colocate":
            return generation.llm.llm_engine.model_config.max_model_len
        # Only the main process holds the client; every process splits its turns by the answer, as TRL's generation
        # gathers them (and the tool-result check must agree across processes)
        served = served_max_model_len(generation.vllm_client) if self.accelerator.is_main_process else None
        if self.accelerator.num_processes > 1:
            served = broadcast_object_list([served])[0]
        limits = (getattr(self.model.config, "max_position_embeddings", None), served)
        return min((limit for limit in limits if limit is not None), default=None)

    def _sample_tool_turn(self, prompt_ids):
        """vLLM's completions of `prompt_ids` (and their log-probabilities) in the requests `turn_requests` makes, within
        the context TRL's tool loop checks tool results against."""
        generation = self.vllm_generation
        budget = generation.max_completion_length
        completion_ids, logprobs = [None] * len(prompt_ids), [None] * len(prompt_ids)
        try:
            for max_tokens, rows in turn_requests([len(ids) for ids in prompt_ids], budget, self._tool_context):
                generation.max_completion_length = max_tokens
                _, sampled, sampled_logprobs, _ = generation.generate(
                    prompts=[prompt_ids[row] for row in rows], images=None, num_generations=1
                )
                for row, ids, row_logprobs in zip(rows, sampled, sampled_logprobs, strict=True):
                    completion_ids[row], logprobs[row] = ids, row_logprobs
        finally:
            generation.max_completion_length = budget
        return completion_ids, logprobs

    def _generate(self, prompts):
        # Under vLLM, each generation call of the tool loop records its turns' sampler log-probabilities
        self._sampler_turns, self._tool_completions = [], None
        prompt_ids, completion_ids, tool_mask, images, tool_images = super()._generate(prompts)
        if self.use_vllm:
            self._sampler_logps = assemble_sampler_logps(self._sampler_turns, tool_mask)
        return prompt_ids, completion_ids, tool_mask, images, tool_images

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, images, multimodal_fields):
        # In server mode TRL checks tool results against the model's `max_position_embeddings` alone: a server with a
        # shorter `--max-model-len` would refuse the turn after a result that passed, and stop the run. The check
        # reads the served context while the loop runs (nothing else reads it meanwhile: no forward pass runs).
        config, positions = self.model.config, None
        if self.use_vllm and self.vllm_mode == "server" and self._tool_context is not None:
            positions, config.max_position_embeddings = config.max_position_embeddings, self._tool_context
        try:
            result = super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, images, multimodal_fields
            )
        finally:
            if positions is not None:
                config.max_position_embeddings = positions
        # The conversations (assistant turns with their tool calls, and tool results) go to the reward functions
        self._tool_completions = result[1]
        return result
