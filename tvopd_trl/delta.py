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
"""The log-ratio of a batch's sampled tokens, delta_t = log pi_T(y_t) - log pi_old(y_t), and the tokens that carry one.

The trainer computes it once per micro-batch (`TokenDelta.of`); the advantage (`tvopd_trl.advantages`), the TV
estimate (`tvopd_trl.tv`) and the step's statistics (`tvopd_trl.metrics`) all read that one value. With a teacher of
another tokenizer every token of a span carries the span's delta (`tvopd_trl.spans`), and a quantity that counts each
span once goes through `per_span` and back through `per_token`; on the token path both are the identity.
"""

from dataclasses import dataclass, replace

import torch

from .spans import broadcast_spans, to_spans


def token_delta(teacher_logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor):
    """Returns the raw log-ratio delta and the active-token mask with non-finite tokens removed.

    NaN (either model produced NaN) and +inf (the rollout policy gave its own sample no mass) carry no usable
    direction, so those tokens leave the loss and the TV estimate. delta = -inf stays active: it is a legitimate
    "teacher rules this token out".
    """
    delta = (teacher_logps.float() - old_logps.float()).detach()
    nonfinite = torch.isnan(delta) | torch.isposinf(delta)
    active = mask.bool() & ~nonfinite
    return delta, active


@dataclass(frozen=True)
class TokenDelta:
    """
    `(B, T)` float32 `delta`, detached, with its `active` mask (see `token_delta`) and, for a teacher with another
    tokenizer, the `span_ids` whose tokens share a span's delta.
    """

    delta: torch.Tensor
    active: torch.Tensor
    span_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, teacher_logps, old_logps, mask, span_ids=None) -> "TokenDelta":
        return cls(*token_delta(teacher_logps, old_logps, mask), span_ids)

    @classmethod
    def of_batch(cls, batch, old_logps) -> "TokenDelta":
        """A scored batch's delta against `old_logps`, on the tokens that carry one: active in `loss_mask`, with finite
        log-probabilities from the teacher, the rollout student and, under vLLM, the sampler (`sampler_logps`). The
        trainer computes it once per micro-batch; the advantage, the TV estimate and the statistics all read it."""
        delta = cls.of(batch["teacher_logps"], old_logps, batch["loss_mask"], batch.get("span_ids"))
        if "sampler_logps" in batch:
            delta = delta.where(torch.isfinite(batch["sampler_logps"]))
        return delta

    def where(self, keep: torch.Tensor) -> "TokenDelta":
        """The same delta on fewer tokens: `keep` (`(B, T)`, or `(B, 1)` for whole rows) and `active` both."""
        return replace(self, active=self.active & keep)

    def per_span(self, values: torch.Tensor):
        """`(values, active)` with one entry per span, from per-token `values` equal across each span's tokens."""
        if self.span_ids is None:
            return values, self.active
        return to_spans(values, self.active, self.span_ids)

    def per_token(self, span_values: torch.Tensor) -> torch.Tensor:
        """`per_span`'s inverse: each active token gets its span's value, 0 elsewhere."""
        if self.span_ids is None:
            return span_values
        return torch.where(self.active, broadcast_spans(span_values, self.span_ids), 0.0)
