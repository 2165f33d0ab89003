"""First runs toward issue 59's draft recipe: TV-OPD (and Raw OPD) on SmolLM2-135M-Instruct's 4-layer cut as a draft of
the whole model, with the acceptance rate measured before and after by transformers' assisted generation.

    python results/drafts/first_runs.py --mode tv --learning_rate 1e-4 --output results/drafts/tv_lr1e-4.json

The draft: the target's embeddings, first 4 of 30 decoder layers, final norm and head (`truncated_draft`). Training: the
terse task's 572 training questions without their few-shot turns (general chat prompts), the draft's own rollouts at
T = 1, 32 tokens, 8 prompts a step (`--prompts_per_step`), constant learning rate, 60 steps, seed 0, the target as the
teacher. Measured: the acceptance rate at the verifier of transformers' assisted generation (speculative sampling,
gamma = 3, T = 1, nothing truncated) on the first 24 held-out questions, 32 new tokens each, seed 0
(`measure_assisted_acceptance`).
"""

import argparse
import json
import os
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from tvopd_trl import TVOPDConfig, TVOPDTrainer
from tvopd_trl.pretrained import model_path
from tvopd_trl.speculative import measure_assisted_acceptance, truncated_draft
from tvopd_trl.terse_task import conversation, questions


def measure(target, draft, tokenizer, prompts):
    start = time.monotonic()
    measured = measure_assisted_acceptance(target, draft.eval(), tokenizer, prompts, gamma=3, temperature=1.0)
    return {
        "acceptance": measured.acceptance,
        "interval": measured.interval,
        "tested": measured.tested,
        "seconds": time.monotonic() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="tv", help="advantage_mode")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts_per_step", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output", required=True, help="JSON file of the results")
    args = parser.parse_args()
    torch.manual_seed(0)

    target_dir = str(model_path("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    work = tempfile.mkdtemp()
    draft_dir = os.path.join(work, "draft")
    truncated_draft(target, args.layers).save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    held_out = [
        tokenizer.apply_chat_template(conversation(q, False), tokenize=False, add_generation_prompt=True)
        for q in questions("test")[:24]
    ]
    before = measure(target, AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32), tokenizer, held_out)
    config = TVOPDConfig(
        output_dir=os.path.join(work, "run"),
        advantage_mode=args.mode,
        temperature=1.0,
        max_completion_length=32,
        per_device_train_batch_size=args.prompts_per_step,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        max_grad_norm=1.0,
        weight_decay=0.0,
        seed=0,
        logging_steps=5,
        report_to="none",
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    train = Dataset.from_dict({"prompt": [conversation(q, False) for q in questions("train")]})
    start = time.monotonic()
    trainer = TVOPDTrainer(model=draft_dir, teacher_model=target_dir, args=config, train_dataset=train)
    trainer.train()
    seconds = time.monotonic() - start
    after = measure(target, trainer.model, tokenizer, held_out)
    logged = [
        {key: entry[key] for key in ("step", "tv/estimate", "tv/acceptance") if key in entry}
        for entry in trainer.state.log_history
        if "tv/acceptance" in entry
    ]
    results = {"settings": vars(args), "before": before, "after": after, "train_seconds": seconds, "logged": logged}
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: results[k] for k in ("before", "after", "train_seconds")}, indent=1))


if __name__ == "__main__":
    main()
