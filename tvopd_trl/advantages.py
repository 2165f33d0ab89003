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
"""Per-token advantage coefficients of every OPD variant in the TV-OPD paper (docs/method.md, section 2).

Every function here is pure and detached: it maps the sampled-token log-probabilities of one rollout batch, shaped
`(B, T)`, to a `(B, T)` coefficient that is zero wherever the token is inactive. Notation follows the paper: delta is
the raw log-ratio, z = sign(delta), m = |delta|, S = mean_t m over a sequence's active tokens and R = m / S.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .delta import TokenDelta


# A teacher that gives a sampled token no mass makes delta = -inf. Magnitude-based modes need a finite |delta|, so
# -inf is replaced by the log of the smallest normal float32, the most negative log-probability float32 can resolve.
LOG_FLOAT32_TINY = float(torch.log(torch.tensor(torch.finfo(torch.float32).tiny)))


def _finite_delta(delta: torch.Tensor, active: torch.Tensor, floor: float | None) -> torch.Tensor:
    floor = LOG_FLOAT32_TINY if floor is None else floor
    delta = torch.where(torch.isneginf(delta), torch.full_like(delta, floor), delta)
    return torch.where(active, delta, torch.zeros_like(delta))


def _sequence_mean(values: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Mean over each row's active tokens, shaped `(B, 1)`; 0 for a row without active tokens."""
    count = active.sum(dim=1, keepdim=True)
    return torch.where(active, values, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # A sequence whose magnitudes are all zero has S = 0: every mode that divides by S gives it zero coefficients.
    return torch.where(denominator > 0, numerator / denominator.clamp(min=torch.finfo(numerator.dtype).tiny), 0.0)


def raw_advantage(delta, active, *, clip_low=None):
    return _finite_delta(delta, active, clip_low)


def clip_advantage(delta, active, *, clip_low, clip_high):
    return _finite_delta(delta, active, clip_low).clamp(min=clip_low, max=clip_high) * active


def power_advantage(delta, active, *, teacher_logps, old_logps, gamma):
    # Box-Cox on probabilities: p_T^gamma - p_old^gamma, bounded in [-1, 1] and sign-preserving.
    advantage = torch.exp(gamma * teacher_logps.float()) - torch.exp(gamma * old_logps.float())
    return torch.where(active, advantage, 0.0)


def vopd_advantage(delta, active, *, reverse_kl, clip_low=None):
    # delta + RKL_t centres the single-sample estimate of -RKL_t on its exact conditional mean.
    return torch.where(active, _finite_delta(delta, active, clip_low) + reverse_kl.float(), 0.0)


def sign_advantage(delta, active):
    return torch.where(active, torch.sign(delta), 0.0)


def tv_advantage(delta, active, *, scale):
    return scale * sign_advantage(delta, active)


def relative_power_advantage(delta, active, *, beta, clip_low=None):
    magnitude = _finite_delta(delta, active, clip_low).abs()
    seq_scale = _sequence_mean(magnitude, active)
    relative = _safe_divide(magnitude, seq_scale)
    powered = torch.where(active, relative.pow(beta), 0.0)
    flattened = _safe_divide(powered, _sequence_mean(powered, active))
    return sign_advantage(delta, active) * seq_scale * flattened


def sequence_constant_advantage(delta, active, *, clip_low=None):
    magnitude = _finite_delta(delta, active, clip_low).abs()
    return sign_advantage(delta, active) * _sequence_mean(magnitude, active)


def shuffle_advantage(delta, active, *, clip_low=None, generator=None):
    magnitude = _finite_delta(delta, active, clip_low).abs()
    seq_scale = _sequence_mean(magnitude, active)
    relative = _safe_divide(magnitude, seq_scale)
    shuffled = torch.zeros_like(relative)
    for row in range(relative.size(0)):
        positions = active[row].nonzero().squeeze(1)
        permutation = torch.randperm(positions.numel(), generator=generator, device="cpu").to(positions.device)
        shuffled[row, positions] = relative[row, positions[permutation]]
    return sign_advantage(delta, active) * seq_scale * shuffled


def sign_mass_raw_alloc_advantage(delta, active, *, clip_low=None):
    # Each sign group keeps the total mass Sign gives it (its token count); raw magnitudes allocate it within.
    magnitude = _finite_delta(delta, active, clip_low).abs()
    sign = sign_advantage(delta, active)
    group_mean = torch.zeros_like(magnitude)
    for group_sign in (1.0, -1.0):
        in_group = sign == group_sign
        group_mean = torch.where(in_group, _sequence_mean(magnitude, in_group).expand_as(magnitude), group_mean)
    return sign * _safe_divide(magnitude, group_mean)


@dataclass(frozen=True)
class AdvantageMode:
    """
    One `advantage_mode`: its coefficient function and what it needs.

    Args:
        function (`Callable`):
            `function(delta, active, **keywords)` returns the `(B, T)` coefficients, detached and 0 where `active` is
            False. Its keyword-only parameters are exactly `inputs` and the keys of `hyperparameters`; those without a
            default are required.
        paper (`str`):
            The method's name in the TV-OPD paper.
        hyperparameters (`dict[str, str | None]`, *optional*):
            The function's keyword -> the [`TVOPDConfig`] field that sets it in a trainer run, or `None` for a
            hyperparameter without a field of its own: it is then set by `TVOPDConfig.advantage_kwargs` and defaults to
            the function's default.
        inputs (`tuple[str, ...]`, *optional*):
            What the trainer supplies beyond delta: `"teacher_logps"`, `"old_logps"`, `"reverse_kl"` (the exact per-state
            reverse KL over the vocabulary, which makes the trainer score both full distributions), `"scale"` (c_k) and
            `"generator"` (a seeded CPU generator, the same on every pass over a rollout).
        ranges (`dict[str, tuple[Callable[[float], bool], str]]`, *optional*):
            A hyperparameter's keyword -> `(is_valid, rule)`: the config refuses a value for which `is_valid` is False,
            quoting `rule` (for example `"> 0"`).
        sign_based (`bool`, *optional*, defaults to `False`):
            Whether the mode reads delta's direction through sign(delta): a token whose |delta| is at or below the sign
            tolerance (`TVOPDConfig.sign_tolerance`) is then a tie, and the mode sees delta = 0 there.
    """

    function: Callable[..., torch.Tensor]
    paper: str
    hyperparameters: dict[str, str | None] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    ranges: dict[str, tuple[Callable[[float], bool], str]] = field(default_factory=dict)
    sign_based: bool = False

    @property
    def needs_exact_divergence(self) -> bool:
        return "reverse_kl" in self.inputs

    @property
    def across_tokenizers(self) -> bool:
        """Whether the mode is defined on span log-ratios (a teacher with another tokenizer): it reads delta only,
        not the per-token probabilities or distributions of one vocabulary."""
        return not {"teacher_logps", "old_logps", "reverse_kl"} & set(self.inputs)

    @property
    def required(self) -> tuple[str, ...]:
        """The function's keywords without a default: a call without them is an error."""
        parameters = inspect.signature(self.function).parameters.values()
        return tuple(p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty)

    def label(self, keyword: str) -> str:
        """Where a run sets the hyperparameter `keyword`: its config field, or its key in `advantage_kwargs`."""
        name = self.hyperparameters[keyword]
        return f"advantage_kwargs[{keyword!r}]" if name is None else name

    def config_kwargs(self, args) -> dict:
        """The function's hyperparameters in a run configured by `args` (a `TVOPDConfig`): each from its config field,
        or from `args.advantage_kwargs` (left out where it is not set there, so that the function's default holds)."""
        extra = getattr(args, "advantage_kwargs", None) or {}
        kwargs = {}
        for keyword, name in self.hyperparameters.items():
            if name is not None:
                kwargs[keyword] = getattr(args, name)
            elif keyword in extra:
                kwargs[keyword] = extra[keyword]
        return kwargs

    def check(self, mode: str, kwargs: dict) -> None:
        """Raises a `ValueError` naming the setting to change when `kwargs` (see `config_kwargs`) misses a required
        hyperparameter or holds one out of its range."""
        missing = [
            self.label(keyword)
            for keyword in self.required
            if keyword in self.hyperparameters and kwargs.get(keyword) is None
        ]
        if missing:
            raise ValueError(f"advantage_mode={mode!r} needs {' and '.join(missing)}, but it is None. Set it.")
        for keyword, (is_valid, rule) in self.ranges.items():
            value = kwargs.get(keyword)
            if value is not None and not is_valid(value):
                raise ValueError(f"advantage_mode={mode!r} needs {self.label(keyword)} {rule}, got {value}.")


# Every mode that uses abs(delta) replaces a delta of -inf by `advantage_clip_low` when it is set.
_FLOOR = {"clip_low": "advantage_clip_low"}

ADVANTAGE_MODE_REGISTRY: dict[str, AdvantageMode] = {
    "raw": AdvantageMode(raw_advantage, "Raw OPD", _FLOOR),
    "clip": AdvantageMode(
        clip_advantage, "ClipOPD", {"clip_low": "advantage_clip_low", "clip_high": "advantage_clip_high"}
    ),
    "power": AdvantageMode(
        power_advantage,
        "PowerOPD",
        {"gamma": "power_gamma"},
        ("teacher_logps", "old_logps"),
        ranges={"gamma": (lambda gamma: gamma > 0, "> 0")},
    ),
    "vopd": AdvantageMode(vopd_advantage, "vOPD", _FLOOR, ("reverse_kl",)),
    "sign": AdvantageMode(sign_advantage, "Sign / Sign-TV", sign_based=True),
    "tv": AdvantageMode(tv_advantage, "TV-OPD", inputs=("scale",), sign_based=True),
    "relative_power": AdvantageMode(
        relative_power_advantage,
        "Power(beta) ablation",
        {"beta": "relative_power_beta", **_FLOOR},
        ranges={"beta": (lambda beta: 0 <= beta <= 1, "in [0, 1]")},
        sign_based=True,
    ),
    "sequence_constant": AdvantageMode(sequence_constant_advantage, "Sequence-Constant", _FLOOR, sign_based=True),
    "shuffle": AdvantageMode(shuffle_advantage, "Shuffle", _FLOOR, ("generator",), sign_based=True),
    "sign_mass_raw_alloc": AdvantageMode(
        sign_mass_raw_alloc_advantage, "Sign-Mass/Raw-Allocation", _FLOOR, sign_based=True
    ),
}
ADVANTAGE_MODES = tuple(ADVANTAGE_MODE_REGISTRY)

# A self-teacher's default sign tolerance, by the student's compute dtype: above the largest |delta| that two forwards
# of the same weights put between one token's log-probabilities when only the batch's padding or shape differs
# (benchmarks/probe_self_teacher_rounding.py, on the trained hint student: 2.7e-5 nats in float32, 0.052 in fp16, 0.26
# in bf16; docs/method.md, section 13).
SELF_TEACHER_SIGN_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.3}


def default_sign_tolerance(self_teacher: bool, compute_dtype: torch.dtype) -> float:
    """`TVOPDConfig.sign_tolerance` when unset: 0 against another model (the paper's sign), and against the student's
    own weights the rounding bound of its compute dtype (`SELF_TEACHER_SIGN_TOLERANCE`; float32's for float64)."""
    if not self_teacher:
        return 0.0
    return SELF_TEACHER_SIGN_TOLERANCE.get(compute_dtype, SELF_TEACHER_SIGN_TOLERANCE[torch.float32])


def run_sign_tolerance(args, student) -> float:
    """The sign tolerance of a run configured by `args` (a `TVOPDConfig`) on `student`: `args.sign_tolerance`, or its
    default for the run's teacher and the dtype the student computes in (autocast's with `bf16`/`fp16`, else its
    weights')."""
    if args.sign_tolerance is not None:
        return args.sign_tolerance
    compute_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else student.dtype
    return default_sign_tolerance(args.self_distillation is not None, compute_dtype)


def compute_advantages(
    mode: str,
    *,
    teacher_logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    scale: float = 1.0,
    reverse_kl: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    span_ids: torch.Tensor | None = None,
    sign_tolerance: float = 0.0,
    **hyperparameters,
) -> torch.Tensor:
    """
    Detached per-token advantage coefficients A_t for one of the [`ADVANTAGE_MODES`] (docs/method.md, section 2).

    Args:
        mode (`str`):
            One of `"raw"`, `"clip"`, `"power"`, `"vopd"`, `"sign"`, `"tv"`, `"relative_power"`,
            `"sequence_constant"`, `"shuffle"` and `"sign_mass_raw_alloc"` (see [`ADVANTAGE_MODE_REGISTRY`]).
        teacher_logps (`torch.Tensor`):
            `(B, T)` teacher log-probabilities of the sampled tokens.
        old_logps (`torch.Tensor`):
            `(B, T)` rollout-policy log-probabilities of the same tokens.
        mask (`torch.Tensor`):
            `(B, T)` response mask, 1 on active completion tokens (EOS included) and 0 on padding and tool output.
        scale (`float`, *optional*, defaults to `1.0`):
            The TV-OPD coefficient c_k, used by `"tv"` only.
        reverse_kl (`torch.Tensor`, *optional*):
            `(B, T)` exact per-state reverse KL(pi_old || pi_T), required by `"vopd"`.
        generator (`torch.Generator`, *optional*):
            CPU generator for the within-sequence permutation of `"shuffle"`.
        span_ids (`torch.Tensor`, *optional*):
            `(B, T)` span index of each token (a teacher with another tokenizer, see `tvopd_trl.spans`), whose tokens
            all carry the span's delta: the mode then runs on one entry per span, so that every sequence statistic
            (S, a permutation, a sign group's mass) counts each span once, and each token gets its span's coefficient.
            Only modes with `across_tokenizers` take it.
        sign_tolerance (`float`, *optional*, defaults to `0.0`):
            In the `sign_based` modes (`"sign"`, `"tv"`, `"relative_power"`, `"sequence_constant"`, `"shuffle"`,
            `"sign_mass_raw_alloc"`), a token with |delta| at or below it is a tie, which the mode reads as delta = 0:
            no direction, advantage 0 (and no magnitude in S or a sign group's mass). The other modes ignore it. With
            0, only delta = 0 is a tie, as in the paper.
        **hyperparameters:
            The modes' hyperparameters by keyword (each entry of [`ADVANTAGE_MODE_REGISTRY`] lists its own); those of
            other modes are ignored:
            - `clip_low` (`float`): lower ClipOPD bound, required by `"clip"`. In every mode that uses |delta|, a delta
              of -inf is replaced by this value if set, else by log of the smallest normal float32.
            - `clip_high` (`float`): upper ClipOPD bound, required by `"clip"`.
            - `gamma` (`float`): PowerOPD exponent (> 0), required by `"power"`.
            - `beta` (`float`): Power(beta) exponent in [0, 1], required by `"relative_power"`.

    Returns:
        `torch.Tensor`: `(B, T)` float32 coefficients, detached, zero on inactive and non-finite tokens.
    """
    return advantages_from_delta(
        mode,
        TokenDelta.of(teacher_logps, old_logps, mask, span_ids),
        teacher_logps=teacher_logps,
        old_logps=old_logps,
        scale=scale,
        reverse_kl=reverse_kl,
        generator=generator,
        sign_tolerance=sign_tolerance,
        **hyperparameters,
    )


def advantages_from_delta(
    mode: str,
    delta: TokenDelta,
    *,
    teacher_logps: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    scale: float = 1.0,
    reverse_kl: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sign_tolerance: float = 0.0,
    **hyperparameters,
) -> torch.Tensor:
    """[`compute_advantages`] from a batch's [`~tvopd_trl.delta.TokenDelta`], computed once by the caller (the trainer
    reads the same delta for the TV estimate and its statistics). The log-probabilities are needed only by the modes
    whose `inputs` name them."""
    if mode not in ADVANTAGE_MODE_REGISTRY:
        raise ValueError(f"Unknown advantage_mode {mode!r}. Valid modes are: {', '.join(ADVANTAGE_MODE_REGISTRY)}.")
    known = {keyword for spec in ADVANTAGE_MODE_REGISTRY.values() for keyword in spec.hyperparameters}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise TypeError(f"compute_advantages() got unknown hyperparameters {unknown}; the modes' are {sorted(known)}.")
    spec = ADVANTAGE_MODE_REGISTRY[mode]
    inputs = {
        "teacher_logps": None if teacher_logps is None else teacher_logps.detach(),
        "old_logps": None if old_logps is None else old_logps.detach(),
        "reverse_kl": None if reverse_kl is None else reverse_kl.detach(),
        "scale": scale,
        "generator": generator,
    }
    # An unset hyperparameter is left out, so that the function's default holds
    keywords = {name: inputs[name] for name in spec.inputs}
    keywords.update({k: v for k, v in hyperparameters.items() if k in spec.hyperparameters and v is not None})
    for name in spec.required:
        if keywords.get(name) is None:
            raise ValueError(f"advantage_mode={mode!r} requires `{name}`, but it is None.")
    if delta.span_ids is not None and not spec.across_tokenizers:
        raise ValueError(f"advantage_mode={mode!r} is not defined on span log-ratios: {across_tokenizers_hint()}")
    values = delta.delta
    if spec.sign_based and sign_tolerance > 0:
        values = torch.where(values.abs() <= sign_tolerance, 0.0, values)
    return delta.per_token(spec.function(*delta.per_span(values), **keywords))


def across_tokenizers_hint() -> str:
    """What a run with a teacher of another tokenizer can use instead, for errors."""
    modes = [mode for mode, spec in ADVANTAGE_MODE_REGISTRY.items() if spec.across_tokenizers]
    return f"with a teacher of another tokenizer use one of {', '.join(modes)}."
