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
"""Span tensors of cross-tokenizer distillation (docs/cross-tokenizer.md): pure functions of `(B, T)` per-token values
and `span_ids`, each student token's span index within its row (-1 for a token in no scored span).

A span is the smallest piece of a completion's text that both tokenizations cut at its two ends. Its log-ratio is
delta_span = log pi_T(span) - log pi_old(span), the sums of each model's log-probabilities of its own tokens there,
and every student token of the span carries it. On the token path each token is a span of its own, and every function
here is the identity.
"""

import math

import torch


def span_sums(values: torch.Tensor, span_ids: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """`(B, S)` sums of `values` over each span's tokens (`S`: `count`, by default the largest span id + 1; 0 for a
    span id no token has). NaN and infinities propagate to their span."""
    if count is None:
        count = int(span_ids.max().item()) + 1 if span_ids.numel() else 0
    sums = values.new_zeros(values.size(0), max(count, 1))
    inside = span_ids >= 0
    return sums.scatter_add(1, span_ids.clamp(min=0), torch.where(inside, values, 0.0))


def broadcast_spans(span_values: torch.Tensor, span_ids: torch.Tensor) -> torch.Tensor:
    """`(B, T)`: each token's span value from `(B, S)` `span_values`, 0 at tokens in no span."""
    return torch.where(span_ids >= 0, span_values.gather(1, span_ids.clamp(min=0)), 0.0)


def align_teacher_logps(teacher_logps: torch.Tensor, old_logps: torch.Tensor, span_ids: torch.Tensor) -> torch.Tensor:
    """
    The per-token teacher log-probabilities of a span-scored batch against the rollout policy `old_logps`:
    `old_logps + delta_span`, so that `teacher_logps - old_logps` is the span's log-ratio at each of its tokens.

    Args:
        teacher_logps (`torch.Tensor`):
            `(B, T)` with each span's teacher log-probability summed over its tokens (the scorer puts it on the span's
            last student token and 0 on the others).
        old_logps (`torch.Tensor`):
            `(B, T)` rollout-policy log-probabilities of the student's tokens.
        span_ids (`torch.Tensor`):
            `(B, T)` span index of each token, -1 outside every scored span (those tokens get NaN).
    """
    teacher_logps, old_logps = teacher_logps.float(), old_logps.detach().float()
    delta = span_sums(teacher_logps, span_ids) - span_sums(old_logps, span_ids)
    # A span of one token keeps its teacher value bit for bit: the token path's rows are left exactly as they were
    single = broadcast_spans(span_sums(torch.ones_like(old_logps), span_ids), span_ids) == 1
    aligned = torch.where(single, teacher_logps, old_logps + broadcast_spans(delta, span_ids))
    return torch.where(span_ids >= 0, aligned, math.nan)


def last_of_span(span_ids: torch.Tensor) -> torch.Tensor:
    """`(B, T)` bool: the tokens that end their span (the scorer puts a span's teacher log-probability there)."""
    following = torch.nn.functional.pad(span_ids[:, 1:], (0, 1), value=-2)
    return (span_ids >= 0) & (span_ids != following)


def to_spans(values: torch.Tensor, active: torch.Tensor, span_ids: torch.Tensor):
    """`((B, S) values, (B, S) active)`: one entry per span, from per-token `values` that are equal across each span's
    tokens (a broadcast span quantity). A span is active when any of its tokens is."""
    count = max(int(span_ids.max().item()) + 1 if span_ids.numel() else 0, 1)
    counted = active & (span_ids >= 0)
    index = torch.where(counted, span_ids, count)  # inactive tokens go to a spare column, dropped below
    span_values = values.new_zeros(values.size(0), count + 1).scatter(1, index, torch.where(counted, values, 0))
    span_active = torch.zeros_like(span_values, dtype=torch.bool).scatter(1, index, counted)
    return span_values[:, :count], span_active[:, :count]


def token_spans(mask: torch.Tensor) -> torch.Tensor:
    """`span_ids` of the token path: each active token of `mask` a span of its own."""
    return torch.where(mask.bool(), torch.arange(mask.size(1), device=mask.device).expand_as(mask), -1)
