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
"""Dispersion statistics of the raw advantage, as in the paper's case study (section "Raw-Advantage Dispersion")."""

import math

import torch


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
