"""Tests for the on-policy TV estimate and the TV-EMA scheduler (docs/method.md, sections 3 and
4; paper eqs. tv-gradient and tv-estimator)."""

import json
import math
from fractions import Fraction

import pytest
import torch

from tvopd_trl.advantages import compute_advantages
from tvopd_trl.tv import TVScheduler, tv_estimate


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def exact_tv(p, q):
    """0.5 * sum_a |p(a) - q(a)| over python floats."""
    return 0.5 * sum(abs(pa - qa) for pa, qa in zip(p, q, strict=True))


def token_x(teacher_logp, old_logp):
    """X for a single sampled token, through `tv_estimate` on a (1, 1) batch."""
    u, n = tv_estimate(
        torch.tensor([[teacher_logp]], dtype=torch.float64),
        torch.tensor([[old_logp]], dtype=torch.float64),
        torch.ones(1, 1),
    )
    assert int(n) == 1
    return float(u)


def random_pair(vocab_size, seed):
    """A (teacher p, student q) pair of float64 distributions over `vocab_size` tokens, from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(vocab_size, generator=generator, dtype=torch.float64), dim=0)
    q = torch.softmax(2.0 * torch.randn(vocab_size, generator=generator, dtype=torch.float64), dim=0)
    return p.tolist(), q.tolist()


def log_or_neg_inf(x):
    return math.log(x) if x > 0 else -math.inf


# --------------------------------------------------------------------------------------------------------------------
# 1. E_{a~q}[X] = TV(p, q) and Var(X) <= d(1 - d) <= 1/4, by enumeration
# --------------------------------------------------------------------------------------------------------------------

RANDOM_PAIRS = [(vocab_size, seed) for vocab_size in range(2, 7) for seed in (0, 1, 2)]


@pytest.mark.parametrize("vocab_size,seed", RANDOM_PAIRS)
def test_tv_estimator_is_unbiased_with_bounded_variance_random(vocab_size, seed):
    p, q = random_pair(vocab_size, seed)
    d = exact_tv(p, q)

    # The identity itself, in float64: E_{a~q}[1 - p/q]_+ = TV(p, q).
    x64 = [max(1.0 - pa / qa, 0.0) for pa, qa in zip(p, q, strict=True)]
    assert sum(qa * xa for qa, xa in zip(q, x64, strict=True)) == pytest.approx(d, abs=1e-12)

    # tv_estimate works in float32 (docs/method.md, section 3), so its per-token X agrees with the float64 X to float32 precision.
    x = [token_x(math.log(pa), math.log(qa)) for pa, qa in zip(p, q, strict=True)]
    for xa, xa64 in zip(x, x64, strict=True):
        assert 0.0 <= xa <= 1.0
        assert xa == pytest.approx(xa64, abs=1e-6)
    expectation = sum(qa * xa for qa, xa in zip(q, x, strict=True))
    assert expectation == pytest.approx(d, abs=1e-6)

    # Exact variance: sum_a q X^2 - d^2 <= d (1 - d) <= 1/4.
    variance = sum(qa * xa**2 for qa, xa in zip(q, x64, strict=True)) - d**2
    assert -1e-12 <= variance <= d * (1.0 - d) + 1e-12
    assert d * (1.0 - d) <= 0.25
    variance_from_library = sum(qa * xa**2 for qa, xa in zip(q, x, strict=True)) - expectation**2
    assert variance_from_library <= d * (1.0 - d) + 1e-6


@pytest.mark.parametrize(
    "p,q,expected_x",
    [
        # Ratio 1/2 on the first token (X = 1/2), ratio 3/2 on the second (X = 0): TV = 1/4.
        ([0.25, 0.75], [0.5, 0.5], [0.5, 0.0]),
        # The teacher gives the last token no mass: delta = -inf, X = 1. Ratio 2 gives X = 0. TV = 1/4, and
        # X in {0, 1} makes the variance bound an equality.
        ([0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]),
    ],
)
def test_tv_estimator_hand_picked(p, q, expected_x):
    d = exact_tv(p, q)
    assert d == 0.25
    x = [token_x(log_or_neg_inf(pa), math.log(qa)) for pa, qa in zip(p, q, strict=True)]
    assert x == expected_x
    expectation = sum(qa * xa for qa, xa in zip(q, x, strict=True))
    assert expectation == pytest.approx(d, abs=1e-12)
    variance = sum(qa * xa**2 for qa, xa in zip(q, x, strict=True)) - d**2
    assert variance <= d * (1.0 - d) + 1e-12


def test_tv_estimate_pools_sum_and_count_over_a_batch():
    # The same four tokens as the second hand-picked case, one per row, with padding columns.
    q = [0.25, 0.25, 0.25, 0.25]
    p = [0.5, 0.25, 0.25, 0.0]
    teacher = torch.tensor([[log_or_neg_inf(pa), 0.0] for pa in p], dtype=torch.float64)
    old = torch.tensor([[math.log(qa), -3.0] for qa in q], dtype=torch.float64)
    mask = torch.tensor([[1, 0]] * 4)
    u, n = tv_estimate(teacher, old, mask)
    assert u.dim() == 0 and n.dim() == 0
    assert float(u) == 1.0
    assert int(n) == 4


# --------------------------------------------------------------------------------------------------------------------
# 2. The paper's EOS example: pooled target 1/6, mean of ratios 1/4
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap, expected", [(math.inf, "tv"), (1.5, "truncated")])
def test_importance_weights_make_a_different_samplers_tokens_estimate_the_tv_under_pi_old(cap, expected):
    """Tokens drawn from a sampler s != pi_old (vLLM): the batch holds every token exactly in proportion to s (s has
    rational probabilities), so sum / count is the exact expectation E_s[w X] (to float32 rounding). With w = pi_old / s it is the TV
    between pi_old and the teacher; truncated at `cap`, E_s[min(pi_old / s, cap) X]; unweighted, E_s[X], biased."""
    old = [0.5, 0.2, 0.2, 0.1]
    teacher = [0.1, 0.3, 0.2, 0.4]
    sampler = [Fraction(1, 10), Fraction(2, 10), Fraction(3, 10), Fraction(4, 10)]
    tokens = [token for token, share in enumerate(sampler) for _ in range(int(share * 10))]

    def logps(distribution):
        return torch.tensor([[math.log(distribution[t]) for t in tokens]], dtype=torch.float64)

    ratio = torch.exp(logps(old) - logps([float(x) for x in sampler])).clamp(max=cap)
    u, n = tv_estimate(logps(teacher), logps(old), torch.ones(1, len(tokens)), weights=ratio)
    x = [max(0.0, 1 - teacher[v] / old[v]) for v in range(4)]
    if expected == "tv":
        assert float(u) / int(n) == pytest.approx(exact_tv(old, teacher), abs=1e-6)
    else:
        want = sum(float(s) * min(old[v] / float(s), cap) * x[v] for v, s in enumerate(sampler))
        assert float(u) / int(n) == pytest.approx(want, abs=1e-6)
    unweighted, _ = tv_estimate(logps(teacher), logps(old), torch.ones(1, len(tokens)))
    assert float(unweighted) / int(n) == pytest.approx(sum(float(s) * x[v] for v, s in enumerate(sampler)), abs=1e-6)
    assert abs(float(unweighted) / int(n) - exact_tv(old, teacher)) > 0.1  # the bias the weights remove


def test_eos_example_ratio_estimator():
    log = math.log
    # Rollout 1: EOS sampled at position 1 (teacher 1/4, student 1/2), position 2 is padding.
    eos = (
        torch.tensor([[log(0.25), 0.0]], dtype=torch.float64),
        torch.tensor([[log(0.5), 0.0]], dtype=torch.float64),
        torch.tensor([[1, 0]]),
    )
    # Rollout 2: "continue" (teacher 3/4, student 1/2: delta > 0, X = 0), then a token on which the two agree.
    agree = log(0.3)
    cont = (
        torch.tensor([[log(0.75), agree]], dtype=torch.float64),
        torch.tensor([[log(0.5), agree]], dtype=torch.float64),
        torch.tensor([[1, 1]]),
    )
    rollouts = []
    for probability, batch in ((Fraction(1, 2), eos), (Fraction(1, 2), cont)):
        u, n = tv_estimate(*batch)
        rollouts.append((probability, Fraction(float(u)), Fraction(int(n))))

    assert [(u, v) for _, u, v in rollouts] == [(Fraction(1, 2), 1), (Fraction(0), 2)]

    expected_u = sum(prob * u for prob, u, _ in rollouts)
    expected_v = sum(prob * v for prob, _, v in rollouts)
    assert expected_u == Fraction(1, 4)
    assert expected_v == Fraction(3, 2)
    assert expected_u / expected_v == Fraction(1, 6)
    assert sum(prob * u / v for prob, u, v in rollouts) == Fraction(1, 4)

    # The pooled target also equals sum_t E[w_t d_t] / sum_t E[w_t] from the per-state TVs (1/4, then 0).
    tv_first = Fraction(1, 2) * (abs(Fraction(1, 4) - Fraction(1, 2)) + abs(Fraction(3, 4) - Fraction(1, 2)))
    assert tv_first == Fraction(1, 4)
    assert (1 * tv_first + Fraction(1, 2) * 0) / (1 + Fraction(1, 2)) == Fraction(1, 6)

    # One batch holding both rollouts pools tokens: U = 1/2, N = 3.
    u, n = tv_estimate(torch.cat([eos[0], cont[0]]), torch.cat([eos[1], cont[1]]), torch.cat([eos[2], cont[2]]))
    assert (float(u), int(n)) == (0.5, 3)


# --------------------------------------------------------------------------------------------------------------------
# 3. eq. tv-gradient: E_{a~q}[sign(delta(a)) grad log q(a)] = -2 grad TV(p, q)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sign_policy_gradient_is_minus_twice_tv_gradient(seed):
    vocab_size = 5
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab_size, generator=generator, dtype=torch.float64), dim=0)
    theta = torch.randn(vocab_size, generator=generator, dtype=torch.float64).requires_grad_(True)

    q = torch.softmax(theta, dim=0)
    assert (p - q).abs().min() > 1e-3  # no ties: |p - q| is differentiable at theta
    (grad_tv,) = torch.autograd.grad(0.5 * (p - q).abs().sum(), theta)

    log_q = torch.log_softmax(theta, dim=0)
    sign = compute_advantages(
        "sign",
        teacher_logps=p.log().unsqueeze(0),
        old_logps=log_q.detach().unsqueeze(0),
        mask=torch.ones(1, vocab_size),
    )[0].double()
    assert torch.equal(sign, torch.sign(p - q.detach()))

    left = torch.zeros(vocab_size, dtype=torch.float64)
    for a in range(vocab_size):
        (grad_log_q,) = torch.autograd.grad(log_q[a], theta, retain_graph=True)
        left += q[a].detach() * sign[a] * grad_log_q

    torch.testing.assert_close(left, -2.0 * grad_tv, rtol=0.0, atol=1e-10)
    assert grad_tv.abs().max() > 1e-3  # the identity is not the trivial 0 = 0


# --------------------------------------------------------------------------------------------------------------------
# 4. The -expm1(min(delta, 0)) form and token exclusion
# --------------------------------------------------------------------------------------------------------------------


def test_x_is_one_when_teacher_gives_no_mass():
    assert token_x(-math.inf, -1.0) == 1.0


def test_large_positive_delta_gives_zero_without_overflow():
    x = token_x(0.0, -1000.0)
    assert math.isfinite(x)
    assert x == 0.0


def test_tiny_negative_delta_keeps_relative_precision():
    x = token_x(-1e-12, 0.0)
    assert x == pytest.approx(1e-12, rel=1e-6, abs=0)  # default abs tolerance is 1e-12: disable it


def test_nan_inf_and_masked_tokens_are_excluded_from_sum_and_count():
    log_half = math.log(0.5)
    nan, inf = math.nan, math.inf
    # Columns: valid (X = 1/2), NaN teacher, NaN student, +inf delta (student gave its sample no mass),
    # masked-out -inf delta (would give X = 1), valid with delta = -inf (X = 1), masked-out NaN.
    teacher = torch.tensor([[log_half, nan, -1.0, -1.0, -inf, -inf, nan]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, nan, -inf, -1.0, -2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 0]])
    u, n = tv_estimate(teacher, old, mask)
    assert math.isfinite(float(u))
    assert float(u) == 1.5
    assert int(n) == 2

    # Same as the batch made only of the two kept tokens.
    u_kept, n_kept = tv_estimate(teacher[:, [0, 5]], old[:, [0, 5]], mask[:, [0, 5]])
    assert (float(u), int(n)) == (float(u_kept), int(n_kept))


def test_fully_masked_batch_gives_zero_sum_and_count():
    u, n = tv_estimate(torch.full((2, 3), -1.0), torch.zeros(2, 3), torch.zeros(2, 3))
    assert (float(u), int(n)) == (0.0, 0)


# --------------------------------------------------------------------------------------------------------------------
# 5. TVScheduler (docs/method.md, section 4)
# --------------------------------------------------------------------------------------------------------------------


def expected_scale(ema, reference, alpha=0.5, min_scale=0.1, eps=1e-5):
    return min(max(((ema + eps) / (reference + eps)) ** alpha, min_scale), 1.0)


def test_scale_is_one_before_any_valid_update():
    scheduler = TVScheduler()
    assert scheduler.scale == 1.0
    assert scheduler.state_dict() == {
        "ema": None,
        "reference": None,
        "reference_sum": 0.0,
        "reference_tokens": 0.0,
        "num_updates": 0,
    }


@pytest.mark.parametrize(
    "u,n,grad_norm",
    [
        (0.0, 0, None),
        (torch.tensor(0.0), torch.tensor(0), 1.0),
        (3.0, 10, math.nan),
        (3.0, 10, math.inf),
        (3.0, 10, -math.inf),
        (torch.tensor(3.0), torch.tensor(10), torch.tensor(math.nan)),
    ],
)
@pytest.mark.parametrize("warm_up", [0, 2])
def test_empty_step_or_nonfinite_grad_norm_freezes_state(u, n, grad_norm, warm_up):
    scheduler = TVScheduler(alpha=0.5, ema_decay=0.9, min_scale=0.1, eps=1e-5)
    for estimate in (0.4, 0.1)[:warm_up]:
        scheduler.update(estimate * 10, 10, grad_norm=1.0)
    before_state, before_scale = scheduler.state_dict(), scheduler.scale

    scheduler.update(u, n, grad_norm=grad_norm)

    assert scheduler.state_dict() == before_state
    assert scheduler.scale == before_scale
    if warm_up == 0:
        assert scheduler.scale == 1.0


def test_first_valid_update_sets_reference_and_ema():
    scheduler = TVScheduler()
    scheduler.update(3.0, 12)
    assert scheduler.reference == 0.25
    assert scheduler.ema == 0.25
    assert scheduler.num_updates == 1
    assert scheduler.scale == 1.0


def test_update_sequence_matches_hand_computation():
    alpha, decay, min_scale, eps = 0.5, 0.9, 0.1, 1e-5
    scheduler = TVScheduler(alpha=alpha, ema_decay=decay, min_scale=min_scale, eps=eps)
    # (U, N) per step, with D_hat = 0.4, 0.3, 0.2, 0.0, 0.6. Tensors as tv_estimate returns them also work.
    steps = [(4.0, 10), (torch.tensor(3.0), torch.tensor(10)), (1.0, 5), (0.0, 4), (6.0, 10)]
    # Hand-computed: ema_1 = 0.4 (= reference); ema_k = 0.9 ema_{k-1} + 0.1 D_hat_k.
    #   0.9*0.4   + 0.1*0.3 = 0.39
    #   0.9*0.39  + 0.1*0.2 = 0.371
    #   0.9*0.371 + 0.1*0.0 = 0.3339
    #   0.9*0.3339 + 0.1*0.6 = 0.36051
    expected_ema = [0.4, 0.39, 0.371, 0.3339, 0.36051]
    expected_scales = [1.0] + [math.sqrt((ema + eps) / (0.4 + eps)) for ema in expected_ema[1:]]
    assert all(min_scale < s < 1.0 for s in expected_scales[1:])  # no clipping in this sequence

    for k, ((u, n), ema, scale) in enumerate(zip(steps, expected_ema, expected_scales, strict=True), start=1):
        scheduler.update(u, n, grad_norm=1.0)
        assert scheduler.reference == 0.4
        assert scheduler.ema == pytest.approx(ema, rel=1e-12, abs=0)
        assert scheduler.scale == pytest.approx(scale, rel=1e-12, abs=0)
        assert scheduler.num_updates == k


def test_alpha_zero_keeps_scale_one_as_tv_falls():
    scheduler = TVScheduler(alpha=0.0)
    for estimate in (0.5, 0.3, 0.1, 0.0, 0.0, 0.0):
        scheduler.update(estimate, 1)
        assert scheduler.scale == 1.0
    assert scheduler.ema < scheduler.reference


def test_min_scale_floor_is_reached_at_the_ema_rate():
    decay, eps, min_scale = 0.95, 1e-5, 0.1
    scheduler = TVScheduler(alpha=0.5, ema_decay=decay, min_scale=min_scale, eps=eps)
    scheduler.update(0.5, 1)

    # Closed form: after k zero estimates ema = 0.5 * 0.95^k, and the floor binds once
    # sqrt((0.5 * 0.95^k + eps) / (0.5 + eps)) <= 0.1, i.e. 0.95^k <= (0.01 * (0.5 + eps) - eps) / 0.5.
    k_floor = math.ceil(math.log((min_scale**2 * (0.5 + eps) - eps) / 0.5) / math.log(decay))
    assert k_floor == 90

    first_floor_step = None
    for k in range(1, 121):
        scheduler.update(0.0, 7)
        closed_form_ema = 0.5 * decay**k
        assert scheduler.ema == pytest.approx(closed_form_ema, rel=1e-12, abs=0)
        expected = max(math.sqrt((closed_form_ema + eps) / (0.5 + eps)), min_scale)
        assert scheduler.scale == pytest.approx(expected, rel=1e-10, abs=0)
        assert scheduler.scale >= min_scale
        if scheduler.scale == min_scale and first_floor_step is None:
            first_floor_step = k
    assert first_floor_step == k_floor
    assert scheduler.scale == min_scale


def test_scale_is_clipped_at_one_when_tv_rises_above_reference():
    scheduler = TVScheduler(alpha=0.5, ema_decay=0.5, min_scale=0.1, eps=1e-5)
    scheduler.update(0.2, 1)
    for estimate in (0.5, 0.9, 1.0, 1.0):
        scheduler.update(estimate, 1)
        assert (scheduler.ema + 1e-5) / (scheduler.reference + 1e-5) > 1.0  # unclipped value would exceed 1
        assert scheduler.scale == 1.0


def run_sequence(scheduler):
    for u, n in [(4.0, 10), (1.0, 10), (0.0, 3), (2.0, 9), (0.5, 7)]:
        scheduler.update(u, n, grad_norm=0.5)
    return scheduler


def test_state_dict_round_trip_into_fresh_scheduler():
    kwargs = dict(alpha=0.7, ema_decay=0.8, min_scale=0.2, eps=1e-4)
    original = run_sequence(TVScheduler(**kwargs))
    assert original.scale < 1.0

    restored = TVScheduler(**kwargs)
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()
    assert restored.scale == original.scale

    # Both continue identically.
    for scheduler in (original, restored):
        scheduler.update(0.3, 3)
    assert restored.state_dict() == original.state_dict()
    assert restored.scale == original.scale


@pytest.mark.parametrize("num_steps", [0, 1, 5])
def test_state_dict_json_round_trip_is_bit_exact(num_steps):
    scheduler = TVScheduler(alpha=0.5, ema_decay=0.95, min_scale=0.1, eps=1e-5)
    for u, n in [(0.1234567891234, 3), (2.0 / 3.0, 7), (math.pi / 10, 11), (0.0, 5), (1e-9, 13)][:num_steps]:
        scheduler.update(u, n)
    state = scheduler.state_dict()

    loaded = json.loads(json.dumps(state))
    assert loaded == state
    for key in ("ema", "reference"):
        assert (loaded[key] is None) == (num_steps == 0)
        if loaded[key] is not None:
            assert loaded[key] == state[key]

    restored = TVScheduler(alpha=0.5, ema_decay=0.95, min_scale=0.1, eps=1e-5)
    restored.load_state_dict(loaded)
    assert restored.scale == scheduler.scale
    assert restored.state_dict() == state


def test_reference_pools_rollouts_until_the_minimum_token_count():
    decay, eps = 0.9, 1e-5
    scheduler = TVScheduler(alpha=0.5, ema_decay=decay, min_scale=0.1, eps=eps, reference_min_tokens=25)
    # (U, N, grad_norm) per rollout: 10 tokens, an empty one, a skipped step, 10 more, then 5 reach the minimum
    rollouts = [(1.0, 10, 1.0), (0.0, 0, 1.0), (9.0, 10, math.nan), (torch.tensor(2.0), torch.tensor(10), 1.0)]
    for u, n, grad_norm in rollouts:
        scheduler.update(u, n, grad_norm=grad_norm)
        assert scheduler.scale == 1.0 and scheduler.reference is None and scheduler.ema is None
    assert (scheduler.reference_sum, scheduler.reference_tokens, scheduler.num_updates) == (3.0, 20.0, 2)

    scheduler.update(0.5, 5)  # 25 tokens: D_ref = D_bar = (1 + 2 + 0.5) / (10 + 10 + 5), their token mean
    assert scheduler.reference == scheduler.ema == 3.5 / 25 and scheduler.scale == 1.0
    scheduler.update(0.7, 10)
    ema = decay * (3.5 / 25) + (1 - decay) * 0.07
    assert scheduler.ema == pytest.approx(ema, rel=1e-12, abs=0) and scheduler.reference == 3.5 / 25
    assert scheduler.scale == pytest.approx(math.sqrt((ema + eps) / (3.5 / 25 + eps)), rel=1e-12, abs=0)
    # The sums stay as the record of what the reference pooled
    assert scheduler.state_dict() == {
        "ema": scheduler.ema,
        "reference": 3.5 / 25,
        "reference_sum": 3.5,
        "reference_tokens": 25.0,
        "num_updates": 4,
    }


@pytest.mark.parametrize("minimum", [0, 1, 10])
def test_a_minimum_the_first_rollout_reaches_is_the_papers_rule(minimum):
    papers, pooled = TVScheduler(), TVScheduler(reference_min_tokens=minimum)
    for u, n in [(0.1234567891234, 10), (2.0 / 3.0, 7), (math.pi / 10, 11)]:
        papers.update(u, n)
        pooled.update(u, n)
        assert (pooled.reference, pooled.ema, pooled.scale) == (papers.reference, papers.ema, papers.scale)
    assert papers.reference == 0.1234567891234 / 10


def test_a_state_saved_while_pooling_the_reference_resumes_exactly():
    kwargs = dict(alpha=0.5, ema_decay=0.8, min_scale=0.1, eps=1e-5, reference_min_tokens=30)
    original = TVScheduler(**kwargs)
    for u, n in [(0.1234567891234, 10), (2.0 / 3.0, 7)]:
        original.update(u, n)
    restored = TVScheduler(**kwargs)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for u, n in [(math.pi / 10, 11), (0.3, 9), (0.1, 12)]:
        for scheduler in (original, restored):
            scheduler.update(u, n)
        assert restored.state_dict() == original.state_dict() and restored.scale == original.scale
    assert original.reference == (0.1234567891234 + 2.0 / 3.0 + math.pi / 10 + 0.3) / 37


def test_a_state_from_before_the_minimum_token_count_loads():
    restored = TVScheduler(reference_min_tokens=1000)
    restored.load_state_dict({"ema": 0.2, "reference": 0.3, "num_updates": 5})
    assert restored.scale == pytest.approx(math.sqrt((0.2 + 1e-5) / (0.3 + 1e-5)))
    restored.update(0.1, 1)
    assert restored.reference == 0.3 and restored.ema == pytest.approx(0.95 * 0.2 + 0.05 * 0.1)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"reference_min_tokens": -1}, "tv_reference_min_tokens"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": math.nan}, "alpha"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"ema_decay": -0.1}, "ema_decay"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 1.5}, "min_scale"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_invalid_hyperparameters_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TVScheduler(**kwargs)


def test_boundary_hyperparameters_are_accepted():
    scheduler = TVScheduler(alpha=0.0, ema_decay=0.0, min_scale=1.0, eps=1e-12)
    scheduler.update(0.5, 1)
    scheduler.update(0.1, 1)
    assert scheduler.ema == 0.1  # ema_decay = 0: the EMA is the latest estimate
    assert scheduler.scale == 1.0
