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
"""Exact full-vocabulary divergences per state, for vOPD's control variate and the `tv/exact` diagnostic."""

import torch
import torch.nn.functional as F


@torch.no_grad()
def exact_reverse_kl_and_tv(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: torch.nn.Linear,
    teacher_head: torch.nn.Linear,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Per-state reverse KL(q || p) and TV(q, p) between the student q and teacher p next-token distributions.

    The `(B, T, H)` hidden states are projected through each model's output head `chunk_size` positions at a time, in
    float32, so no `(B, T, V)` tensor is ever built.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: float32 `(B, T)` reverse KL and TV.
    """
    batch, length = student_hidden.shape[:2]
    student_hidden = student_hidden.reshape(batch * length, -1)
    teacher_hidden = teacher_hidden.reshape(batch * length, -1)
    student_weight, teacher_weight = student_head.weight.float(), teacher_head.weight.float()
    student_bias = None if student_head.bias is None else student_head.bias.float()
    teacher_bias = None if teacher_head.bias is None else teacher_head.bias.float()
    reverse_kl = student_hidden.new_empty(batch * length, dtype=torch.float32)
    tv = torch.empty_like(reverse_kl)
    for start in range(0, batch * length, chunk_size):
        rows = slice(start, start + chunk_size)
        # Outside autocast: the projection itself must run in float32.
        with torch.autocast(student_hidden.device.type, enabled=False):
            log_q = F.log_softmax(
                F.linear(student_hidden[rows].float(), student_weight, student_bias) / temperature, -1
            )
            log_p = F.log_softmax(
                F.linear(teacher_hidden[rows].float(), teacher_weight, teacher_bias) / temperature, -1
            )
        q = log_q.exp()
        reverse_kl[rows] = torch.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)  # 0 log 0 = 0
        tv[rows] = 0.5 * (q - log_p.exp()).abs().sum(-1)
    return reverse_kl.view(batch, length), tv.view(batch, length)
