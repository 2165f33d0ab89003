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
"""A teacher served by vLLM (`teacher_model_server_url`): the sampled tokens' log-probabilities through TRL's client."""

import math

import torch


def served_teacher_logps(client, batch, temperature):
    """
    The teacher server's float32 `(B, T)` log-probabilities of the sampled completion tokens of `batch` (0 at padding),
    on the CPU.

    One prefill request (`client.get_sequence_logprobs`, a TRL `VLLMClient`) scores each unpadded prompt + completion;
    vLLM always returns the log-probability of the actual token beside the top-1, so `top_logprobs=1` suffices. TRL's
    client reports a value the server did not give, or gave as NaN, as -inf; that is a missing value, not the teacher
    ruling the token out, so it becomes NaN here: the loss and the TV estimate drop the token and `tv/nonfinite_tokens`
    counts it.
    """
    prompt_mask = batch["prompt_mask"].bool().cpu()
    completion_mask = batch["completion_mask"].bool().cpu()
    prompt_ids, completion_ids = batch["prompt_ids"].cpu(), batch["completion_ids"].cpu()
    sequences = [
        prompt[p_mask].tolist() + completion[c_mask].tolist()
        for prompt, p_mask, completion, c_mask in zip(
            prompt_ids, prompt_mask, completion_ids, completion_mask, strict=True
        )
    ]
    result = client.get_sequence_logprobs(
        sequences, prompt_mask.sum(dim=1).tolist(), top_logprobs=1, temperature=temperature
    )
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for row, (values, length) in enumerate(zip(result["actual_logprobs"], completion_mask.sum(dim=1), strict=True)):
        if len(values) != length:
            raise RuntimeError(
                f"The teacher server returned {len(values)} log-probabilities for a completion of {int(length)} "
                "tokens; is it serving the same tokenizer as the student?"
            )
        logps[row, :length] = torch.tensor([value[0] for value in values], dtype=torch.float32)
    return torch.where(torch.isfinite(logps), logps, math.nan)
