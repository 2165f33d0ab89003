"""A task reward beside the teacher: TRL GRPO's reward plumbing and group normalisation, the advantage A_t = A_distill_t
+ alpha * A_reward, its metrics, and its errors (docs/method.md, section 9)."""

import asyncio
import math

import pytest
import torch

from tvopd_trl import ADVANTAGE_MODES
from tvopd_trl.rewards import REWARD_FUNCS, accuracy_reward, group_advantages, resolve_reward_funcs, reward_table
from tvopd_trl.testing import tiny_config

from .timeouts import time_limit


def token_sum(completion_ids, **kwargs):
    """A reward every completion gets, that differs between the samples of one prompt."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "tv/scale" in entry]


# ----------------------------------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------------------------------


def test_group_advantages_match_grpo_on_an_enumerated_batch():
    # Two prompts x 3 samples, two reward functions weighted 1 and 0.5; row 4 is skipped by the second function and
    # row 5 by both (unscorable).
    nan = math.nan
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 2.0], [0.0, 0.0], [1.0, nan], [nan, nan]])
    weights = torch.tensor([1.0, 0.5])
    advantages, rewards, zero_std, unscorable = group_advantages(table, weights, 3, "group")
    expected_rewards = [1.0, 1.0, 2.0, 0.0, 1.0, nan]
    torch.testing.assert_close(rewards, torch.tensor(expected_rewards), equal_nan=True)
    assert unscorable.tolist() == [False] * 5 + [True]
    # group 1: mean 4/3, sample std sqrt(1/3); group 2 (rows 3, 4 only): mean 0.5, std sqrt(0.5)
    first = [(r - 4 / 3) / (math.sqrt(1 / 3) + 1e-4) for r in expected_rewards[:3]]
    second = [(r - 0.5) / (math.sqrt(0.5) + 1e-4) for r in expected_rewards[3:5]]
    torch.testing.assert_close(advantages, torch.tensor([*first, *second, 0.0]))
    assert not zero_std.any()

    unscaled, *_ = group_advantages(table, weights, 3, "none")
    torch.testing.assert_close(unscaled, torch.tensor([-1 / 3, -1 / 3, 2 / 3, -0.5, 0.5, 0.0]))
    batch, *_ = group_advantages(table[:4], weights, 2, "batch")
    std = torch.tensor([1.0, 1.0, 2.0, 0.0]).std()
    torch.testing.assert_close(batch, torch.tensor([0.0, 0.0, 1.0, -1.0]) / (std + 1e-4))


def test_a_group_whose_samples_score_alike_has_zero_advantage_and_is_counted():
    advantages, _, zero_std, _ = group_advantages(torch.tensor([[1.0], [1.0], [0.0], [1.0]]), torch.ones(1), 2)
    assert advantages[:2].tolist() == [0.0, 0.0] and zero_std.tolist() == [True, True, False, False]


def test_reward_table_calls_functions_as_grpo_does_and_names_the_one_that_fails():
    seen = {}

    def recording(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(prompts=prompts, answer=answer, state=trainer_state)
        return [None, 2.0]

    async def asynchronous(completions, **kwargs):
        return [0.5, 0.25]

    funcs, names = resolve_reward_funcs([recording, asynchronous])
    assert names == ["recording", "asynchronous"]
    table = reward_table(funcs, names, ["p1", "p2"], ["c1", "c2"], [[1], [2]], answer=["1", "2"], trainer_state="s")
    torch.testing.assert_close(table, torch.tensor([[math.nan, 0.5], [2.0, 0.25]]), equal_nan=True)
    assert seen == {"prompts": ["p1", "p2"], "answer": ["1", "2"], "state": "s"}

    def raising(**kwargs):
        raise KeyError("solution")

    with pytest.raises(RuntimeError, match="reward function 'raising' raised KeyError"):
        reward_table([raising], ["raising"], ["p"], ["c"], [[1]])
    with pytest.raises(ValueError, match="'short' returned 1 rewards for 2 completions"):
        reward_table([lambda **kwargs: [1.0]], ["short"], ["p", "q"], ["c", "d"], [[1], [2]])
    with pytest.raises(ValueError, match="'inf' returned an infinite reward"):
        reward_table([lambda **kwargs: [math.inf]], ["inf"], ["p"], ["c"], [[1]])
    with pytest.raises(ValueError, match="Unknown reward function 'accurac'.*accuracy"):
        resolve_reward_funcs("accurac")
    with pytest.raises(TypeError, match="callable or a registered name"):
        resolve_reward_funcs([3])


def test_async_reward_functions_run_concurrently_inside_a_running_event_loop():
    # A Jupyter cell runs in an event loop, where `asyncio.run` raises; GRPOTrainer runs them on a loop of its own.
    # Each function waits until all three have started: run one after the other, the first would wait in vain.
    started, all_started = [], asyncio.Event()

    def scaled(factor):
        async def reward(completion_ids, **kwargs):
            started.append(factor)
            if len(started) == 3:
                all_started.set()
            await asyncio.wait_for(all_started.wait(), timeout=time_limit(30))
            return [factor * len(ids) for ids in completion_ids]

        reward.__name__ = f"times_{factor}"
        return reward

    async def failing(**kwargs):
        await asyncio.sleep(0)
        raise KeyError("solution")

    def score(funcs):
        return reward_table(funcs, [func.__name__ for func in funcs], ["p1", "p2"], ["c1", "c2"], [[1, 2], [3]])

    async def notebook_cell():
        table = score([scaled(1.0), token_sum, scaled(2.0), scaled(0.5)])
        with pytest.raises(RuntimeError, match="reward function 'failing' raised KeyError"):
            score([token_sum, failing])
        return table

    table = asyncio.run(notebook_cell())
    torch.testing.assert_close(table, torch.tensor([[2.0, 3.0, 4.0, 1.0], [1.0, 3.0, 2.0, 0.5]]))


def test_accuracy_reward_grades_with_math_verify_against_the_solution_or_answer_column():
    completions = [
        [{"role": "assistant", "content": text}] for text in ("\\boxed{133}", "\\boxed{0.5}", "133", "\\boxed{1}")
    ]
    assert REWARD_FUNCS["accuracy"] is accuracy_reward
    assert accuracy_reward(completions, answer=["133", "1/2", "133", "}{"]) == [1.0, 1.0, 0.0, None]
    assert accuracy_reward(["\\boxed{7}"], solution=["7"], answer=["8"]) == [1.0]
    with pytest.raises(ValueError, match="neither a `solution` nor an `answer` column"):
        accuracy_reward(completions)


def test_config_refuses_reward_settings_that_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="set num_generations >= 2"):
        tiny_config(tmp_path, reward_coef=0.5)
    with pytest.raises(ValueError, match="not both 0"):
        tiny_config(tmp_path, distillation_coef=0.0)
    with pytest.raises(ValueError, match="scale the reward term by c_k"):
        tiny_config(tmp_path, reward_coef=1.0, num_generations=2, tv_scale_target="learning_rate")
    with pytest.raises(ValueError, match="scale_rewards"):
        tiny_config(tmp_path, scale_rewards="std")


# ----------------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------------


def test_trainer_refuses_a_reward_it_cannot_compute(make_trainer, tmp_path):
    with pytest.raises(ValueError, match="no reward function is set"):
        make_trainer(tiny_config(tmp_path, reward_coef=1.0, num_generations=2))
    with pytest.raises(ValueError, match="reward_weights has 2 weights for 1 reward functions"):
        make_trainer(tiny_config(tmp_path, reward_funcs=["accuracy"], reward_weights=[1.0, 2.0]))
    with pytest.raises(ValueError, match="num_generations=3 does not divide the rollout batch of 4"):
        make_trainer(tiny_config(tmp_path, num_generations=3))


def test_samples_of_a_prompt_are_consecutive_groups(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, per_device_train_batch_size=8, num_generations=4))
    rows = next(iter(trainer.get_train_dataloader()))
    prompts = [row["answer"] + str(row["prompt"]) for row in rows]
    assert len(rows) == 8 and prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4
    assert prompts[0] != prompts[4]


def test_reward_coef_zero_trains_bit_for_bit_as_without_rewards(make_trainer, tmp_path):
    runs = {}
    for name, extra in {"none": {}, "logged": {"reward_funcs": ["accuracy"]}}.items():
        trainer = make_trainer(tiny_config(tmp_path / name, max_steps=3, **extra))
        trainer.train()
        runs[name] = (trainer, parameters(trainer.model))
    (plain, plain_params), (logged, logged_params) = runs["none"], runs["logged"]
    assert all(torch.equal(plain_params[name], logged_params[name]) for name in plain_params)
    assert [e["loss"] for e in step_logs(plain)] == [e["loss"] for e in step_logs(logged)]
    assert all("rewards/accuracy_reward/mean" in entry and "reward" in entry for entry in step_logs(logged))
    assert all(entry["advantage/reward_abs_mean"] == 0 for entry in step_logs(logged))


def test_the_advantage_is_the_distillation_term_plus_alpha_times_the_group_normalised_reward(make_trainer, tmp_path):
    alpha, coef = 0.7, 0.5
    args = tiny_config(
        tmp_path,
        advantage_mode="raw",
        per_device_train_batch_size=8,
        num_generations=4,
        reward_coef=alpha,
        distillation_coef=coef,
        max_completion_length=12,
    )
    trainer = make_trainer(args, reward_funcs=[token_sum])
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    # The reward advantage, from the rows' own tokens and groups (rows are shuffled: a group is its prompt)
    rewards = torch.tensor(
        [
            float(ids[mask.bool()].sum() % 7)
            for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"], strict=True)
        ]
    )
    groups = [tuple(row.tolist()) for row in inputs["prompt_ids"]]
    expected = torch.empty(8)
    for group in set(groups):
        rows = torch.tensor([g == group for g in groups])
        expected[rows] = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + 1e-4)
    torch.testing.assert_close(inputs["reward_advantages"], expected)
    assert expected.abs().sum() > 1

    loss = trainer.compute_loss(trainer.model, inputs)
    mask = inputs["completion_mask"].bool()
    delta = inputs["teacher_logps"] - trainer._sampled_token_logps(
        trainer.model,
        torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        inputs["completion_ids"].size(1),
    )
    advantage = torch.where(mask, coef * delta + alpha * expected.unsqueeze(1), 0.0)
    torch.testing.assert_close(loss, -advantage.sum() / mask.sum(), rtol=1e-5, atol=1e-6)  # ratio 1


def test_a_teacher_identical_to_the_student_leaves_only_the_reward_term(make_trainer, model_dirs, tmp_path):
    """The first step against a copy of the student updates it exactly as the reward alone does (`distillation_coef=0`,
    with another teacher): same rollout, delta = 0 on every token."""
    updates = {}
    for name, teacher, coef in (("copy", model_dirs["student"], 1.0), ("reward_only", model_dirs["teacher"], 0.0)):
        args = tiny_config(
            tmp_path / name,
            per_device_train_batch_size=8,
            num_generations=4,
            reward_coef=1.0,
            distillation_coef=coef,
            max_steps=1,
        )
        trainer = make_trainer(args, teacher_model=teacher, reward_funcs=[token_sum])
        trainer.train()
        updates[name] = (step_logs(trainer)[0], parameters(trainer.model))
    (entry, copy_params), (_, reward_params) = updates["copy"], updates["reward_only"]
    assert entry["tv/estimate"] == 0 and entry["advantage/distill_abs_mean"] == 0
    # NaN averaged over the logging window, which TRL logs as None
    assert entry["advantage/reward_abs_mean"] > 0 and entry["advantage/reward_to_distill"] is None
    assert entry["rewards/token_sum/std"] > 0 and entry["update/norm"] > 0
    assert all(torch.equal(copy_params[name], reward_params[name]) for name in copy_params)


def test_reward_metrics_use_grpo_names_and_unscorable_completions_are_skipped_and_counted(make_trainer, tmp_path):
    def skip_all(completions, **kwargs):
        return [None] * len(completions)

    args = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        num_generations=4,
        reward_coef=1.0,
        max_steps=1,
        reward_weights=[1.0, 2.0],
    )
    trainer = make_trainer(args, reward_funcs=[token_sum, skip_all])
    trainer.train()
    (entry,) = step_logs(trainer)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/token_sum/mean"):
        assert math.isfinite(entry[name]), name
    assert entry["rewards/skip_all/mean"] is None and entry["rewards/unscorable"] == 0

    trainer = make_trainer(tiny_config(tmp_path / "skip", num_generations=2, reward_coef=1.0, max_steps=1),
                           reward_funcs=[skip_all])  # fmt: skip
    trainer.train()
    (entry,) = step_logs(trainer)
    assert entry["rewards/unscorable"] == 1 and entry["advantage/reward_abs_mean"] == 0


def test_a_reward_function_that_raises_stops_training_with_its_name(make_trainer, tmp_path):
    def broken(completions, **kwargs):
        raise ZeroDivisionError("division by zero")

    trainer = make_trainer(tiny_config(tmp_path, num_generations=2, reward_coef=1.0), reward_funcs=[broken])
    before = parameters(trainer.model)
    with pytest.raises(RuntimeError, match="reward function 'broken' raised ZeroDivisionError"):
        trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_every_mode_takes_the_reward_term(make_trainer, mode, tmp_path):
    args = tiny_config(tmp_path, advantage_mode=mode, num_generations=2, reward_coef=1.0, max_steps=1)
    trainer = make_trainer(args, reward_funcs=[token_sum])
    trainer.train()
    (entry,) = step_logs(trainer)
    assert math.isfinite(entry["loss"]) and entry["advantage/reward_abs_mean"] >= 0
    assert math.isfinite(entry["rewards/token_sum/mean"]) and entry["update/norm"] > 0


def test_with_several_teachers_every_teachers_rows_get_the_same_reward_term(
    make_trainer, model_dirs, prompts, tmp_path
):
    names = ["a", "b"] * (len(prompts) // 2)  # a prompt's 4 samples share its teacher
    dataset = prompts.add_column("teacher_id", names)
    args = tiny_config(
        tmp_path, per_device_train_batch_size=8, num_generations=4, reward_coef=1.0, max_steps=1, shuffle_dataset=False
    )
    trainer = make_trainer(
        args,
        teacher_model={"a": model_dirs["teacher"], "b": model_dirs["student"]},
        train_dataset=dataset,
        reward_funcs=[token_sum],
    )
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert set(inputs["teacher_index"].tolist()) == {0, 1}
    rewards = torch.tensor(
        [
            float(ids[mask.bool()].sum() % 7)
            for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"], strict=True)
        ]
    )
    for teacher in (
        0,
        1,
    ):  # each teacher's rows are one group here; its advantage is its group's, whatever the teacher
        rows = inputs["teacher_index"] == teacher
        expected = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + 1e-4)
        torch.testing.assert_close(inputs["reward_advantages"][rows], expected)
    trainer.train()
    (entry,) = [entry for entry in trainer.state.log_history if "tv/a/scale" in entry]
    assert "tv/a/scale" in entry and "tv/b/scale" in entry and entry["advantage/reward_abs_mean"] > 0
