"""PPO clip fraction when each rollout batch is passed twice (num_iterations=2), on the tiny test models.

    OMP_NUM_THREADS=1 python benchmarks/clip_fraction.py

On the first pass over a rollout batch pi_theta == pi_old and nothing is clipped; on the second, the ratio has moved by
one optimizer step. Prints the mean clip_ratio/low and clip_ratio/high of the second-pass steps for two learning rates.
"""

import tempfile

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import build_model, build_tokenizer, tiny_config
from tvopd_trl.tiny import prompt_dataset


tok = build_tokenizer()
for lr in (3e-3, 1e-2):
    args = tiny_config(
        tempfile.mkdtemp(),
        num_iterations=2,
        per_device_train_batch_size=16,
        max_steps=20,
        max_completion_length=16,
        learning_rate=lr,
        lr_scheduler_type="constant",
    )
    tr = TVOPDTrainer(
        model=build_model(tok, 0, hidden_size=64),
        teacher_model=build_model(tok, 1, hidden_size=128),
        args=args,
        train_dataset=prompt_dataset("opd", n=1024),
        processing_class=tok,
        teacher_processing_class=tok,
    )
    tr.train()
    logs = [e for e in tr.state.log_history if "tv/scale" in e]
    second = logs[1::2]
    first = logs[0::2]
    lo = sum(e["clip_ratio/low"] for e in second) / len(second)
    hi = sum(e["clip_ratio/high"] for e in second) / len(second)
    first_pass = max(e["clip_ratio/low"] + e["clip_ratio/high"] for e in first)
    print(
        f"lr={lr}: second-pass clip_ratio/low={lo:.4f} high={hi:.4f} total={lo + hi:.4f}; first-pass max={first_pass}"
    )
