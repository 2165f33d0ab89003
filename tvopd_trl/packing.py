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
"""Padding-free scoring (`padding_free=True`): the rows of a padded batch as one sequence, and back.

TRL's batches are `(B, L)`: prompts left-padded, completions right-padded. `pack_rows` keeps each row's real tokens,
back to back, with `position_ids` restarting at 0 on each row; transformers reads a restart as a sequence boundary
(`masking_utils.find_packed_sequence_indices`) and masks the rows from one another (a block-diagonal mask for `sdpa`,
`eager` and `flex_attention`, variable-length kernels for FlashAttention). The completion tokens are scored at the
packed positions that predict them, and `unpack_completions` puts the scores back into the `(B, T)` layout the rest of
the loss reads.
"""

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """A padded batch of `B` rows as one sequence of its `N` real tokens.

    Attributes:
        input_ids (`torch.Tensor`): `(1, N)`, the rows' real tokens back to back.
        position_ids (`torch.Tensor`): `(1, N)`, 0 to the row's length - 1 within each row.
        scored (`torch.Tensor`): `(B, T)` bool, the real completion tokens (those given a score).
        predictors (`torch.Tensor`): `(M,)`, the packed position whose output predicts each scored token, in the
            row-major order of `scored`.
        targets (`torch.Tensor`): `(M,)`, the scored tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    scored: torch.Tensor
    predictors: torch.Tensor
    targets: torch.Tensor


def pack_rows(input_ids, attention_mask, logits_to_keep):
    """Packs `(B, L)` `input_ids` whose real tokens `attention_mask` marks, of which the last `logits_to_keep` columns
    are the completions to score.

    A completion token is scored from the token before it, so a row with completion tokens needs a prompt token: one
    whose prompt tokenized to nothing (an empty plain-text prompt, a tokenizer that adds no BOS token) is refused, as
    nothing in its own row predicts its first token. A row with no token at all packs to nothing."""
    real = attention_mask.bool()
    check_predicted(real, logits_to_keep)
    # Position of each real token in the packed sequence, read off the row-major running count
    packed_index = real.flatten().cumsum(0).view_as(real) - 1
    position_ids = real.cumsum(dim=1) - 1
    scored = real[:, -logits_to_keep:]
    return PackedRows(
        input_ids=input_ids[real].unsqueeze(0),
        position_ids=position_ids[real].unsqueeze(0),
        scored=scored,
        predictors=packed_index[:, -logits_to_keep:][scored] - 1,
        targets=input_ids[:, -logits_to_keep:][scored],
    )


def check_predicted(real, logits_to_keep):
    """Refuses a row whose completion has no real token before it (its prompt tokenized to nothing): laid out without
    padding, nothing in the row would predict its first completion token."""
    unpredicted = real[:, -logits_to_keep:].any(dim=1) & ~real[:, :-logits_to_keep].any(dim=1)
    if unpredicted.any():
        raise ValueError(
            f"A prompt tokenized to nothing: row {unpredicted.nonzero()[0].item()} has no token before its first "
            "completion token, so nothing predicts that token. Give every prompt at least one token: drop empty "
            "prompts, use a chat template, or a tokenizer that adds a BOS token."
        )


def unpack_completions(values, packed):
    """`(M, ...)` values of the scored tokens back into the `(B, T, ...)` layout, 0 at padding (differentiable)."""
    out = values.new_zeros(*packed.scored.shape, *values.shape[1:])
    return out.index_put((packed.scored,), values)


def token_budget_chunks(lengths, max_tokens, count=None):
    """Consecutive slices of the rows of `lengths` (`(B,)`, the tokens each row costs a forward), each of at most
    `max_tokens` tokens (a longer row goes alone). With `count` (at most `B`), at least that many slices: the costliest
    are halved until there are."""
    chunks, start, tokens = [], 0, 0
    for end, length in enumerate(lengths.tolist()):
        if end > start and tokens + length > max_tokens:
            chunks.append((start, end))
            start, tokens = end, 0
        tokens += length
    chunks.append((start, len(lengths)))
    while count is not None and len(chunks) < count:
        index = max(
            (i for i, (a, b) in enumerate(chunks) if b - a > 1), key=lambda i: int(lengths[slice(*chunks[i])].sum())
        )
        a, b = chunks[index]
        chunks[index : index + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [slice(a, b) for a, b in chunks]
