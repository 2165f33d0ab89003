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
"""An optimizer step taken in buckets of parameters, a parameter larger than a bucket in flat slices, each copied just
before its part of the step: `update/norm` (`callbacks.UpdateNormCallback`) is measured so without a copy of all the
parameters, and the step is the one `optimizer.step()` takes, bit for bit (docs/precision.md, section 2)."""

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from transformers.optimization import Adafactor


# The optimizers whose step changes each parameter from its own gradient, its own state and its group's hyperparameters
# alone (their foreach and fused kernels are elementwise), and changes no state shared across parameters: a step over a
# subset of the parameters (the others without a gradient) is, for that subset, the full step, bit for bit
# (tests/test_update_norm.py checks each). Exact types: a subclass may step otherwise. Not LBFGS (one step over all
# parameters) nor SparseAdam (sparse gradients). torch's Adafactor and Muon are in its recent releases only.
_TORCH_PER_PARAMETER = ("Adafactor", "Adadelta", "Adagrad", "Adam", "Adamax", "AdamW", "ASGD", "Muon", "NAdam")
_TORCH_PER_PARAMETER += ("RAdam", "RMSprop", "Rprop", "SGD")
PER_PARAMETER_OPTIMIZERS = (
    *(getattr(torch.optim, name) for name in _TORCH_PER_PARAMETER if hasattr(torch.optim, name)),
    Adafactor,  # transformers'
)
# Those of them whose step is elementwise in the parameter too, so that a flat slice of a parameter, its gradient and
# its state tensors steps as that slice of the whole: not the Adafactors (factored row and column statistics) nor Muon
# (an orthogonalised matrix).
_ELEMENTWISE_OPTIMIZERS = tuple(
    optimizer for optimizer in PER_PARAMETER_OPTIMIZERS if optimizer.__name__ not in ("Adafactor", "Muon")
)
# A bucket of the bucketed step holds about this fraction of the trainable bytes
_BUCKET_FRACTION = 1 / 64
# Slices start at multiples of this many elements: torch's fused CPU kernels step a tensor's elements in SIMD vectors
# from its start and the remainder one by one, which rounds differently (fused multiply-add), so a slice must not move
# an element between the two (tests/test_update_norm.py)
_SLICE_ALIGNMENT = 64


def _local_tensor(param):
    if isinstance(param, DTensor):
        return param.to_local()
    return getattr(param, "ds_tensor", param)  # ZeRO-3 keeps the local partition in `ds_tensor`


def clone_locals(parameters):
    """A copy of the local part of each of `parameters`: the values from before a step, which it is measured against."""
    return [_local_tensor(p).detach().clone() for p in parameters]


def squared_updates(parameters, before):
    """The float32 squared norm of each parameter's change since `before` (from `clone_locals`), which this turns
    into the change in place rather than allocate another copy."""
    return [
        torch.linalg.vector_norm(old.sub_(_local_tensor(p).detach()), dtype=torch.float32).square()
        for p, old in zip(parameters, before, strict=True)
    ]


def _sliceable(optimizer, param):
    """Whether `optimizer` can step `param` in flat slices: an elementwise optimizer, a plain contiguous tensor (not a
    shard) with a gradient, and state tensors laid out as it is."""
    if type(optimizer) not in _ELEMENTWISE_OPTIMIZERS or isinstance(param, DTensor) or hasattr(param, "ds_tensor"):
        return False
    if param.grad is None:
        return False
    full = [v for v in optimizer.state.get(param, {}).values() if _is_full(v, param)]
    return all(t.is_contiguous() for t in [param, param.grad, *full])


def _is_full(value, param):
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0


def _buckets(optimizer, parameters):
    """
    Consecutive runs of `parameters` of at most `_BUCKET_FRACTION` of their local bytes each. A larger parameter is a
    bucket of its own, stepped in flat slices of at most that size (`_SLICE_ALIGNMENT`-aligned) when the optimizer can
    step it so (`_sliceable`), whole otherwise.

    Returns:
        `list[list[tuple]]`: each bucket's `(parameter, spans)`, with `spans` `None` for a whole parameter, or the
        `(start, stop)` bounds of its slices in its flattened values.
    """
    sizes = [_local_tensor(p).nbytes for p in parameters]
    budget = sum(sizes) * _BUCKET_FRACTION
    buckets, size = [], math.inf
    for p, nbytes in zip(parameters, sizes, strict=True):
        if size + nbytes > budget:
            buckets.append([])
            size = 0
        per_slice = int(budget // p.element_size()) // _SLICE_ALIGNMENT * _SLICE_ALIGNMENT  # elements
        if nbytes > budget and per_slice > 0 and _sliceable(optimizer, p):
            spans = [(start, min(start + per_slice, p.numel())) for start in range(0, p.numel(), per_slice)]
            buckets[-1].append((p, spans))
        else:
            buckets[-1].append((p, None))
        size += nbytes
    return buckets


def _step_in_slices(optimizer, step, param, spans):
    """
    Runs `step` once per slice of `param` (the elements `start:stop` of its flattened values), alone: for the call, a
    flat view of those elements takes the parameter's place in its group, with the same slice of its gradient and of
    each of its state tensors from before the step. Each slice starts from the state the whole step would start from,
    so a first step's lazily made state is made per slice and gathered into tensors of the parameter's shape; state
    without that shape (a step count) is given to each slice as a copy and kept from the last: every slice advances it
    alike. Each slice is copied just before its call, as a bucket is.

    Returns:
        `torch.Tensor`: the float32 squared norm of the parameter's update, summed over its slices.
    """
    state = optimizer.state[param]
    stepped_state, square = {}, 0
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    index = next(i for i, p in enumerate(group["params"]) if p is param)
    for start, stop in spans:
        view = param.detach().view(-1)[start:stop]
        view.grad = param.grad.view(-1)[start:stop]
        optimizer.state[view] = {
            key: value.view(-1)[start:stop] if _is_full(value, param) else _copy(value) for key, value in state.items()
        }
        before = clone_locals([view])
        group["params"][index] = view
        try:
            step()
        finally:
            group["params"][index] = param
            stepped = optimizer.state.pop(view)
        square = square + squared_updates([view], before)[0]
        del before
        for key, value in stepped.items():
            if not (isinstance(value, torch.Tensor) and value.shape == view.shape):
                stepped_state[key] = value
                continue
            if key not in stepped_state:  # the state's own tensor, or one for a lazily made state
                full = state.get(key)
                stepped_state[key] = full if _is_full(full, param) else torch.empty_like(param, dtype=value.dtype)
            target = stepped_state[key].view(-1)[start:stop]
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)
    optimizer.state[param] = stepped_state
    return square


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def step_in_buckets(optimizer, step, parameters):
    """
    Runs `step` (the step of `optimizer`, a per-parameter optimizer, see `PER_PARAMETER_OPTIMIZERS`) once per bucket
    of `parameters` (`_buckets`), with the gradients of the other buckets hidden (`None`, which the optimizer skips) and
    restored afterwards, even on an error. Each bucket is copied just before its call and the copy turned into its
    update right after, so that the update is measured with one bucket's memory instead of a copy of all parameters;
    the optimizer's own temporaries shrink to one bucket too. The realised step is that of one `step()` over all
    parameters, bit for bit.

    Returns:
        `dict`: each parameter -> the float32 squared norm of its update (of its local part when sharded).
    """
    gradients = {p: p.grad for p in parameters}
    buckets = _buckets(optimizer, parameters)
    squares = {}
    try:
        for p in parameters:
            p.grad = None
        for bucket in buckets:
            for p, _ in bucket:
                p.grad = gradients[p]
            param, spans = bucket[0]
            if spans is not None:  # a bucket of its own
                squares[param] = _step_in_slices(optimizer, step, param, spans)
            else:
                whole = [p for p, _ in bucket]
                before = clone_locals(whole)
                step()
                squares.update(zip(whole, squared_updates(whole, before), strict=True))
                del before  # before the next bucket's copy
            for p, _ in bucket:
                p.grad = None
    finally:
        for p, gradient in gradients.items():
            p.grad = gradient
    return squares


def steps_in_buckets(optimizer):
    """Whether accelerate's `optimizer` can take its step in buckets (`step_in_buckets`): its torch optimizer is a
    per-parameter one, and neither a gradient scaler (accelerate then swaps the optimizer's `step` for its own during
    the step) nor step hooks (they would run once per bucket) are in the way."""
    inner = getattr(optimizer, "optimizer", None)
    if type(inner) not in PER_PARAMETER_OPTIMIZERS or getattr(optimizer, "scaler", None) is not None:
        return False
    hooks = _global_optimizer_pre_hooks, _global_optimizer_post_hooks
    return not any(hooks + (inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks))
