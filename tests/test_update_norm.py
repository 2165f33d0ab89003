"""`update/norm` without a copy of all parameters: the bucketed optimizer step (`tvopd_trl.bucketed_step`), with large
parameters in slices, against the one step and the copy it replaces, on its own and in training; the copy kept for other
optimizers; `update_norm_interval`."""

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.optimization import Adafactor

from tvopd_trl import TVOPDTrainer, bucketed_step
from tvopd_trl.testing import tiny_config


SHAPES = [(40, 64), (64,), (16, 64), (3,), (24, 64), (8, 64), (5, 64)]  # 6,019 values

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
    assert tested == set(bucketed_step.PER_PARAMETER_OPTIMIZERS)


def squared_changes(parameters, before):
    """Each parameter's float32 squared change since `before`, a copy of them all: the measure the buckets replace."""
    return [
        torch.linalg.vector_norm(old.sub_(p.detach()), dtype=torch.float32).square()
        for p, old in zip(parameters, before, strict=True)
    ]


NOT_ELEMENTWISE = ("Adafactor", "Muon", "transformers-Adafactor")


@pytest.mark.parametrize("fraction", [0.0, 1 / 16], ids=["whole", "sliced"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_bucketed_step_is_the_full_step_bit_for_bit(name, fraction, monkeypatch):
    # 0: each parameter a bucket of its own; 1/16 (376 float32 values): the larger ones in slices of 320 (a multiple of
    # 64), from the first step, whose state the optimizer makes lazily
    monkeypatch.setattr(bucketed_step, "_BUCKET_FRACTION", fraction)
    shapes = [shape for shape in SHAPES if len(shape) == 2] if name == "Muon" else SHAPES  # Muon takes matrices
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    plain, bucketed = ([torch.nn.Parameter(t.clone()) for t in initial] for _ in range(2))
    optimizers = [
        OPTIMIZERS[name]([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}])
        for ps in (plain, bucketed)
    ]
    for _ in range(3):
        # The last parameter gets no gradient: it stays as it is
        for a, b in zip(plain[:-1], bucketed[:-1], strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        buckets = bucketed_step._buckets(optimizers[1], bucketed)
        assert len(buckets) > 2 and [p for bucket in buckets for p, _ in bucket] == bucketed
        sliced = {p: spans for bucket in buckets for p, spans in bucket if spans is not None}
        if fraction and name not in NOT_ELEMENTWISE:
            # the (40, 64), (16, 64), (24, 64) and (8, 64) parameters, each alone in a bucket
            assert [spans[-1] for spans in sliced.values()] == [(2240, 2560), (960, 1024), (1280, 1536), (320, 512)]
            assert all(len(bucket) == 1 for bucket in buckets if bucket[0][1] is not None)
        else:
            assert not sliced
        gradients = [p.grad for p in bucketed]
        before = [p.detach().clone() for p in plain]
        optimizers[0].step()
        exact = {
            b: (old - a.detach()).double().square().sum().item()
            for a, b, old in zip(plain, bucketed, before, strict=True)
        }
        expected = squared_changes(plain, before)
        squares = bucketed_step.step_in_buckets(optimizers[1], optimizers[1].step, bucketed)
        assert all(p.grad is g for p, g in zip(bucketed, gradients, strict=True))  # restored, the same tensors
        assert [p for group in optimizers[1].param_groups for p in group["params"]] == bucketed
        stepped = [b for a, b in zip(plain, bucketed, strict=True) if a in optimizers[0].state]
        assert list(optimizers[1].state) == stepped  # no slice left in it
        for a, b, square in zip(plain, bucketed, expected, strict=True):
            assert torch.equal(a, b)
            if b in sliced:
                # a sum over slices: equal to the exact sum to 1e-6 (the whole tensor's float32 sum is off by up to
                # 1.6e-6 here, the slices' by 1.4e-7)
                assert squares[b].item() == pytest.approx(exact[b], rel=1e-6)
            else:
                assert torch.equal(squares[b], square)
            assert optimizers[0].state[a].keys() == optimizers[1].state[b].keys()
            for key, value in optimizers[0].state[a].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizers[1].state[b][key])), key
    assert torch.equal(bucketed[-1], initial[-1])


def test_an_error_in_a_bucket_restores_every_gradient(monkeypatch):
    monkeypatch.setattr(bucketed_step, "_BUCKET_FRACTION", 0.0)
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
        bucketed_step.step_in_buckets(None, step, parameters)
    assert calls[0] == [p is parameters[0] for p in parameters]  # only the bucket's own gradients are present
    assert all(p.grad is g for p, g in zip(parameters, gradients, strict=True))


def test_an_error_in_a_slice_restores_the_parameter_its_state_and_every_gradient(monkeypatch):
    monkeypatch.setattr(bucketed_step, "_BUCKET_FRACTION", 1 / 16)
    parameters = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = torch.optim.AdamW(parameters)
    for p in parameters:
        p.grad = torch.randn(p.shape)
    optimizer.step()
    state = {p: {key: value.clone() for key, value in optimizer.state[p].items()} for p in parameters}
    gradients, values = [p.grad for p in parameters], [p.detach().clone() for p in parameters]
    step = optimizer.step

    def failing_step():
        if optimizer.param_groups[0]["params"][0] is not parameters[0]:  # the first parameter's first slice
            raise RuntimeError("boom")
        step()

    with pytest.raises(RuntimeError, match="boom"):
        bucketed_step.step_in_buckets(optimizer, failing_step, parameters)
    assert optimizer.param_groups[0]["params"] == parameters and list(optimizer.state) == parameters
    assert all(p.grad is g for p, g in zip(parameters, gradients, strict=True))
    for p, value in zip(parameters, values, strict=True):
        assert torch.equal(p, value)
        assert all(torch.equal(optimizer.state[p][key], before) for key, before in state[p].items())


def test_a_bucket_is_a_64th_of_the_bytes_a_larger_parameter_sliced_or_alone():
    small = [torch.nn.Parameter(torch.zeros(100)) for _ in range(640)]  # 400 bytes each
    assert [len(bucket) for bucket in bucketed_step._buckets(None, small)] == [10] * 64  # 1/64 of all = 4,000 bytes
    large = torch.nn.Parameter(torch.zeros(3000))  # 12,000 bytes, more than 1/64 (4,187.5 bytes)
    parameters = small[:320] + [large] + small[320:]
    for p in parameters:
        p.grad = torch.zeros_like(p)
    # AdamW steps it in slices of 1,024 values (1,046 rounded down to a multiple of 64); without an elementwise
    # optimizer it is stepped whole
    for optimizer, spans in ((torch.optim.AdamW(parameters), [(0, 1024), (1024, 2048), (2048, 3000)]), (None, None)):
        buckets = bucketed_step._buckets(optimizer, parameters)
        assert [len(bucket) for bucket in buckets] == [10] * 32 + [1] + [10] * 32
        assert buckets[32] == [(large, spans)]


# ----------------------------------------------------------------------------------------------------------------------
# In training
# ----------------------------------------------------------------------------------------------------------------------


class CopyReference(TrainerCallback):
    """`update/norm` as it was measured before the buckets, from a copy of every trainable parameter just before the
    step, per optimizer step: in `copied` as the copy measured it (each squared change in float32, summed in the model's
    order), in `norms` exactly (in float64)."""

    def __init__(self):
        self.before, self.copied, self.norms = None, [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        parameters = [p for p in model.parameters() if p.requires_grad]
        exact = sum((old - p.detach()).double().square().sum() for p, old in zip(parameters, self.before, strict=True))
        self.norms.append(exact.sqrt().item())
        squared = sum(squared_changes(parameters, self.before))
        self.copied.append(torch.as_tensor(squared, dtype=torch.float32).sqrt().item())


class CloneMeter:
    """Wraps `_clone_locals`: the bytes of each call, per optimizer step, and the most bytes alive at once; its
    callback also keeps the torch optimizer's own `step` attribute from the start of training (`None`: the class's)."""

    def __init__(self, monkeypatch):
        self.calls, self.live, self.peak, self.step, self.step_attribute = {}, 0, 0, None, None
        clone = bucketed_step.clone_locals

        def metered(parameters):
            copies = clone(parameters)
            nbytes = sum(t.nbytes for t in copies)
            self.calls.setdefault(self.step, []).append(nbytes)
            for t in copies:
                self.live += t.nbytes
                weakref.finalize(t, self._free, t.nbytes)
            self.peak = max(self.peak, self.live)
            return copies

        monkeypatch.setattr(bucketed_step, "clone_locals", metered)

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
    logged = list(norm_logs(trainer).values())
    assert logged == pytest.approx(reference.norms, rel=1e-6) and len(reference.norms) == 3

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    total = sum(p.nbytes for p in trainable)
    assert vars(trainer.optimizer.optimizer).get("step") is meter.step_attribute  # the optimizer's `step` is back
    if name == "copy":
        assert logged == reference.copied  # the copy's own value, bit for bit
        assert meter.calls == {step: [total] for step in (1, 2, 3)}
        return
    # A 64th of the bytes at most, the embedding (more than a 64th) in slices
    assert max(p.nbytes for p in trainable) > total / 64
    for calls in meter.calls.values():
        assert sum(calls) == total and len(calls) > 1 and max(calls) <= total / 64
    assert meter.peak <= total / 64  # at most one bucket is copied at once

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
    logs = norm_logs(trainer)
    assert logs.pop(6) is None and logs == pytest.approx({2: norms[0], 4: norms[3], 7: norms[6]}, rel=1e-6)
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
    assert norm_logs(trainer) == pytest.approx({3: (norms[0] + norms[2]) / 2, 6: norms[4]}, rel=1e-6)


class ScaledTrainer(TVOPDTrainer):
    # A c_k away from 1 on every step, so that the learning-rate target changes each step's learning rate
    rollout_scale = property(lambda self: 0.37, lambda self, value: None)


def test_the_learning_rate_target_composes_with_the_bucketed_step(make_trainer, model_dirs, tmp_path):
    reference = CopyReference()
    settings = dict(trainer_class=ScaledTrainer, tv_scale_target="learning_rate")
    trainer = train(make_trainer, model_dirs, tmp_path / "on", callbacks=[reference], **settings)
    assert list(norm_logs(trainer).values()) == pytest.approx(reference.norms, rel=1e-6)
    off = train(make_trainer, model_dirs, tmp_path / "off", log_update_norm=False, **settings)
    for (name, a), b in zip(trainer.model.named_parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [
        group["lr"] for group in off.optimizer.param_groups
    ]


def test_update_norm_interval_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="update_norm_interval must be >= 1, got 0.*log_update_norm=False"):
        tiny_config(tmp_path, update_norm_interval=0)
