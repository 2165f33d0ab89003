"""How often the LM head's precision decides sign(delta): `lm_head_precision="float32"` against `"model"`.

    OMP_NUM_THREADS=1 python benchmarks/probe_lm_head_precision.py            # both embedded pairs + 1.5B-shaped
    OMP_NUM_THREADS=1 python benchmarks/probe_lm_head_precision.py --quick    # a small validation size (seconds)

delta = log pi_teacher - log pi_student of each sampled token. The teacher's log-probabilities are computed once
(float32 weights and head); the student's come from three backbones and three heads:

    backbone  float32     float32 weights, no autocast (what the CPU trains with by default): the reference
              autocast    float32 weights under bf16 autocast (the single-GPU recipe's `bf16: true`)
              bf16        bf16 weights (DeepSpeed's and FSDP2's bf16 engines hold the module so)
    head      float32     float32 hidden states through a float32 head (TRL's `cast_lm_head_to_fp32`)
              model       the backbone's compute dtype for the operands, products summed in float32
                          (`tvopd_trl.chunked_logprob`, `compute_dtype`)
              bf16_logits bf16 operands and bf16 logits (TRL's head without the cast, autocast's own LM head):
                          shown for scale, not an option of the trainer

For each backbone, the fraction of active tokens whose sign(delta) differs between the `float32` and `model` heads
(what choosing the default risks), between `float32` and `bf16_logits`, and between each head and the float32
reference (the backbone's own bf16 rounding included), with the largest |log-probability| difference between heads.

Rollouts: the default embedded pair's and the long-addition pair's student sampling their OPD prompts at temperature
1 (the main job's settings); and a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 (hidden 1,536, 12 heads, 2 KV heads, MLP
8,960, vocabulary 151,936) with 2 layers, random weights (student seed 0, teacher seed 1), scoring uniformly drawn
completions (a random model samples about uniformly, and the scored ids do not change the arithmetic). Seeds fixed;
prints a Markdown table and writes benchmarks/results/probe_lm_head_precision.{json,md}.
"""

import argparse
import os

import common
import torch

from tvopd_trl.chunked_logprob import sampled_token_logprobs


REAL_SHAPE = dict(vocab=151936, hidden=1536, layers=2, heads=12, kv_heads=2, intermediate=8960)
FULL = dict(embedded=("tiny", "long-addition"), embedded_prompts=256, real=REAL_SHAPE, real_batch=2, real_prompt=64,
            real_completion=512)  # fmt: skip
QUICK = dict(embedded=("tiny",), embedded_prompts=16, real=dict(REAL_SHAPE, vocab=8192, hidden=128, heads=4,
             intermediate=256), real_batch=2, real_prompt=16, real_completion=32)  # fmt: skip
BACKBONES = ("float32", "autocast", "bf16")
HEADS = ("float32", "model", "bf16_logits")


def hidden_states(model, input_ids, attention_mask, keep, backbone):
    """The last hidden states predicting the `keep` completion tokens, and the compute dtype of `backbone`."""
    if backbone == "bf16":
        model = model.to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=backbone == "autocast"):
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    model.float()
    return hidden[:, -keep - 1 : -1], torch.float32 if backbone == "float32" else torch.bfloat16


def head_logps(model, hidden, targets, head, dtype):
    weight = model.lm_head.weight.detach()
    with torch.no_grad():
        if head == "bf16_logits":
            logits = hidden.to(torch.bfloat16) @ weight.to(torch.bfloat16).T
            return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        return sampled_token_logprobs(
            hidden, weight, None, targets, compute_dtype=torch.float32 if head == "float32" else dtype
        )


def compare(name, student, teacher, input_ids, attention_mask, keep):
    """The table's rows for one set of rollouts: every (backbone, head) against the others."""
    targets, active = input_ids[:, -keep:], attention_mask[:, -keep:].bool()
    teacher_hidden, _ = hidden_states(teacher, input_ids, attention_mask, keep, "float32")
    teacher_logps = head_logps(teacher, teacher_hidden, targets, "float32", torch.float32)
    signs, logps = {}, {}
    for backbone in BACKBONES:
        hidden, dtype = hidden_states(student, input_ids, attention_mask, keep, backbone)
        for head in HEADS if backbone != "float32" else ("float32",):
            logps[backbone, head] = head_logps(student, hidden, targets, head, dtype)[active]
            signs[backbone, head] = torch.sign(teacher_logps[active] - logps[backbone, head])
    delta = (teacher_logps[active] - logps["float32", "float32"]).abs()
    reference = signs["float32", "float32"]
    rows = []
    for backbone in BACKBONES[1:]:
        flips = {
            head: (signs[backbone, head] != signs[backbone, "float32"]).float().mean().item() for head in HEADS[1:]
        }
        rows.append(
            {
                "rollouts": name,
                "backbone": backbone,
                "tokens": int(active.sum()),
                "median_abs_delta": delta.median().item(),
                "flips_model_vs_float32_head": flips["model"],
                "flips_bf16_logits_vs_float32_head": flips["bf16_logits"],
                "max_abs_logp_diff_model_vs_float32_head": (logps[backbone, "model"] - logps[backbone, "float32"])
                .abs()
                .max()
                .item(),
                **{
                    f"flips_vs_reference_{head}_head": (signs[backbone, head] != reference).float().mean().item()
                    for head in HEADS
                },
            }
        )
    return rows


def embedded_rollouts(family, prompts):
    """The embedded `family`'s student, teacher and the student's sampled completions of its first OPD prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tvopd_trl import tiny

    paths, dataset, new_tokens = {
        "tiny": (
            dict(student=tiny.student_path(), teacher=tiny.teacher_path()),
            tiny.prompt_dataset("opd", prompts),
            8,
        ),
        "long-addition": (tiny.long_addition_paths(), tiny.prompt_dataset("opd", prompts, skill="long_addition"), 32),
    }[family]
    tokenizer = AutoTokenizer.from_pretrained(paths["student"], padding_side="left")
    student, teacher = (
        AutoModelForCausalLM.from_pretrained(paths[k], dtype=torch.float32).eval() for k in ("student", "teacher")
    )
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in dataset["prompt"]]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(common.ROLLOUT_SEED)
    with torch.no_grad():
        sequences = student.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    keep = sequences.size(1) - batch["input_ids"].size(1)
    completion = sequences[:, -keep:]
    # Active: up to and including the first end-of-sequence token
    ended = (completion == tokenizer.eos_token_id).long().cumsum(1)
    completion_mask = (ended == 0) | ((ended == 1) & (completion == tokenizer.eos_token_id))
    attention_mask = torch.cat([batch["attention_mask"], completion_mask.long()], dim=1)
    return student, teacher, sequences, attention_mask, keep


def real_vocabulary_rollouts(config):
    shape = common.Shape(
        config["real"]["vocab"], config["real"]["hidden"], config["real_completion"], config["real_prompt"],
        config["real_batch"], layers=config["real"]["layers"], heads=config["real"]["heads"],
        kv_heads=config["real"]["kv_heads"], intermediate=config["real"]["intermediate"],
    )  # fmt: skip
    student, teacher = common.build_model(shape, common.STUDENT_SEED), common.build_model(shape, common.TEACHER_SEED)
    generator = torch.Generator().manual_seed(common.ROLLOUT_SEED)
    input_ids = torch.randint(3, shape.vocab, (shape.batch, shape.prompt + shape.completion), generator=generator)
    return student, teacher, input_ids, torch.ones_like(input_ids), shape.completion


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_arguments(parser, os.path.join(os.path.dirname(__file__), "results"))
    cli = parser.parse_args()
    config = QUICK if cli.quick else FULL
    out, _, _, info = common.start(cli)
    rows = []
    for family in config["embedded"]:
        rows += compare(f"embedded {family}", *embedded_rollouts(family, config["embedded_prompts"]))
    real = config["real"]
    rows += compare(f"1.5B-shaped, {real['layers']} layers, V = {real['vocab']:,}", *real_vocabulary_rollouts(config))
    header = ["rollouts", "backbone", "tokens", "median |delta|", "flips model vs float32 head",
              "flips bf16 logits vs float32 head", "max |dlogp| model vs float32", "flips vs reference: float32 head",
              "model head", "bf16 logits"]  # fmt: skip
    table = common.markdown_table(
        header,
        [
            [row["rollouts"], row["backbone"], row["tokens"], common.fmt(row["median_abs_delta"])]
            + [f"{100 * row[k]:.3f}%" for k in ("flips_model_vs_float32_head", "flips_bf16_logits_vs_float32_head")]
            + [common.fmt(row["max_abs_logp_diff_model_vs_float32_head"])]
            + [f"{100 * row[f'flips_vs_reference_{head}_head']:.3f}%" for head in HEADS]
            for row in rows
        ],
    )
    markdown = "## Machine\n\n" + common.machine_markdown(info) + "\n\n## sign(delta) flips\n\n" + table
    print(table)
    common.write_outputs(out, "probe_lm_head_precision", {"machine": info, "config": config, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
