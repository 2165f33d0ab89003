"""Checks that need a CUDA device: bf16 autocast and TRL's Triton fused log-prob head. Skipped on CPU-only machines."""

import math

import pytest
import torch

from .conftest import tiny_config


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_bf16_training_keeps_float32_log_probs(make_trainer, tmp_path):
    trainer = make_trainer(tiny_config(tmp_path, bf16=True, use_cpu=False, max_steps=3, log_exact_tv=True))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert inputs["teacher_logps"].is_cuda and inputs["teacher_logps"].dtype == torch.float32
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tv/scale" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) for entry in logs)
    # The on-policy estimate tracks the exact TV it estimates (both computed in float32 on device).
    assert all(abs(entry["tv/estimate"] - entry["tv/exact"]) < 0.1 for entry in logs)
