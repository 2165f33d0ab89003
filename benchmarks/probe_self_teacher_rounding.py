"""How far apart two forwards of the same weights put the same token's log-probability: the rounding a self-teacher's
sign tolerance (`TVOPDConfig.sign_tolerance`, docs/method.md section 13) must cover.

    OMP_NUM_THREADS=1 python benchmarks/probe_self_teacher_rounding.py [--rows 16] [--completion 16]

A live or frozen self-teacher scores a completion with the student's weights, but not in the forward that gave pi_old:
its batch is padded to other widths (the teachers' prompts), it runs whole rows where the student's loss runs Ulysses
shards, and the frozen copy is another tensor of the same values. Each model here scores `--rows` rows of the embedded
hint task's prompts, bare and hinted in turn (random completion tokens, seeded) four ways, with the trainer's own scoring
(`TVOPDTrainer._sampled_token_logps`, float32 log-probabilities from the model's compute dtype):
- **reference**: all rows in one batch, left-padded to the widest prompt;
- **padding +7 / +25**: the same batch with 7 or 25 more left-padding tokens (a teacher batch padded to a longer
  teacher prompt);
- **one row at a time**: each row alone, unpadded (another batch shape, as another micro-batch would be).
The table gives the largest and the 99th-percentile |difference| from the reference over the completion tokens, per
model and compute dtype: float32 weights, bf16 weights, fp16 weights, float32 weights under bf16 autocast (`bf16=True` on float32
weights). Models: the embedded hint student (2 layers, hidden 64) and a random Qwen2 of SmolLM2-135M's shape cut to
8 layers (hidden 576, 9 heads, 3 KV heads), both on the embedded tokenizer. Writes
benchmarks/results/probe_self_teacher_rounding.{json,md}.
"""

import argparse
import os
import sys
import tempfile


os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tvopd_trl.testing import tiny_config, tiny_pair_trainer  # noqa: E402
from tvopd_trl.tiny import hint_student_path  # noqa: E402
from tvopd_trl.tiny.hint_task import prompt_dataset  # noqa: E402


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def smollm2_shaped(vocabulary):
    config = Qwen2Config(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=vocabulary,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def scores(trainer, model, ids, mask, width, extra_padding=0):
    if extra_padding:
        ids = torch.nn.functional.pad(ids, (extra_padding, 0))
        mask = torch.nn.functional.pad(mask, (extra_padding, 0))
    with torch.no_grad():
        return trainer._sampled_token_logps(model, ids, mask, width)


def measure(model, bf16_autocast, rows, completion):
    tokenizer = AutoTokenizer.from_pretrained(hint_student_path(), padding_side="left")
    dataset = prompt_dataset("opd", rows)
    with tempfile.TemporaryDirectory() as out:
        args = tiny_config(out, bf16=bf16_autocast, per_device_train_batch_size=rows, use_cpu=True)
        trainer = tiny_pair_trainer(args, model=model, processing_class=tokenizer, train_dataset=dataset)
        model = trainer.model.eval()
        # Bare and hinted prompts alternate: rows of two lengths, left-padded in one batch
        prompts = [
            tokenizer.apply_chat_template(
                row["prompt" if index % 2 else "teacher_prompt"], add_generation_prompt=True, return_dict=False
            )
            for index, row in enumerate(dataset)
        ]
        generator = torch.Generator().manual_seed(0)
        completions = torch.randint(3, len(tokenizer), (rows, completion), generator=generator)
        width = max(map(len, prompts))
        prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        ids = torch.cat([prompt_ids, completions], dim=1)
        mask = torch.cat([prompt_mask, torch.ones_like(completions)], dim=1)
        reference = scores(trainer, model, ids, mask, completion)
        variants = {f"padding +{pad}": scores(trainer, model, ids, mask, completion, pad) for pad in (7, 25)}
        alone = [torch.tensor([p + c.tolist()]) for p, c in zip(prompts, completions, strict=True)]
        variants["one row at a time"] = torch.cat(
            [scores(trainer, model, row, torch.ones_like(row), completion) for row in alone]
        )
    return {
        name: {
            "max": (value - reference).abs().max().item(),
            "p99": (value - reference).abs().flatten().quantile(0.99).item(),
            "nonzero": (value != reference).float().mean().item(),
        }
        for name, value in variants.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--completion", type=int, default=16)
    options = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    vocabulary = len(AutoTokenizer.from_pretrained(hint_student_path()))
    models = {
        "hint student (2 layers, hidden 64)": lambda: Qwen2ForCausalLM.from_pretrained(hint_student_path()),
        "SmolLM2-135M shape, 8 layers (hidden 576)": lambda: smollm2_shaped(vocabulary),
    }
    precisions = {
        "float32": (torch.float32, False),
        "bf16 weights": (torch.bfloat16, False),
        "fp16 weights": (torch.float16, False),
        "float32 weights, bf16 autocast": (torch.float32, True),
    }
    results = []
    for model_name, build in models.items():
        for precision, (dtype, autocast) in precisions.items():
            measured = measure(build().to(dtype), autocast, options.rows, options.completion)
            for variant, values in measured.items():
                results.append({"model": model_name, "precision": precision, "variant": variant, **values})
                print(results[-1], flush=True)
    header = ["model", "precision", "variant", "max |diff| (nats)", "p99 |diff|", "share of tokens that differ"]
    table = common.markdown_table(
        header,
        [
            [r["model"], r["precision"], r["variant"], f"{r['max']:.2e}", f"{r['p99']:.2e}", f"{r['nonzero']:.0%}"]
            for r in results
        ],
    )
    machine = common.machine_info()
    print(table)
    common.write_outputs(
        RESULTS,
        "probe_self_teacher_rounding",
        {"machine": machine, "options": vars(options), "results": results},
        f"{table}\n\n{common.machine_markdown(machine)}",
    )


if __name__ == "__main__":
    main()
