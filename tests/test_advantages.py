"""Tests for the per-token advantage coefficients of every mode (the table of docs/modes.md, and docs/method.md
section 7 for non-finite tokens).

Each mode is checked against a formula written here with loops over python floats, independent of the library.
"""

import dataclasses
import inspect
import math

import pytest
import torch

from tvopd_trl import TVOPDConfig
from tvopd_trl.advantages import (
    ADVANTAGE_MODE_REGISTRY,
    ADVANTAGE_MODES,
    LOG_FLOAT32_TINY,
    compute_advantages,
    default_sign_tolerance,
)


INF = math.inf
NAN = math.nan
TINY_LOG = math.log(2.0**-126)  # log of the smallest normal float32, computed independently

SCALE = 0.37
CLIP_LOW, CLIP_HIGH = -0.75, 0.75
GAMMA = 0.5
BETA = 0.5
FORMULA_MODES = [mode for mode in ADVANTAGE_MODES if mode != "shuffle"]
MAGNITUDE_MODES = ["relative_power", "sequence_constant", "shuffle", "sign_mass_raw_alloc"]


# --------------------------------------------------------------------------------------------------------------------
# Batches. All values are dyadic, so float32 holds them and their differences exactly.
# --------------------------------------------------------------------------------------------------------------------


def main_batch():
    """B = 3, T = 6.

    Row 0: mixed signs, a tie (delta = 0), padding at the end (with a nonzero delta under the mask).
        delta = [0.5, 0, -1, 1, -2.25 | -0.5]
    Row 1: every active delta is 0 (S = 0); a masked token carries a nonzero delta.
    Row 2: fully masked, nonzero deltas.
    """
    teacher = torch.tensor(
        [
            [-1.0, -0.5, -2.0, -0.25, -3.0, -1.0],
            [-0.5, -1.0, -2.0, -0.25, -1.0, -4.0],
            [-1.0, -2.0, -3.0, -0.5, -0.25, -2.0],
        ]
    )
    old = torch.tensor(
        [
            [-1.5, -0.5, -1.0, -1.25, -0.75, -0.5],
            [-0.5, -1.0, -2.0, -0.25, -0.125, -4.0],
            [-2.0, -1.0, -0.5, -3.0, -1.0, -0.125],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    reverse_kl = torch.tensor(
        [
            [0.125, 0.25, 0.0625, 0.5, 0.375, 9.0],
            [0.25, 0.25, 0.25, 0.25, 0.25, 0.25],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    return teacher, old, mask, reverse_kl


def no_tie_batch():
    """B = 2, T = 6, distinct nonzero magnitudes in each row, mixed signs, one padded token."""
    delta = torch.tensor(
        [
            [0.5, -1.5, 0.25, -2.0, 3.0, -7.0],
            [-0.125, 0.75, -0.375, 1.25, -0.625, 1.75],
        ]
    )
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -4.0, -0.25], [-0.5, -1.5, -1.0, -2.5, -0.75, -2.0]])
    teacher = old + delta
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    reverse_kl = torch.full((2, 6), 0.5)
    return teacher, old, mask, reverse_kl


def neg_inf_batch():
    """B = 2, T = 4: the teacher gives active tokens no mass (delta = -inf), next to finite deltas."""
    teacher = torch.tensor([[-INF, -1.0, -0.5, -INF], [-0.5, -INF, -3.0, -1.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.25], [-1.0, -0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    reverse_kl = torch.full((2, 4), 0.25)
    return teacher, old, mask, reverse_kl


BATCHES = {"main": main_batch, "no_tie": no_tie_batch, "neg_inf": neg_inf_batch}


def mode_kwargs(mode, reverse_kl, **overrides):
    """The test value of every input the mode's registry entry takes and of every hyperparameter it requires."""
    values = {
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "gamma": GAMMA,
        "beta": BETA,
        "scale": SCALE,
        "reverse_kl": reverse_kl,
        "generator": torch.Generator().manual_seed(0),
    }
    spec = ADVANTAGE_MODE_REGISTRY[mode]
    kwargs = {name: values[name] for name in (*spec.inputs, *spec.required) if name in values}
    return {**kwargs, **overrides}


def advantages(mode, teacher, old, mask, reverse_kl=None, **overrides):
    return compute_advantages(
        mode, teacher_logps=teacher, old_logps=old, mask=mask, **mode_kwargs(mode, reverse_kl, **overrides)
    )


# --------------------------------------------------------------------------------------------------------------------
# Independent reference formulas (docs/modes.md), python floats
# --------------------------------------------------------------------------------------------------------------------


def sign(x):
    return (x > 0) - (x < 0)


def reference_row(
    mode, teacher, old, mask, reverse_kl, *, scale=1.0, clip_low=None, clip_high=None, gamma=None, beta=None
):
    """Coefficients of one sequence. Inputs are lists of python floats; mask a list of 0/1."""
    size = len(teacher)
    delta = [t - o for t, o in zip(teacher, old, strict=True)]
    active = [bool(w) and not math.isnan(d) and d != INF for w, d in zip(mask, delta, strict=True)]
    floor = TINY_LOG if clip_low is None else clip_low
    finite = [floor if d == -INF else d for d in delta]
    z = [sign(d) if a else 0 for d, a in zip(delta, active, strict=True)]
    m = [abs(f) if a else 0.0 for f, a in zip(finite, active, strict=True)]
    count = sum(active)
    s = sum(m) / count if count else 0.0

    out = [0.0] * size
    for i in range(size):
        if not active[i]:
            continue
        if mode == "raw":
            out[i] = finite[i]
        elif mode == "clip":
            out[i] = min(max(delta[i], clip_low), clip_high)
        elif mode == "power":
            out[i] = math.exp(gamma * teacher[i]) - math.exp(gamma * old[i])
        elif mode == "vopd":
            out[i] = finite[i] + reverse_kl[i]
        elif mode == "sign":
            out[i] = float(z[i])
        elif mode == "tv":
            out[i] = scale * z[i]
        elif mode == "relative_power":
            if s > 0:
                powered = [(m[j] / s) ** beta for j in range(size) if active[j]]
                mean_powered = sum(powered) / len(powered)
                out[i] = z[i] * s * (m[i] / s) ** beta / mean_powered
        elif mode == "sequence_constant":
            out[i] = z[i] * s
        elif mode == "sign_mass_raw_alloc":
            if z[i] != 0:
                group = [m[j] for j in range(size) if active[j] and z[j] == z[i]]
                out[i] = z[i] * m[i] / (sum(group) / len(group))
        else:
            raise AssertionError(mode)
    return out


def reference(mode, teacher, old, mask, reverse_kl, **kwargs):
    teacher, old, mask, reverse_kl = (
        x.double().tolist() for x in (teacher.float(), old.float(), mask, reverse_kl.float())
    )
    return torch.tensor(
        [reference_row(mode, t, o, w, r, **kwargs) for t, o, w, r in zip(teacher, old, mask, reverse_kl, strict=True)],
        dtype=torch.float64,
    )


def reference_kwargs(mode, **overrides):
    kwargs = {
        "clip": {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH},
        "power": {"gamma": GAMMA},
        "tv": {"scale": SCALE},
        "relative_power": {"beta": BETA},
    }.get(mode, {})
    return {**kwargs, **overrides}


def assert_matches(actual, expected):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=1e-6)


def active_mask(teacher, old, mask):
    delta = teacher.double() - old.double()
    return mask.bool() & ~torch.isnan(delta) & ~torch.isposinf(delta)


# --------------------------------------------------------------------------------------------------------------------
# Every mode against its formula
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mode", FORMULA_MODES)
def test_mode_matches_reference_formula(mode, batch):
    teacher, old, mask, reverse_kl = BATCHES[batch]()
    actual = advantages(mode, teacher, old, mask, reverse_kl)
    expected = reference(mode, teacher, old, mask, reverse_kl, **reference_kwargs(mode))
    assert_matches(actual, expected)
    assert torch.all(actual[~mask.bool()] == 0)


@pytest.mark.parametrize("mode", FORMULA_MODES)
def test_mode_reference_with_clip_low_floor(mode):
    # Every mode that uses |delta| replaces delta = -inf by clip_low when it is set; power, sign and tv ignore it.
    teacher, old, mask, reverse_kl = neg_inf_batch()
    overrides = {"clip_low": -5.0}
    actual = advantages(mode, teacher, old, mask, reverse_kl, **overrides)
    expected = reference(mode, teacher, old, mask, reverse_kl, **reference_kwargs(mode, **overrides))
    assert_matches(actual, expected)


def test_main_batch_hand_values():
    # Spot values written out by hand for row 0 (delta = [0.5, 0, -1, 1, -2.25 | pad]), m sums to 4.75, S = 0.95.
    teacher, old, mask, reverse_kl = main_batch()
    zeros = [0.0] * 6
    expected = {
        "raw": [0.5, 0.0, -1.0, 1.0, -2.25, 0.0],
        "clip": [0.5, 0.0, -0.75, 0.75, -0.75, 0.0],
        "sign": [1.0, 0.0, -1.0, 1.0, -1.0, 0.0],
        "tv": [SCALE, 0.0, -SCALE, SCALE, -SCALE, 0.0],
        "vopd": [0.625, 0.25, -0.9375, 1.5, -1.875, 0.0],
        "sequence_constant": [0.95, 0.0, -0.95, 0.95, -0.95, 0.0],
        # positive group {0.5, 1} has mean 0.75; negative group {1, 2.25} has mean 1.625
        "sign_mass_raw_alloc": [0.5 / 0.75, 0.0, -1.0 / 1.625, 1.0 / 0.75, -2.25 / 1.625, 0.0],
    }
    for mode, row0 in expected.items():
        # Row 1 has all deltas 0: only vopd is nonzero there (delta + RKL = RKL on its 4 active tokens).
        row1 = [0.25, 0.25, 0.25, 0.25, 0.0, 0.0] if mode == "vopd" else zeros
        actual = advantages(mode, teacher, old, mask, reverse_kl)
        assert_matches(actual, torch.tensor([row0, row1, zeros], dtype=torch.float64))


def test_vopd_requires_reverse_kl():
    teacher, old, mask, _ = main_batch()
    with pytest.raises(ValueError, match="reverse_kl"):
        compute_advantages("vopd", teacher_logps=teacher, old_logps=old, mask=mask)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_power_is_bounded_and_sign_preserving(batch):
    teacher, old, mask, _ = BATCHES[batch]()
    for gamma in (0.25, 0.5, 1.0, 2.0):
        actual = compute_advantages("power", teacher_logps=teacher, old_logps=old, mask=mask, gamma=gamma)
        assert torch.all(actual.abs() <= 1.0)
        active = active_mask(teacher, old, mask)
        delta = teacher.double() - old.double()
        assert torch.equal(torch.sign(actual[active]).double(), torch.sign(delta[active]))
        assert torch.all(actual[~active] == 0)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_relative_power_endpoints(batch):
    # beta = 1 reproduces raw, beta = 0 reproduces sequence_constant.
    teacher, old, mask, _ = BATCHES[batch]()
    kwargs = dict(teacher_logps=teacher, old_logps=old, mask=mask)
    raw = compute_advantages("raw", **kwargs)
    constant = compute_advantages("sequence_constant", **kwargs)
    beta_one = compute_advantages("relative_power", beta=1.0, **kwargs)
    beta_zero = compute_advantages("relative_power", beta=0.0, **kwargs)
    # R / mean(R) is 1 per token up to float32 rounding of m / S and of the mean: a couple of ulps.
    torch.testing.assert_close(beta_one, raw, rtol=3e-7, atol=0.0)
    torch.testing.assert_close(beta_zero, constant, rtol=0.0, atol=0.0)


def test_zero_magnitude_row_gives_zero_in_magnitude_modes():
    teacher, old, mask, _ = main_batch()
    for mode in MAGNITUDE_MODES:
        for beta in (0.0, 0.5, 1.0):
            actual = (
                advantages(mode, teacher, old, mask, beta=beta)
                if mode == "relative_power"
                else advantages(mode, teacher, old, mask)
            )
            assert torch.all(actual[1] == 0), mode
            assert torch.all(actual[2] == 0), mode
            assert torch.all(torch.isfinite(actual)), mode


@pytest.mark.parametrize("batch", list(BATCHES))
def test_sign_mass_raw_alloc_keeps_group_mass(batch):
    teacher, old, mask, _ = BATCHES[batch]()
    actual = compute_advantages("sign_mass_raw_alloc", teacher_logps=teacher, old_logps=old, mask=mask).double()
    active = active_mask(teacher, old, mask)
    delta = teacher.double() - old.double()
    for row in range(actual.size(0)):
        for group_sign in (1.0, -1.0):
            group = active[row] & (torch.sign(delta[row]) == group_sign)
            assert actual[row][group].abs().sum().item() == pytest.approx(group.sum().item(), rel=1e-6)
            assert torch.all(torch.sign(actual[row][group]) == group_sign)


# --------------------------------------------------------------------------------------------------------------------
# Shuffle
# --------------------------------------------------------------------------------------------------------------------


def shuffle(teacher, old, mask, seed):
    generator = torch.Generator().manual_seed(seed)
    return compute_advantages("shuffle", teacher_logps=teacher, old_logps=old, mask=mask, generator=generator)


def row_stats(teacher_row, old_row, mask_row):
    delta = [t - o for t, o in zip(teacher_row, old_row, strict=True)]
    active = [bool(w) for w in mask_row]
    m = [abs(d) for d, a in zip(delta, active, strict=True) if a]
    s = sum(m) / len(m)
    return delta, active, m, s


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_shuffle_permutes_relative_magnitudes_within_sequence(seed):
    teacher, old, mask, _ = no_tie_batch()
    actual = shuffle(teacher, old, mask, seed)
    assert actual.dtype == torch.float32
    for row in range(teacher.size(0)):
        delta, active, m, s = row_stats(teacher[row].tolist(), old[row].tolist(), mask[row].tolist())
        values = [a for a, on in zip(actual[row].tolist(), active, strict=True) if on]
        r = sorted(mi / s for mi in m)
        assert sorted(abs(v) / s for v in values) == pytest.approx(r, rel=1e-6)
        signs = [sign(d) for d, on in zip(delta, active, strict=True) if on]
        assert [sign(v) for v in values] == signs
        assert sum(abs(v) for v in values) == pytest.approx(sum(m), rel=1e-6)
        assert all(a == 0.0 for a, on in zip(actual[row].tolist(), active, strict=True) if not on)


def test_shuffle_with_ties_follows_the_formula():
    # A tie has z = 0, so A = z * S * R_pi(t) is 0 there whatever R lands on it; every other token gets S times a
    # distinct entry of the row's R multiset.
    teacher, old, mask, _ = main_batch()
    for seed in range(5):
        actual = shuffle(teacher, old, mask, seed)
        delta, active, m, s = row_stats(teacher[0].tolist(), old[0].tolist(), mask[0].tolist())
        remaining = [mi / s for mi in m]
        for a, d, on in zip(actual[0].tolist(), delta, active, strict=True):
            if not on or d == 0:
                assert a == 0.0
                continue
            assert sign(a) in (sign(d), 0)
            match = min(remaining, key=lambda r: abs(r - abs(a) / s))
            assert abs(a) / s == pytest.approx(match, rel=1e-6, abs=1e-7)
            remaining.remove(match)
        assert torch.all(actual[1:] == 0)


def test_shuffle_is_reproducible_and_seed_dependent():
    teacher, old, mask, _ = no_tie_batch()
    first = shuffle(teacher, old, mask, 0)
    assert torch.equal(first, shuffle(teacher, old, mask, 0))
    others = [shuffle(teacher, old, mask, seed) for seed in range(1, 9)]
    assert any(not torch.equal(first, other) for other in others)


# --------------------------------------------------------------------------------------------------------------------
# Non-finite tokens (docs/method.md, section 7)
# --------------------------------------------------------------------------------------------------------------------


def corrupt(teacher, old, row, col, how):
    teacher, old = teacher.clone(), old.clone()
    if how == "nan_teacher":
        teacher[row, col] = NAN
    elif how == "nan_old":
        old[row, col] = NAN
    elif how == "pos_inf_delta":  # the rollout policy gave its own sample no mass
        old[row, col] = -INF
    return teacher, old


@pytest.mark.parametrize("how", ["nan_teacher", "nan_old", "pos_inf_delta"])
@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_nonfinite_token_is_dropped_like_a_masked_token(mode, how):
    # Token (0, 2) has delta = -1: dropping it changes S, R, the groups and the shuffle length of row 0 if it leaks.
    for make in (main_batch, no_tie_batch):
        teacher, old, mask, reverse_kl = make()
        bad_teacher, bad_old = corrupt(teacher, old, 0, 2, how)
        actual = advantages(mode, bad_teacher, bad_old, mask, reverse_kl)

        masked = mask.clone()
        masked[0, 2] = 0
        expected = advantages(mode, teacher, old, masked, reverse_kl)

        assert actual[0, 2] == 0.0
        assert torch.all(torch.isfinite(actual))
        assert torch.equal(actual, expected)


def test_log_float32_tiny_constant():
    assert LOG_FLOAT32_TINY == pytest.approx(TINY_LOG, rel=1e-7)
    assert LOG_FLOAT32_TINY == pytest.approx(-87.3365, abs=1e-4)


def test_neg_inf_delta_in_sign_tv_and_raw():
    teacher = torch.tensor([[-INF, -1.0, -0.5]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.ones(1, 3)
    kwargs = dict(teacher_logps=teacher, old_logps=old, mask=mask)

    assert compute_advantages("sign", **kwargs).tolist() == [[-1.0, 1.0, 0.0]]
    tv = compute_advantages("tv", scale=SCALE, **kwargs)
    assert_matches(tv, torch.tensor([[-SCALE, SCALE, 0.0]], dtype=torch.float64))

    raw = compute_advantages("raw", **kwargs)
    assert raw[0, 0].item() == LOG_FLOAT32_TINY
    assert raw[0, 0].item() == pytest.approx(TINY_LOG, rel=1e-7)
    assert raw[0, 1:].tolist() == [1.0, 0.0]

    raw_floored = compute_advantages("raw", clip_low=-5.0, **kwargs)
    assert raw_floored.tolist() == [[-5.0, 1.0, 0.0]]
    assert torch.all(torch.isfinite(raw)) and torch.all(torch.isfinite(raw_floored))


# --------------------------------------------------------------------------------------------------------------------
# Detached float32 outputs
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_outputs_are_detached_float32(mode, dtype):
    teacher, old, mask, reverse_kl = main_batch()
    teacher, old, reverse_kl = (x.to(dtype).requires_grad_(True) for x in (teacher, old, reverse_kl))
    actual = advantages(mode, teacher, old, mask, reverse_kl)
    assert actual.dtype == torch.float32
    assert actual.shape == (3, 6)
    assert not actual.requires_grad
    assert actual.grad_fn is None


# --------------------------------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------------------------------


def test_unknown_mode_lists_valid_modes():
    teacher, old, mask, _ = main_batch()
    with pytest.raises(ValueError) as info:
        compute_advantages("bogus_mode", teacher_logps=teacher, old_logps=old, mask=mask)
    message = str(info.value)
    assert "bogus_mode" in message
    for mode in ADVANTAGE_MODES:
        assert mode in message


@pytest.mark.parametrize(
    "mode,kwargs,missing",
    [
        ("clip", {"clip_high": 1.0}, "clip_low"),
        ("clip", {"clip_low": -1.0}, "clip_high"),
        ("clip", {}, "clip_"),
        ("power", {}, "gamma"),
        ("relative_power", {}, "beta"),
        ("vopd", {}, "reverse_kl"),
    ],
)
def test_missing_parameter_is_named(mode, kwargs, missing):
    teacher, old, mask, _ = main_batch()
    with pytest.raises(ValueError, match=missing):
        compute_advantages(mode, teacher_logps=teacher, old_logps=old, mask=mask, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# The registry: an entry is all a new mode needs, so every entry must be complete
# --------------------------------------------------------------------------------------------------------------------

TRAINER_INPUTS = {"teacher_logps", "old_logps", "reverse_kl", "scale", "generator"}


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_registry_entry_is_complete(mode):
    spec = ADVANTAGE_MODE_REGISTRY[mode]
    parameters = inspect.signature(spec.function).parameters
    assert list(parameters)[:2] == ["delta", "active"], "a mode function takes (delta, active, *, ...)"
    keywords = {name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == set(spec.inputs) | set(spec.hyperparameters), "declare every keyword, and only those"
    assert set(spec.inputs) <= TRAINER_INPUTS, "the trainer supplies only these"
    assert set(spec.ranges) <= set(spec.hyperparameters), "a range belongs to a declared hyperparameter"
    fields = {f.name for f in dataclasses.fields(TVOPDConfig)}
    for keyword, name in spec.hyperparameters.items():
        if name is None:
            assert keyword not in spec.required, f"{keyword}: set through advantage_kwargs, so it needs a default"
        else:
            assert name in fields and f"        {name} (" in TVOPDConfig.__doc__, f"{name}: a documented config field"
    assert spec.paper
    # A config of the mode builds with its defaults, and the trainer's keywords for it are the declared fields
    args = TVOPDConfig(output_dir="unused", advantage_mode=mode, use_cpu=True, bf16=False, report_to="none")
    assert set(spec.config_kwargs(args)) == {keyword for keyword, name in spec.hyperparameters.items() if name}


def damped_sign_advantage(delta, active, *, damping=0.5):
    return damping * torch.where(active, torch.sign(delta), 0.0)


@pytest.fixture
def damped_sign_mode(monkeypatch):
    """A mode added the way CONTRIBUTING says: one registry entry, with a hyperparameter that has no config field."""
    from tvopd_trl.advantages import AdvantageMode

    spec = AdvantageMode(
        damped_sign_advantage,
        "Damped Sign",
        {"damping": None},
        ranges={"damping": (lambda d: 0 < d <= 1, "in (0, 1]")},
    )
    monkeypatch.setitem(ADVANTAGE_MODE_REGISTRY, "damped_sign", spec)
    return spec


def test_a_new_mode_is_one_registry_entry(damped_sign_mode, make_trainer, tmp_path):
    from tvopd_trl.model_card import card_section
    from tvopd_trl.testing import tiny_config

    teacher, old = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-2.0, -1.0, -0.5]])
    kwargs = dict(teacher_logps=teacher, old_logps=old, mask=torch.ones(1, 3))
    assert compute_advantages("damped_sign", **kwargs).tolist() == [[0.5, -0.5, 0.0]]  # the function's default
    assert compute_advantages("damped_sign", damping=0.25, **kwargs).tolist() == [[0.25, -0.25, 0.0]]

    # The config validates the new hyperparameter from the entry alone: its key, its range, the JSON a flag gives
    args = tiny_config(tmp_path, advantage_mode="damped_sign", advantage_kwargs='{"damping": 0.25}', max_steps=2)
    assert args.advantage_kwargs == {"damping": 0.25}
    assert damped_sign_mode.config_kwargs(args) == {"damping": 0.25}
    with pytest.raises(ValueError, match=r"advantage_kwargs\['damping'\] in \(0, 1\], got 2"):
        tiny_config(tmp_path, advantage_mode="damped_sign", advantage_kwargs={"damping": 2})
    with pytest.raises(ValueError, match=r"\['dampnig'\], which advantage_mode='damped_sign' does not take"):
        tiny_config(tmp_path, advantage_mode="damped_sign", advantage_kwargs={"dampnig": 0.25})
    with pytest.raises(ValueError, match="power_gamma"):
        tiny_config(tmp_path, advantage_mode="power", advantage_kwargs={"gamma": 0.25})
    assert "`advantage_kwargs['damping']=0.25`" in card_section(args, [])

    # The trainer trains on its coefficients: one plain-SGD step moves every weight by 0.25 times Sign's step on the
    # same rollout
    def one_step(mode, **overrides):
        step_args = tiny_config(
            tmp_path / mode, advantage_mode=mode, max_steps=1, optim="sgd", max_grad_norm=0, **overrides
        )
        trainer = make_trainer(step_args)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        return torch.cat([(p.detach() - b).flatten() for b, p in zip(before, trainer.model.parameters(), strict=True)])

    damped, sign = one_step("damped_sign", advantage_kwargs={"damping": 0.25}), one_step("sign")
    assert sign.abs().max() > 0
    torch.testing.assert_close(damped, 0.25 * sign, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------------
# The sign tolerance: |delta| at or below it is a tie, read as delta = 0 by the sign-based modes
# --------------------------------------------------------------------------------------------------------------------

SIGN_BASED = ["sign", "tv", "relative_power", "sequence_constant", "shuffle", "sign_mass_raw_alloc"]
TOLERANCE = 2.0**-10


def rounding_batch():
    """B = 2, T = 6: deltas of rounding size (2^-20), at the tolerance (2^-10, a tie: "at or below"), above it and
    large, of both signs; one padded token. Dyadic, so float32 holds every delta exactly."""
    delta = torch.tensor(
        [
            [2.0**-20, -(2.0**-20), TOLERANCE, -TOLERANCE, 0.5, -1.5],
            [2.0**-9, -(2.0**-20), 0.25, -0.75, 2.0**-20, 3.0],
        ]
    )
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -4.0, -0.25], [-0.5, -1.5, -1.0, -2.5, -0.75, -2.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    return old + delta, old, mask, torch.full((2, 6), 0.5)


def test_the_sign_based_modes_are_the_ones_that_read_the_sign():
    assert [mode for mode, spec in ADVANTAGE_MODE_REGISTRY.items() if spec.sign_based] == SIGN_BASED


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_a_sign_based_mode_reads_a_tie_as_delta_0_and_the_others_ignore_the_tolerance(mode):
    teacher, old, mask, reverse_kl = rounding_batch()
    delta = teacher - old
    tied = (delta.abs() <= TOLERANCE) & mask.bool()
    assert tied.tolist() == [[True, True, True, True, False, False], [False, True, False, False, True, False]]
    with_tolerance = advantages(mode, teacher, old, mask, reverse_kl, sign_tolerance=TOLERANCE)
    if mode in SIGN_BASED:
        # Exactly the mode on the same batch with the ties' teacher log-probabilities set to pi_old's
        expected = advantages(mode, torch.where(tied, old, teacher), old, mask, reverse_kl)
        assert (with_tolerance[tied] == 0).all()
        if mode != "shuffle":  # which permutes a tie's magnitude 0 onto another token
            assert (with_tolerance[mask.bool() & ~tied] != 0).all()
    else:
        expected = advantages(mode, teacher, old, mask, reverse_kl)
    assert torch.equal(with_tolerance, expected)


def test_tv_advantages_with_and_without_the_tolerance_by_hand():
    teacher, old, mask, _ = rounding_batch()
    c = torch.tensor(SCALE)
    expected = torch.tensor([[0, 0, 0, 0, 1, -1], [1, 0, 1, -1, 0, 0]]) * c
    assert torch.equal(advantages("tv", teacher, old, mask, sign_tolerance=TOLERANCE), expected)
    # Tolerance 0 (the default): the paper's sign, which gives rounding noise a full-size advantage
    expected = torch.tensor([[1, -1, 1, -1, 1, -1], [1, -1, 1, -1, 1, 0]]) * c
    assert torch.equal(advantages("tv", teacher, old, mask), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_default_tolerance_is_0_against_another_model_and_the_rounding_bound_against_itself(dtype):
    assert default_sign_tolerance(False, dtype) == 0.0
    bound = {torch.float32: 1e-3, torch.bfloat16: 0.3, torch.float16: 0.1, torch.float64: 1e-3}[dtype]
    assert default_sign_tolerance(True, dtype) == bound


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_a_negative_or_non_finite_sign_tolerance_is_refused(value):
    with pytest.raises(ValueError, match="sign_tolerance must be a finite number >= 0"):
        TVOPDConfig(output_dir="unused", sign_tolerance=value, use_cpu=True, bf16=False, report_to="none")
