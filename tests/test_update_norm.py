"""`update/norm` without a copy of all parameters: the bucketed optimizer step (`tvopd_trl.callbacks`) against the copy
it replaces, bit for bit, on its own and in training; the copy kept for other optimizers; `update_norm_interval`."""

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.optimization import Adafactor

from tvopd_trl import TVOPDTrainer
from tvopd_trl import callbacks as update_norm
from tvopd_trl.testing import tiny_config


SHAPES = [(40, 8), (8,), (16, 8), (3,), (24, 8), (8, 8), (5, 8)]

# Each optimizer of `_PER_PARAMETER_OPTIMIZERS`, with the options that change how it steps: two parameter groups
OPTIMIZERS = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, weight_decay=0.1),
    "AdamW-foreach": lambda groups: torch.optim.AdamW(groups, weight_decay=0.1, foreach=True),
    "AdamW-fused": lambda groups: torch.optim.AdamW(groups, weight_decay=0.1, fused=True),
    "Adam-amsgrad-foreach": lambda groups: torch.optim.Adam(groups, weight_decay=0.1, amsgrad=True, foreach=True),
    "Adam-decoupled": lambda groups: torch.optim.Adam(groups, weight_decay=0.1, decoupled_weight_decay=True),
    "SGD-momentum": lambda groups: torch.optim.SGD(groups, momentum=0.9, weight_decay=0.1),
    "SGD-nesterov-foreach": lambda groups: torch.optim.SGD(
        groups, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=True
    ),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, weight_decay=0.1, foreach=True),
    "RMSprop": lambda groups: torch.optim.RMSprop(groups, momentum=0.9, centered=True, weight_decay=0.1),
    "Adamax": lambda groups: torch.optim.Adamax(groups, weight_decay=0.1, foreach=True),
    "NAdam": lambda groups: torch.optim.NAdam(groups, weight_decay=0.1, foreach=True),
    "RAdam": lambda groups: torch.optim.RAdam(groups, weight_decay=0.1, decoupled_weight_decay=True),
    "Adadelta": lambda groups: torch.optim.Adadelta(groups, weight_decay=0.1, foreach=True),
    "ASGD": lambda groups: torch.optim.ASGD(groups, weight_decay=0.1, foreach=True),
    "Rprop": lambda groups: torch.optim.Rprop(groups, foreach=True),
    "Adafactor": lambda groups: torch.optim.Adafactor(groups, weight_decay=0.1, foreach=True),
    "Muon": lambda groups: torch.optim.Muon(groups, weight_decay=0.1),
    "transformers-Adafactor": lambda groups: Adafactor(groups, lr=1e-2, relative_step=False, weight_decay=0.1),
}


def test_the_tested_optimizers_are_the_allowlist():
    tested = {type(make([torch.nn.Parameter(torch.zeros(2, 2))])) for make in OPTIMIZERS.values()}
    assert tested == set(update_norm._PER_PARAMETER_OPTIMIZERS)


def squared_changes(parameters, before):
    """Each parameter's float32 squared change since `before`, a copy of them all: the measure the buckets replace."""
    return [
        torch.linalg.vector_norm(old.sub_(p.detach()), dtype=torch.float32).square()
        for p, old in zip(parameters, before, strict=True)
    ]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_bucketed_step_is_the_full_step_bit_for_bit(name, monkeypatch):
    monkeypatch.setattr(update_norm, "_BUCKET_FRACTION", 0.0)  # each bucket as large as the largest parameter
    shapes = [shape for shape in SHAPES if len(shape) == 2] if name == "Muon" else SHAPES  # Muon takes matrices
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    plain, bucketed = ([torch.nn.Parameter(t.clone()) for t in initial] for _ in range(2))
    optimizers = [
        OPTIMIZERS[name]([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}])
        for ps in (plain, bucketed)
    ]
    buckets = update_norm._buckets(bucketed)
    assert len(buckets) > 2 and [p for bucket in buckets for p in bucket] == bucketed
    for _ in range(3):
        # The last parameter gets no gradient: it stays as it is
        for a, b in zip(plain[:-1], bucketed[:-1], strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        gradients = [p.grad for p in bucketed]
        before = [p.detach().clone() for p in plain]
        optimizers[0].step()
        expected = squared_changes(plain, before)
        squares = update_norm._step_in_buckets(optimizers[1].step, bucketed)
        assert all(p.grad is g for p, g in zip(bucketed, gradients, strict=True))  # restored, the same tensors
        for a, b, square in zip(plain, bucketed, expected, strict=True):
            assert torch.equal(a, b) and torch.equal(squares[b], square)
            for key, value in optimizers[0].state[a].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizers[1].state[b][key])), key
    assert torch.equal(bucketed[-1], initial[-1])


def test_an_error_in_a_bucket_restores_every_gradient(monkeypatch):
    monkeypatch.setattr(update_norm, "_BUCKET_FRACTION", 0.0)
    parameters = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    for p in parameters:
        p.grad = torch.randn(p.shape)
    gradients = [p.grad for p in parameters]
    calls = []

    def step():
        calls.append([p.grad is not None for p in parameters])
        if len(calls) == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        update_norm._step_in_buckets(step, parameters)
    first = update_norm._buckets(parameters)[0]
    assert calls[0] == [any(p is q for q in first) for p in parameters]  # only the bucket's own gradients are present
    assert all(p.grad is g for p, g in zip(parameters, gradients, strict=True))


def test_a_bucket_is_a_64th_of_the_bytes_or_the_largest_parameter():
    small = [torch.nn.Parameter(torch.zeros(100)) for _ in range(640)]  # 400 bytes each
    assert [len(bucket) for bucket in update_norm._buckets(small)] == [10] * 64  # 1/64 of all = 4,000 bytes
    large = torch.nn.Parameter(torch.zeros(3000))  # 12,000 bytes, more than 1/64: the budget, never split
    buckets = update_norm._buckets(small[:320] + [large] + small[320:])
    assert [len(bucket) for bucket in buckets] == [30] * 10 + [20, 1] + [30] * 10 + [20]
    assert buckets[11] == [large]


# ----------------------------------------------------------------------------------------------------------------------
# In training
# ----------------------------------------------------------------------------------------------------------------------


class CopyReference(TrainerCallback):
    """`update/norm` as it was measured before the buckets: a copy of every trainable parameter just before the step,
    its squared change summed in the model's order, per optimizer step."""

    def __init__(self):
        self.before, self.norms = None, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        squared = sum(squared_changes([p for p in model.parameters() if p.requires_grad], self.before))
        self.norms.append(torch.as_tensor(squared, dtype=torch.float32).sqrt().item())


class CloneMeter:
    """Wraps `_clone_locals`: the bytes of each call, per optimizer step, and the most bytes alive at once; its
    callback also keeps the torch optimizer's own `step` attribute from the start of training (`None`: the class's)."""

    def __init__(self, monkeypatch):
        self.calls, self.live, self.peak, self.step, self.step_attribute = {}, 0, 0, None, None
        clone = update_norm._clone_locals

        def metered(parameters):
            copies = clone(parameters)
            nbytes = sum(t.nbytes for t in copies)
            self.calls.setdefault(self.step, []).append(nbytes)
            for t in copies:
                self.live += t.nbytes
                weakref.finalize(t, self._free, t.nbytes)
            self.peak = max(self.peak, self.live)
            return copies

        monkeypatch.setattr(update_norm, "_clone_locals", metered)

    def _free(self, nbytes):
        self.live -= nbytes

    def callback(self):
        meter = self

        class StepCounter(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                meter.step_attribute = vars(optimizer.optimizer).get("step")

            def on_step_begin(self, args, state, control, **kwargs):
                meter.step = state.global_step + 1

        return StepCounter()


class SubclassedAdamW(torch.optim.AdamW):
    """Not on the allowlist (a subclass may step otherwise): `update/norm` takes the copy."""


def train(make_trainer, model_dirs, tmp_path, optimizer=None, trainer_class=TVOPDTrainer, callbacks=(), **overrides):
    """A trained trainer on the tiny pair; `optimizer(parameters)` builds its optimizer (`None`: the config's)."""
    overrides = {"max_steps": 3, "weight_decay": 0.1, **overrides}
    kwargs = {}
    if optimizer is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
        kwargs = {"model": model, "optimizers": (optimizer(model.parameters()), None)}
    trainer = make_trainer(
        tiny_config(tmp_path, **overrides), trainer_class=trainer_class, callbacks=list(callbacks), **kwargs
    )
    trainer.train()
    return trainer


def norm_logs(trainer):
    return {entry["step"]: entry.get("update/norm") for entry in trainer.state.log_history if "tv/scale" in entry}


TRAINING_OPTIMIZERS = {
    "adamw_torch": None,  # the trainer's: decay and no-decay groups, for-loop on a CPU
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, weight_decay=0.1),
    "copy": lambda ps: SubclassedAdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", TRAINING_OPTIMIZERS)
def test_update_norm_equals_the_copy_and_the_step_is_unchanged(make_trainer, model_dirs, tmp_path, monkeypatch, name):
    optimizer = TRAINING_OPTIMIZERS[name]
    meter, reference = CloneMeter(monkeypatch), CopyReference()
    trainer = train(make_trainer, model_dirs, tmp_path / "on", optimizer, callbacks=[reference, meter.callback()])
    assert list(norm_logs(trainer).values()) == reference.norms and len(reference.norms) == 3

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    total = sum(p.nbytes for p in trainable)
    assert vars(trainer.optimizer.optimizer).get("step") is meter.step_attribute  # the optimizer's `step` is back
    if name == "copy":
        assert meter.calls == {step: [total] for step in (1, 2, 3)}
        return
    bucket = max(total / 64, max(p.nbytes for p in trainable))
    for calls in meter.calls.values():
        assert sum(calls) == total and len(calls) > 1 and max(calls) <= bucket
    assert meter.peak <= bucket < total / 2  # at most one bucket is copied at once

    # Without update/norm, the same parameters, bit for bit
    off = train(make_trainer, model_dirs, tmp_path / "off", optimizer, log_update_norm=False)
    for (parameter, a), b in zip(trainer.model.named_parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a, b), parameter


def test_update_norm_interval_logs_every_nth_step_averaged_over_the_logging_window(
    make_trainer, model_dirs, tmp_path, monkeypatch
):
    meter, reference = CloneMeter(monkeypatch), CopyReference()
    trainer = train(
        make_trainer,
        model_dirs,
        tmp_path,
        callbacks=[reference, meter.callback()],
        max_steps=7,
        update_norm_interval=3,
        logging_steps=2,
    )
    norms = reference.norms
    # Steps 1, 4 and 7 are measured; TRL averages a window's values, a window without one logs none
    assert norm_logs(trainer) == {2: norms[0], 4: norms[3], 6: None, 7: norms[6]}
    assert sorted(meter.calls) == [1, 4, 7]

    trainer = train(
        make_trainer,
        model_dirs,
        tmp_path / "window",
        callbacks=[reference := CopyReference()],
        max_steps=6,
        update_norm_interval=2,
        logging_steps=3,
    )
    norms = reference.norms
    assert norm_logs(trainer) == {3: (norms[0] + norms[2]) / 2, 6: norms[4]}


class ScaledTrainer(TVOPDTrainer):
    # A c_k away from 1 on every step, so that the learning-rate target changes each step's learning rate
    rollout_scale = property(lambda self: 0.37, lambda self, value: None)


def test_the_learning_rate_target_composes_with_the_bucketed_step(make_trainer, model_dirs, tmp_path):
    reference = CopyReference()
    settings = dict(trainer_class=ScaledTrainer, tv_scale_target="learning_rate")
    trainer = train(make_trainer, model_dirs, tmp_path / "on", callbacks=[reference], **settings)
    assert list(norm_logs(trainer).values()) == reference.norms
    off = train(make_trainer, model_dirs, tmp_path / "off", log_update_norm=False, **settings)
    for (name, a), b in zip(trainer.model.named_parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [
        group["lr"] for group in off.optimizer.param_groups
    ]


def test_update_norm_interval_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="update_norm_interval must be >= 1, got 0.*log_update_norm=False"):
        tiny_config(tmp_path, update_norm_interval=0)
