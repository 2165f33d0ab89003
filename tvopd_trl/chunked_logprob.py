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

"""The sampled token's log-probability through an LM head, for devices without Triton and for a head at the model's
precision.

On CUDA and XPU, `TVOPDTrainer` scores tokens with TRL's fused LM head by default, whose Triton kernels project only the
scored positions. Without Triton, TRL projects every position, prompt included, and folds each logits tile with
out-of-place torch operations, about eight tile-sized buffers at its peak (measured in `docs/performance.md`, section
6). This function does the same arithmetic in one reused tile: a running logsumexp and a gather going forward; the tile
recomputed and turned in place into the logits gradient going backward.

The tile is float32 whatever the operands' dtype (`compute_dtype`): with bf16 operands, the products are summed and
returned in float32 (`torch.mm(..., out_dtype=torch.float32)` on CUDA; elsewhere, where `aten::mm.dtype` does not
exist, each vocabulary chunk of the operands is upcast exactly), so that bf16 rounding of the logits themselves never
decides sign(delta), and no float32 copy of the whole head is ever made.
"""

import torch


# TRL's fused head and chunked divergence use the same width (`trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`)
VOCAB_CHUNK_SIZE = 32768


def _accumulation_dtype(hidden):
    return torch.promote_types(hidden.dtype, torch.float32)


def _matmul_fp32(out, a, b, accumulate=False):
    """`out = a @ b` (or `out += a @ b` with `accumulate`) for an `out` of float32 or wider: the products of `a` and
    `b` in their own dtype, summed in `out`'s."""
    if a.dtype != out.dtype and a.is_cuda:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        return
    a, b = a.to(out.dtype), b.to(out.dtype)  # exact: every bf16 or fp16 value is a float32 value
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _project(tile, hidden, weight, bias, start, temperature):
    """`tile = (hidden @ weight[start:].T + bias) / temperature`, one chunk of the vocabulary, at `hidden`'s dtype
    summed in the `tile`'s (float32, or float64 for float64 operands)."""
    end = start + tile.size(1)
    _matmul_fp32(tile, hidden, weight[start:end].to(hidden.dtype).t())
    if bias is not None:
        tile.add_(bias[start:end].to(tile.dtype))
    return tile.div_(temperature)


class ChunkedSampledLogProb(torch.autograd.Function):
    """`log_softmax((hidden @ weight.T + bias) / temperature)[n, targets[n]]` in float32, for `hidden` of shape
    `(N, H)` whose dtype the projection's operands take, and, with `with_entropy`, the entropy of each row's
    distribution (no gradient; `None` otherwise)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy=False):
        rows, dtype = torch.arange(hidden.size(0), device=hidden.device), _accumulation_dtype(hidden)
        logsumexp = hidden.new_full((hidden.size(0),), -torch.inf, dtype=dtype)
        target_logit = hidden.new_zeros(hidden.size(0), dtype=dtype)
        # sum_v p_v z_v, kept as a running average over the chunks weighted by their share of the mass
        mean_logit = hidden.new_zeros(hidden.size(0), dtype=dtype) if with_entropy else None
        buffer = hidden.new_empty(hidden.size(0), min(chunk_size, weight.size(0)), dtype=dtype)
        for start in range(0, weight.size(0), chunk_size):
            width = min(chunk_size, weight.size(0) - start)
            tile = _project(buffer[:, :width], hidden, weight, bias, start, temperature)
            local = targets - start
            inside = (local >= 0) & (local < width)
            target_logit = torch.where(inside, tile[rows, local.clamp(0, width - 1)], target_logit)
            chunk_max = tile.amax(dim=-1)
            chunk_sum = tile.sub_(chunk_max[:, None]).exp_().sum(dim=-1)
            chunk_logsumexp = chunk_sum.log().add_(chunk_max)
            updated = torch.logaddexp(logsumexp, chunk_logsumexp)
            if with_entropy:
                # In place, the tile's e = exp(z - max) becomes e * log(e) = e * (z - max): no second tile
                chunk_mean = torch.xlogy(tile, tile, out=tile).sum(dim=-1).div_(chunk_sum).add_(chunk_max)
                share = torch.exp(chunk_logsumexp - updated)
                mean_logit = mean_logit * (1 - share) + share * chunk_mean
            logsumexp = updated
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        entropy = logsumexp - mean_logit if with_entropy else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return target_logit - logsumexp, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        hidden, weight, bias, targets, logsumexp = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        rows, dtype = torch.arange(hidden.size(0), device=hidden.device), _accumulation_dtype(hidden)
        grad_hidden = torch.zeros_like(hidden, dtype=dtype) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs_bias else None
        buffer = hidden.new_empty(hidden.size(0), min(chunk_size, weight.size(0)), dtype=dtype)
        for start in range(0, weight.size(0), chunk_size):
            width = min(chunk_size, weight.size(0) - start)
            tile = _project(buffer[:, :width], hidden, weight, bias, start, temperature)
            # d logp / d logits = (1[target] - softmax) / temperature, times the incoming gradient
            tile.sub_(logsumexp[:, None]).exp_().mul_(-grad[:, None])
            local = targets - start
            inside = (local >= 0) & (local < width)
            tile[rows[inside], local[inside]] += grad[inside]
            tile.div_(temperature)
            # On CUDA the GEMM takes the logits' gradient at the operands' dtype, as the rest of a bf16 backward has it.
            # Elsewhere the operands are upcast anyway: the float32 tile is used as it is, without two more tiles.
            operand = tile.to(hidden.dtype) if hidden.is_cuda else tile
            if needs_hidden:
                _matmul_fp32(grad_hidden, operand, weight[start : start + width].to(hidden.dtype), accumulate=True)
            if needs_weight:
                _matmul_fp32(grad_weight[start : start + width], operand.t(), hidden, accumulate=True)
            if needs_bias:
                grad_bias[start : start + width] += tile.sum(dim=0)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def sampled_token_logprobs(
    hidden,
    weight,
    bias,
    targets,
    temperature=1.0,
    chunk_size=VOCAB_CHUNK_SIZE,
    return_entropy=False,
    compute_dtype=torch.float32,
):
    """Float32 log-probabilities of `targets` (any shape) given the matching `hidden` states (same shape + `(H,)`).

    The projection's operands (`hidden` and each chunk of the head) are cast to `compute_dtype`: float32 (the default)
    or the model's own dtype, for the same products without a float32 copy of the head. Either way the products are
    summed, and the softmax runs, in float32. With `return_entropy`, also the entropy of each position's distribution
    (same shape, detached), folded into the same pass over the vocabulary.
    """
    flat = hidden.reshape(-1, hidden.size(-1)).to(compute_dtype)
    logps, entropy = ChunkedSampledLogProb.apply(
        flat, weight, bias, targets.reshape(-1), temperature, chunk_size, return_entropy
    )
    if not return_entropy:
        return logps.view(targets.shape)
    return logps.view(targets.shape), entropy.view(targets.shape)
