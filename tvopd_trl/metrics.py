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
"""What the trainer logs about a step's tokens: the dispersion statistics of the raw advantage, as in the paper's case
study (section "Raw-Advantage Dispersion"), and the named per-token sums behind the other per-step metrics."""

import math

import torch

from .advantages import LOG_FLOAT32_TINY


def log_tv_estimate(metrics, tv_sum: float, tokens: float) -> None:
    """Appends the step's pooled TV estimate (`tv/estimate`, the weighted sum of [1 - exp(delta)]_+ over its `tokens`)
    and `tv/acceptance`, 1 minus it: the student's estimated acceptance rate as a speculative-sampling draft of the
    teacher at the rollouts' sampling settings (a token is accepted with probability min(1, p_teacher / p_student), whose
    expectation under the student is 1 - TV). NaN for a step without tokens."""
    estimate = tv_sum / tokens if tokens > 0 else float("nan")
    metrics["tv/estimate"].append(estimate)
    metrics["tv/acceptance"].append(1.0 - estimate)


def advantage_dispersion(abs_delta: torch.Tensor) -> dict[str, float]:
    """
    Median, p99 and max of |delta| over a flat set of active tokens, and the share of the squared energy sum(delta^2)
    held by the largest 1% and 10% of them (at least one token each). NaN for an empty set.
    """
    values = abs_delta.detach().double().flatten().sort().values
    if values.numel() == 0:
        nan = float("nan")
        return {"abs_median": nan, "abs_p99": nan, "abs_max": nan, "top1pct_energy": nan, "top10pct_energy": nan}
    energy = values.flip(0).square()
    total = energy.sum()

    def quantile(q):
        # Linear interpolation, as `torch.quantile` (which refuses more than 2**24 values).
        position = q * (values.numel() - 1)
        low = math.floor(position)
        high = min(low + 1, values.numel() - 1)
        return (values[low] + (position - low) * (values[high] - values[low])).item()

    def top_share(fraction):
        if total == 0:
            return 0.0
        return (energy[: math.ceil(fraction * energy.numel())].sum() / total).item()

    return {
        "abs_median": quantile(0.5),
        "abs_p99": quantile(0.99),
        "abs_max": values[-1].item(),
        "top1pct_energy": top_share(0.01),
        "top10pct_energy": top_share(0.10),
    }


def survival_curve(abs_delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The empirical survival function of |delta|: sorted values v_i and the fraction of tokens with |delta| >= v_i."""
    values = abs_delta.detach().double().flatten().sort().values
    count = values.numel()
    return values, (count - torch.arange(count, dtype=torch.float64)) / count


def cumulative_energy(abs_delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens sorted by |delta|, largest first: (fraction of tokens, share of sum(delta^2) they hold)."""
    energy = abs_delta.detach().double().flatten().sort(descending=True).values.square()
    count = energy.numel()
    share = energy.cumsum(0) / energy.sum() if count and energy.sum() > 0 else torch.zeros(count, dtype=torch.float64)
    return torch.arange(1, count + 1, dtype=torch.float64) / count, share


class StepStatistics:
    """
    The per-token statistics of one optimizer step, or of one standalone batch (an evaluation, a custom loop).

    Each micro-batch adds named sums over its tokens; `log` reduces them over processes once and appends every
    metric of docs/method.md, section 5 that they make, by name, to the trainer's `_metrics[mode]`.
    """

    def __init__(self):
        self.sums = None
        # Under vLLM: (max abs(log pi_old - log pi_vllm), -min ratio, max ratio), all maxima so that one `max` combines
        self.extremes = None
        self.abs_delta = []  # of every active token, for the dispersion statistics

    def add(
        self,
        *,
        active,
        delta,
        ratio,
        advantages,
        loss_mask,
        per_token_loss,
        entropy,
        epsilon,
        log_gap=None,
        teachers=None,
        terms=None,
        counted=True,
        sign_tolerance=None,
    ):
        """Adds one micro-batch: `(B, T)` tensors, `epsilon` = (low, high) PPO clip ranges, `log_gap` = log pi_old -
        log pi_vllm under vLLM, `teachers` = {name: `(B,)` mask of its rows} with several teachers, `terms` = the
        advantage's (distillation, reward) terms with a task reward, `sign_tolerance` = the tolerance of a sign-based
        mode (its ties are counted). `counted=False` adds no token: under sequence
        parallelism, every process of a group holds its whole rows, and the group's first process counts them."""
        if not counted:
            active, loss_mask = torch.zeros_like(active), torch.zeros_like(loss_mask)
        finite_delta = torch.where(torch.isneginf(delta), LOG_FLOAT32_TINY, delta)
        sums = {
            "tokens": active.sum(),
            "clip_low": ((ratio < 1 - epsilon[0]) & (advantages < 0) & active).sum(),
            "clip_high": ((ratio > 1 + epsilon[1]) & (advantages > 0) & active).sum(),
            "negative_delta": torch.where(active, -finite_delta, 0.0).sum(),
            "abs_delta": torch.where(active, finite_delta.abs(), 0.0).sum(),
            "positive_delta": (active & (delta > 0)).sum(),
            "nonfinite": (loss_mask.bool() & ~active).sum(),
            "loss": torch.where(active, per_token_loss.detach(), 0.0).sum(),
            "entropy": torch.where(active, entropy, 0.0).sum(),
        }
        if sign_tolerance is not None:
            sums["tied"] = (active & (delta != 0) & (delta.abs() <= sign_tolerance)).sum()
        if terms is not None:
            sums["abs_distill"] = torch.where(active, terms[0].abs(), 0.0).sum()
            sums["abs_reward"] = torch.where(active, terms[1].abs(), 0.0).sum()
        for name, rows in (teachers or {}).items():
            own = active & rows.unsqueeze(1)
            sums[f"tokens/{name}"] = own.sum()
            sums[f"negative_delta/{name}"] = torch.where(own, -finite_delta, 0.0).sum()
        if log_gap is not None:
            sums["log_gap"] = log_gap.abs().sum()
            sums["sampling_ratio"] = torch.where(active, log_gap.exp(), 0.0).sum()
            extremes = log_gap.new_full((3,), -math.inf)
            if active.any():
                gap = log_gap[active]
                extremes = torch.stack([gap.abs().max(), -gap.exp().min(), gap.exp().max()]).float()
            self.extremes = extremes if self.extremes is None else torch.maximum(self.extremes, extremes)
        sums = {name: value.float() for name, value in sums.items()}
        self.sums = sums if self.sums is None else {name: self.sums[name] + value for name, value in sums.items()}
        self.abs_delta.append(finite_delta[active].abs())

    def log(self, accelerator, metrics, dispersion=True):
        """Reduces over processes and appends to `metrics`; with `dispersion`, the `advantage/*` statistics of abs(delta)
        over every active token of every process too."""
        if self.sums is not None:
            values = accelerator.reduce(torch.stack(list(self.sums.values())), reduction="sum").tolist()
            self._log_sums(accelerator, metrics, dict(zip(self.sums, values, strict=True)))
        if dispersion:
            device = accelerator.device
            abs_delta = torch.cat(self.abs_delta) if self.abs_delta else torch.zeros(0, device=device)
            abs_delta = accelerator.gather(accelerator.pad_across_processes(abs_delta, pad_index=-1))
            for name, value in advantage_dispersion(abs_delta[abs_delta >= 0]).items():
                metrics[f"advantage/{name}"].append(value)

    def _log_sums(self, accelerator, metrics, sums):
        count = sums["tokens"]
        ratio = (lambda value: value / count) if count > 0 else (lambda value: float("nan"))
        metrics["clip_ratio/low"].append(ratio(sums["clip_low"]))
        metrics["clip_ratio/high"].append(ratio(sums["clip_high"]))
        metrics["kl/reverse_estimate"].append(ratio(sums["negative_delta"]))
        # How far the teacher sits from the student per token: with self-distillation, what the privileged context moves
        metrics["advantage/abs_mean"].append(ratio(sums["abs_delta"]))
        metrics["advantage/positive_fraction"].append(ratio(sums["positive_delta"]))
        if "tied" in sums:
            # The tokens the sign tolerance turned from +-1 into 0
            metrics["advantage/tie_fraction"].append(ratio(sums["tied"]))
        metrics["tv/nonfinite_tokens"].append(sums["nonfinite"])
        metrics["policy_loss"].append(ratio(sums["loss"]))
        metrics["entropy"].append(ratio(sums["entropy"]))
        if "abs_reward" in sums:
            # Which signal drives the update: the two terms' mean |coefficient| over the step's tokens, and their ratio
            metrics["advantage/distill_abs_mean"].append(ratio(sums["abs_distill"]))
            metrics["advantage/reward_abs_mean"].append(ratio(sums["abs_reward"]))
            share = sums["abs_reward"] / sums["abs_distill"] if sums["abs_distill"] > 0 else float("nan")
            metrics["advantage/reward_to_distill"].append(share)
        for key in sums:
            if key.startswith("tokens/"):
                name, own = key.removeprefix("tokens/"), sums[key]
                kl = sums[f"negative_delta/{name}"] / own if own > 0 else float("nan")
                metrics[f"kl/{name}/reverse_estimate"].append(kl)
        if "log_gap" in sums:
            # TRL GRPO's names for the sampler / trainer mismatch; the ratio is pi_old / pi_vllm, before its cap.
            metrics["sampling/sampling_logp_difference/mean"].append(ratio(sums["log_gap"]))
            metrics["sampling/importance_sampling_ratio/mean"].append(ratio(sums["sampling_ratio"]))
            max_gap, neg_min_ratio, max_ratio = accelerator.gather(self.extremes[None]).max(dim=0).values.tolist()
            finite = count > 0
            metrics["sampling/sampling_logp_difference/max"].append(max_gap if finite else float("nan"))
            metrics["sampling/importance_sampling_ratio/min"].append(-neg_min_ratio if finite else float("nan"))
            metrics["sampling/importance_sampling_ratio/max"].append(max_ratio if finite else float("nan"))
