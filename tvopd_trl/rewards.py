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
"""A task reward beside the teacher (docs/method.md, section 9): reward functions as TRL's `GRPOTrainer` takes them,
the registered names a recipe gives, and GRPO's group normalisation of the weighted reward into a sequence advantage."""

import asyncio
import atexit
import inspect
import math
import threading
from collections.abc import Callable

import torch
from trl.data_utils import is_conversational
from trl.trainer.utils import get_callable_name, nanstd, shutdown_event_loop_in_daemon, start_event_loop_in_daemon


def final_answer(conversation):
    """The content of the last assistant message of a conversational completion (with tools, the turn after the
    last tool result; "" if it has none)."""
    replies = [message for message in conversation if message.get("role") == "assistant"]
    return (replies[-1].get("content") or "") if replies else ""


def accuracy_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion's last `\\boxed{}` equals the gold answer under math-verify, else 0.0 (nothing boxed,
    a wrong answer, or a grading timeout); `None`, a skip, where the gold answer itself does not parse. The gold
    answer is the dataset's `solution` column, or its `answer` column. The evaluation's grader (`tvopd_trl.eval`)."""
    from .eval.grading import CORRECT, INVALID_GOLD, grade_responses

    golds = solution if solution is not None else answer
    if golds is None:
        raise ValueError(
            "The `accuracy` reward grades against the prompts' gold answers, but the dataset has neither a "
            "`solution` nor an `answer` column: add one (with `remove_unused_columns=False`, the default)."
        )
    texts = [final_answer(completion) if isinstance(completion, list) else completion for completion in completions]
    _, statuses = grade_responses(texts, [str(gold) for gold in golds], workers=1)
    return [None if status == INVALID_GOLD else float(status == CORRECT) for status in statuses]


# The reward functions a recipe or the command line names (`reward_funcs: [accuracy]`)
REWARD_FUNCS: dict[str, Callable] = {"accuracy": accuracy_reward}


def resolve_reward_funcs(reward_funcs) -> tuple[list[Callable], list[str]]:
    """The reward functions (callables as `GRPOTrainer` takes them, or names in [`REWARD_FUNCS`]) and their names."""
    if reward_funcs is None:
        return [], []
    funcs = []
    for func in reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]:
        if isinstance(func, str):
            if func not in REWARD_FUNCS:
                raise ValueError(
                    f"Unknown reward function {func!r}: the registered ones are {', '.join(REWARD_FUNCS)}. A reward "
                    "model is not a reward function here; pass a callable that scores completions instead."
                )
            func = REWARD_FUNCS[func]
        elif not callable(func):
            raise TypeError(f"A reward function is a callable or a registered name, got {type(func).__name__}.")
        funcs.append(func)
    return funcs, [get_callable_name(func) for func in funcs]


_loop, _loop_lock = None, threading.Lock()


def _reward_loop():
    """The event loop async reward functions run on: our own, in a daemon thread, as in GRPOTrainer, because
    `asyncio.run` raises inside a running loop (every Jupyter cell). Started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            thread, loop, ready = start_event_loop_in_daemon(name="tvopd-trl-rewards")
            ready.wait()
            atexit.register(shutdown_event_loop_in_daemon, thread, loop)
            _loop = loop
    return _loop


def reward_table(funcs, names, prompts, completions, completion_ids, **columns) -> torch.Tensor:
    """
    The `(B, len(funcs))` float32 rewards of B completions, NaN where a function returned `None` (or NaN): it skips
    that completion. Each function is called as `GRPOTrainer` calls it, `func(prompts=, completions=, completion_ids=,
    **columns)`, with the prompts' other dataset columns and `trainer_state` in `columns`; the async ones run
    concurrently on an event loop of our own, so scoring also works inside a running one (a notebook). A function that
    raises, returns the wrong number of rewards or an infinite one stops the step with an error that names it.
    """
    outputs = []
    for func in funcs:
        try:
            outputs.append(func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
        except Exception as error:
            outputs.append(error)
    pending = [index for index, output in enumerate(outputs) if inspect.isawaitable(output)]
    if pending:

        async def gather():
            return await asyncio.gather(*(outputs[index] for index in pending), return_exceptions=True)

        results = asyncio.run_coroutine_threadsafe(gather(), _reward_loop()).result()
        for index, output in zip(pending, results, strict=True):
            outputs[index] = output

    table = torch.full((len(prompts), len(funcs)), math.nan)
    for index, (rewards, name) in enumerate(zip(outputs, names, strict=True)):
        if isinstance(rewards, BaseException):  # gather returns a cancelled one too
            raise RuntimeError(
                f"The reward function {name!r} raised {type(rewards).__name__}: {rewards}. A completion it cannot "
                "score gets `None` (a skip), not an exception."
            ) from rewards
        rewards = list(rewards)
        if len(rewards) != len(prompts):
            raise ValueError(
                f"The reward function {name!r} returned {len(rewards)} rewards for {len(prompts)} completions: return "
                "one per completion (`None` to skip one)."
            )
        values = [math.nan if reward is None else float(reward) for reward in rewards]
        if any(math.isinf(value) for value in values):
            raise ValueError(f"The reward function {name!r} returned an infinite reward; return `None` to skip one.")
        table[:, index] = torch.tensor(values)
    return table


def group_advantages(table, weights, num_generations, scale_rewards="group"):
    """
    TRL GRPO's sequence advantage (its default `multi_objective_aggregation="sum_then_normalize"`) from the `(N,
    F)` rewards of N completions, each `num_generations` consecutive ones sampled from one prompt.

    The weighted sum over functions skips NaN; a completion that every function skipped is unscorable: it is left
    out of its group's baseline and gets advantage 0. Its group's mean is subtracted, and the result divided by the
    group's standard deviation (`scale_rewards="group"`), the batch's (`"batch"`), or not (`"none"`), plus 1e-4.

    Returns:
        `(advantages, rewards, zero_std, unscorable)`, all `(N,)`: the advantages, the weighted rewards (NaN where
        unscorable), whether the scaling standard deviation is 0, and whether the completion is unscorable.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    unscorable = torch.isnan(table).all(dim=1)
    rewards = (table * weights.to(table.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = math.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), rewards, zero_std, unscorable


class RewardScoringMixin:
    """The task-reward half of [`TVOPDTrainer`]: it reads the trainer's `reward_funcs`, `reward_func_names`,
    `reward_weights`, `args`, `accelerator`, `processing_class`, `state`, `_metrics` and `_tool_completions`."""

    def reward_advantages(self, prompts, batch):
        """The `(B,)` reward advantage of each completion of `batch` (from `generate_completions(prompts)`): the reward
        functions' weighted sum, normalised within each prompt's group of `num_generations` over all processes as TRL
        GRPO does (`tvopd_trl.rewards.group_advantages`). Logs GRPO's reward metrics."""
        completion_ids = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
        ]
        if self._tool_completions is not None:  # with tools, the conversations, as GRPO passes them
            completions = self._tool_completions
        else:
            texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
            conversational = is_conversational(prompts[0])
            completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        columns = {key: [row[key] for row in prompts] for key in prompts[0] if key not in ("prompt", "completion")}
        local = reward_table(
            self.reward_funcs,
            self.reward_func_names,
            [row["prompt"] for row in prompts],
            completions,
            completion_ids,
            trainer_state=self.state,
            **columns,
        )
        table = self.accelerator.gather(local.to(self.accelerator.device))
        advantages, rewards, zero_std, unscorable = group_advantages(
            table, self.reward_weights, self.args.num_generations, self.args.scale_rewards
        )
        metrics = self._metrics["train"]
        for index, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(table[:, index]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(table[:, index]).item())
        metrics["reward"].append(torch.nanmean(rewards).item())
        metrics["reward_std"].append(nanstd(rewards).item())
        metrics["frac_reward_zero_std"].append(zero_std.float().mean().item())
        metrics["rewards/unscorable"].append(unscorable.float().mean().item())
        rows = len(prompts)
        return advantages[self.accelerator.process_index * rows : (self.accelerator.process_index + 1) * rows]
