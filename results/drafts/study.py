"""Study part nine of issue 59: which training objective gives the best speculative-decoding draft?

    python results/drafts/study.py --objective tv --seed 0 --measure_before --output results/drafts/study/tv_seed0.json

Every objective trains the same draft, SmolLM2-135M-Instruct's 4-layer cut (`truncated_draft`: embeddings, first 4 of
30 decoder layers, final norm and head), on the same prompts (the terse task's 572 training questions as plain user
turns, no few-shot turns, in the order the seed's sampler draws them: both trainers use TRL's `RepeatSampler` with the
same arguments), on its own rollouts at T = 1 (32 tokens, nothing truncated), with the whole target as the teacher,
`--prompts_per_step` prompts a step for `--steps` steps, one optimizer step per rollout batch, AdamW at
`--learning_rate` (constant, no weight decay, gradients clipped at norm 1), float32 on the CPU:

- `tv`: `TVOPDTrainer`, `advantage_mode="tv"` (TV-OPD), as `recipes/real/smollm2_draft.yaml` trains it.
- `raw`: `TVOPDTrainer`, `advantage_mode="raw"` (Raw OPD: the sampled token's log-ratio as its advantage).
- `kl`, `jsd`: TRL 1.16's `trl.DistillationTrainer` at `beta` 0.0 and 0.5. Its `beta` selects the divergence
  (trl/trainer/distillation_config.py:359-366, "0.0 = forward KL, 0.5 = JSD, 1.0 = reverse KL"), computed over the
  whole vocabulary at every completion position by `ChunkedDivergenceFunction` (trl/kernels/chunked_divergence.py):
  at 0.0 `t_weighted_gap / t_sum - t_log_z + s_log_z` (l. 482-483) = sum_v p_T (log p_T - log p_S), the forward
  KL(teacher || draft); in between `beta KL(p_T || m) + (1 - beta) KL(p_S || m)` with m = (1 - beta) p_S + beta p_T
  (l. 301-303), so 0.5 is the standard Jensen-Shannon divergence. The loss is the token mean over the batch
  (trl/trainer/distillation_trainer.py:212). This trainer has no `lmbda` (the on-policy fraction of GKD, which lives
  in `trl.experimental.gkd`): it is always fully on-policy, sampling every batch from the student
  (`_prepare_inputs`, l. 1778; `unwrapped_model.generate`, l. 1083).

Measured after training, and before with `--measure_before` (the untrained cut is the same for every objective, so
the study measures it once per seed): the acceptance rate at the verifier of transformers' assisted generation
(speculative sampling, gamma = 3, nothing truncated, 32 new tokens; `measure_assisted_acceptance`) on the first
`--held_out` held-out questions, at each of `--temperatures`, sampled from `--seed`. The learning curve holds each
logged step's (every 5 steps) loss (not comparable across objectives) and `tv/acceptance`, the trainer's estimate on
the draft's own rollouts: `TVOPDTrainer` logs it, and `OwnStateDistillationTrainer` computes the same estimate from the
hidden states TRL's loss already has. `--measure_every N` also measures the draft every N steps at the last
temperature (`results/drafts/saturation/`), and `--init fresh` trains a draft whose 4 decoder layers start anew, the
target's embeddings, final norm and head kept (`results/drafts/init/`).
"""

import argparse
import json
import os
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DistillationConfig, DistillationTrainer

from tvopd_trl import TVOPDConfig, TVOPDTrainer
from tvopd_trl.metrics import log_tv_estimate
from tvopd_trl.pretrained import model_path
from tvopd_trl.speculative import measure_assisted_acceptance, truncated_draft
from tvopd_trl.terse_task import conversation, questions
from tvopd_trl.tv import tv_estimate


GAMMA = 3
LAYERS = 4
BETAS = {"kl": 0.0, "jsd": 0.5}


def measure(target, draft, tokenizer, prompts, temperature=1.0, seed=0):
    """The acceptance rate of `draft` for `target` at transformers' verifier on `prompts` (plain user turns)."""
    start = time.monotonic()
    measured = measure_assisted_acceptance(
        target, draft.eval(), tokenizer, prompts, gamma=GAMMA, temperature=temperature, seed=seed
    )
    return {
        "acceptance": measured.acceptance,
        "interval": measured.interval,
        "tested": measured.tested,
        "seconds": time.monotonic() - start,
    }


def target_and_draft(layers, work, fresh=False):
    """The target's path, tokenizer and model (float32), and the path of its `layers`-layer cut saved under `work`;
    `fresh`: with its decoder layers initialised anew (as the model's config initialises them: normal weights of the
    config's `initializer_range`, norms at 1), the target's embeddings, final norm and head kept."""
    target_dir = str(model_path("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft_dir = os.path.join(work, "draft")
    draft = truncated_draft(target, layers)
    if fresh:
        for module in draft.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=draft.config.initializer_range)
            elif getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                torch.nn.init.ones_(module.weight)
    draft.save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    return target_dir, tokenizer, target, draft_dir


def training_prompts():
    """The terse task's training questions as conversational prompts without few-shot turns."""
    return Dataset.from_dict({"prompt": [conversation(q, False) for q in questions("train")]})


def training_settings(output_dir, prompts_per_step, learning_rate, steps, seed=0):
    """`DistillationConfig` fields (which `TVOPDConfig` extends) that every objective trains with."""
    return dict(
        output_dir=output_dir,
        temperature=1.0,
        max_completion_length=32,
        per_device_train_batch_size=prompts_per_step,
        gradient_accumulation_steps=1,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        max_steps=steps,
        max_grad_norm=1.0,
        weight_decay=0.0,
        seed=seed,
        logging_steps=5,
        report_to="none",
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )


class OwnStateDistillationTrainer(DistillationTrainer):
    """TRL's `DistillationTrainer`, also logging `tv/estimate` and `tv/acceptance` as `TVOPDTrainer` does: the pooled
    [1 - exp(log p_T(y) - log p_S(y))]_+ over the sampled completion tokens y (`tv_estimate`), from the last hidden
    states its loss computed, projected by each model's head: no extra forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hidden = {}

    def _get_last_hidden_state(self, unwrapped_model, *args, **kwargs):
        hidden = super()._get_last_hidden_state(unwrapped_model, *args, **kwargs)
        self._hidden[unwrapped_model] = hidden.detach()
        return hidden

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        output = super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        tokens = inputs["completion_ids"].unsqueeze(-1)
        with torch.no_grad():
            student, teacher = (
                (model.get_output_embeddings()(self._hidden.pop(model)).float() / self.temperature)
                .log_softmax(-1)
                .gather(-1, tokens)
                .squeeze(-1)
                for model in (unwrapped_student, self.accelerator.unwrap_model(self.teacher_model))
            )
        tv_sum, count = tv_estimate(teacher, student, inputs["completion_mask"])
        log_tv_estimate(self._metrics["train"], float(tv_sum), int(count))
        return output


class MeasuredCurve(TrainerCallback):
    """Measures the draft every `every` steps with `measure` (on its last temperature) into `curve`, under a forked
    random stream, so that the training run is the one it would be without."""

    def __init__(self, every, measure, curve):
        self.every, self.measure, self.curve = every, measure, curve

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            with torch.random.fork_rng():
                self.curve.append({"step": state.global_step, **self.measure(model, last_only=True)})
            # The trainer logs this step's training metrics only from a model in training mode
            model.train()


def objective_trainer(objective, draft_dir, target_dir, settings, train):
    """The trainer of `objective` on the draft at `draft_dir`, the target at `target_dir` as its teacher."""
    if objective in BETAS:
        config = DistillationConfig(**settings, beta=BETAS[objective])
        return OwnStateDistillationTrainer(model=draft_dir, teacher_model=target_dir, args=config, train_dataset=train)
    config = TVOPDConfig(**settings, advantage_mode=objective)
    return TVOPDTrainer(model=draft_dir, teacher_model=target_dir, args=config, train_dataset=train)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", choices=["tv", "raw", *BETAS], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts_per_step", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0], help="of the measurement")
    parser.add_argument("--held_out", type=int, default=24, help="held-out questions measured")
    parser.add_argument("--measure_before", action="store_true", help="also measure the untrained draft")
    parser.add_argument(
        "--init", choices=["cut", "fresh"], default="cut", help="the target's first layers, or new ones (seeded)"
    )
    parser.add_argument(
        "--measure_every", type=int, default=0, help="also measure at the last temperature every this many steps"
    )
    parser.add_argument("--output", required=True, help="JSON file of the results")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    work = tempfile.mkdtemp()
    target_dir, tokenizer, target, draft_dir = target_and_draft(LAYERS, work, fresh=args.init == "fresh")
    held_out = questions("test")[: args.held_out]

    def measure_all(draft, last_only=False):
        temperatures = args.temperatures[-1:] if last_only else args.temperatures
        return {str(t): measure(target, draft, tokenizer, held_out, t, args.seed) for t in temperatures}

    results = {"settings": {**vars(args), "layers": LAYERS, "gamma": GAMMA, "beta": BETAS.get(args.objective)}}
    if args.measure_before:
        results["before"] = measure_all(AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32))
    settings = training_settings(
        os.path.join(work, "run"), args.prompts_per_step, args.learning_rate, args.steps, args.seed
    )
    trainer = objective_trainer(args.objective, draft_dir, target_dir, settings, training_prompts())
    if args.measure_every:
        results["measured_curve"] = []
        trainer.add_callback(MeasuredCurve(args.measure_every, measure_all, results["measured_curve"]))
    start = time.monotonic()
    trainer.train()
    results["train_seconds"] = time.monotonic() - start
    results["seconds_per_step"] = results["train_seconds"] / trainer.state.global_step
    results["after"] = measure_all(trainer.model)
    results["logged"] = [
        {key: entry[key] for key in ("step", "loss", "grad_norm", "tv/acceptance") if key in entry}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "settings"}, indent=1))


if __name__ == "__main__":
    main()
