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
"""The on-policy TV estimate and the TV-EMA scheduler that sets TV-OPD's shared scale c_k (docs/method.md, sections 3 and 4)."""

import math

import torch

from .delta import TokenDelta


def tv_estimate(
    teacher_logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    span_ids: torch.Tensor | None = None,
):
    """
    Pooled on-policy TV estimate of one batch, as a numerator and a token count.

    Each active token contributes X_t = [1 - exp(delta_t)]_+, whose conditional mean is the exact TV between the rollout
    student and the teacher at that state (paper, eq. tv-estimator). It is evaluated as `-expm1(min(delta, 0))`, which
    never exponentiates a large positive log-ratio and keeps precision near zero. Non-finite tokens (NaN, +inf) are
    left out of both sums; delta = -inf gives X = 1.

    `weights` (`(B, T)`, optional) multiplies each X_t: for tokens drawn from a sampler other than pi_old (vLLM), the
    importance ratio pi_old / pi_sampler (truncated, as in the loss) makes the sum an estimate under pi_old again. The
    count stays the number of tokens.

    `span_ids` (`(B, T)`, optional; a teacher with another tokenizer) pools per span instead: each span's X, from its
    log-ratio (which each of its tokens carries, as do `weights`), counts once, so that the reference D_ref does not
    move with the tokenizer pair's mix of span lengths.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: float32 sum of X over active tokens, and the int64 active-token count.
        Sum both over micro-batches and processes before dividing: the estimate pools tokens.
    """
    return tv_sums(TokenDelta.of(teacher_logps, old_logps, mask, span_ids), weights)


def tv_sums(delta: TokenDelta, weights: torch.Tensor | None = None):
    """[`tv_estimate`] from a batch's [`~tvopd_trl.delta.TokenDelta`], computed once by the caller."""
    x = -torch.expm1(delta.delta.clamp(max=0.0))
    if weights is not None:
        x = x * weights
    x, active = delta.per_span(x)
    return torch.where(active, x, 0.0).sum(), active.sum()


def tv_sums_by_scale(delta: TokenDelta, scale_index, scales, weights=None, exact_tv=0.0):
    """`(scales, 3)`: per scale (`scale_index`, `(B,)`: each row's), the sum of X, the token count and the sum of the
    exact TV (`(B, T)`, or 0) over its rows' tokens."""
    sums = []
    for index in range(scales):
        rows = delta.where((scale_index == index).unsqueeze(1))
        u, n = tv_sums(rows, weights)
        sums.append(torch.stack([u.float(), n.float(), torch.where(rows.active, exact_tv, 0.0).sum().float()]))
    return torch.stack(sums)


class TVScheduler:
    """
    TV-EMA scheduler of TV-OPD: c = clip(((D_bar + eps) / (D_ref + eps)) ** alpha, min_scale, 1).

    `scale` is 1 until the reference D_ref is fixed. Each valid `update` folds the step's pooled estimate D_hat = u / n
    into the EMA D_bar; an empty step (n == 0), a non-finite estimate or a non-finite gradient norm leaves the state
    unchanged. The first valid update fixes D_ref = D_bar = D_hat (the paper's rule), unless `reference_min_tokens`
    asks for more tokens: the valid updates' (u, n) are then summed until n reaches it, and D_ref = D_bar = sum u /
    sum n.

    Args:
        alpha (`float`, *optional*, defaults to `0.5`):
            Attenuation exponent, >= 0. `0` keeps c = 1.
        ema_decay (`float`, *optional*, defaults to `0.95`):
            EMA retention, in [0, 1).
        min_scale (`float`, *optional*, defaults to `0.1`):
            Floor of c, in (0, 1].
        eps (`float`, *optional*, defaults to `1e-5`):
            Ratio guard, > 0.
        reference_min_tokens (`int`, *optional*, defaults to `0`):
            Active tokens the reference pools at least, >= 0. `0` fixes it at the first valid update.
    """

    def __init__(
        self,
        alpha: float = 0.5,
        ema_decay: float = 0.95,
        min_scale: float = 0.1,
        eps: float = 1e-5,
        reference_min_tokens: int = 0,
    ):
        validate_tv_hyperparameters(alpha, ema_decay, min_scale, eps, reference_min_tokens)
        self.alpha = alpha
        self.ema_decay = ema_decay
        self.min_scale = min_scale
        self.eps = eps
        self.reference_min_tokens = reference_min_tokens
        self.ema: float | None = None
        self.reference: float | None = None
        # The (sum of X, token count) the reference pools: growing until it is fixed, then what fixed it
        self.reference_sum = 0.0
        self.reference_tokens = 0.0
        self.num_updates = 0

    @property
    def scale(self) -> float:
        if self.reference is None:
            return 1.0
        ratio = (self.ema + self.eps) / (self.reference + self.eps)
        return min(max(ratio**self.alpha, self.min_scale), 1.0)

    def update(self, u, n, grad_norm=None) -> bool:
        """Folds one step's pooled (sum, count) into the state. Returns whether the state changed."""
        u, n = float(u), float(n)
        if n == 0 or (grad_norm is not None and not math.isfinite(float(grad_norm))):
            return False
        estimate = u / n
        if not math.isfinite(estimate):
            return False
        if self.reference is None:
            self.reference_sum += u
            self.reference_tokens += n
            if self.reference_tokens >= self.reference_min_tokens:
                self.reference = self.ema = self.reference_sum / self.reference_tokens
        else:
            self.ema = self.ema_decay * self.ema + (1.0 - self.ema_decay) * estimate
        self.num_updates += 1
        return True

    def state_dict(self) -> dict:
        return {
            "ema": self.ema,
            "reference": self.reference,
            "reference_sum": self.reference_sum,
            "reference_tokens": self.reference_tokens,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.ema = state["ema"]
        self.reference = state["reference"]
        # Checkpoints of versions before `reference_min_tokens` lack the pooled sums: they only matter before the
        # reference is fixed, and those versions fixed it at the first valid update.
        self.reference_sum = state.get("reference_sum", 0.0)
        self.reference_tokens = state.get("reference_tokens", 0.0)
        self.num_updates = state["num_updates"]


def validate_tv_hyperparameters(
    alpha: float, ema_decay: float, min_scale: float, eps: float, reference_min_tokens: int = 0
) -> None:
    if not alpha >= 0:
        raise ValueError(f"tv_alpha must be >= 0, got {alpha}. Use 0 to keep c_k = 1 (Sign-TV).")
    if not 0 <= ema_decay < 1:
        raise ValueError(f"tv_ema_decay must be in [0, 1), got {ema_decay}. The paper uses 0.95.")
    if not 0 < min_scale <= 1:
        raise ValueError(f"tv_min_scale must be in (0, 1], got {min_scale}. The paper uses 0.1.")
    if not eps > 0:
        raise ValueError(f"tv_eps must be > 0, got {eps}. The paper uses 1e-5.")
    if not reference_min_tokens >= 0:
        raise ValueError(
            f"tv_reference_min_tokens must be >= 0, got {reference_min_tokens}. 0 fixes the reference at the first "
            "valid update, as the paper does."
        )
