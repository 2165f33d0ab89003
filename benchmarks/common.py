"""Shared code of the benchmarks in this folder: models, tokenizer, fixed rollouts, the trainers under test, step
timing, peak-memory measurement, subprocess workers, Markdown tables and machine information.

The benchmark scripts (`bench_step.py`, `bench_floor.py`, `bench_scaling.py`) import it from their own folder; each
re-runs itself with `--worker JOB` for every measurement that needs a fresh process.

Setup shared by every script
----------------------------
* Models: 2-layer Qwen2 (`transformers.Qwen2Config`), hidden H, MLP 2H, 4 attention heads, 2 KV heads, untied LM
  head (as DeepSeek-R1-Distill-Qwen-1.5B), float32, random initialisation. Student seed 0, teacher seed 1; the teacher
  has the student's architecture.
* Tokenizer: a `tokenizers` WordLevel vocabulary of exactly V tokens (`<pad>`, `<eos>`, `<unk>`, `t3` ... `t{V-1}`),
  whitespace pre-tokenization, left padding; student and teacher share it.
* Batch: B prompts of P tokens (default 4 x 64), completions of exactly T tokens (`min_new_tokens = max_new_tokens =
  T`, so EOS never ends one early), one optimizer step per rollout (per_device_train_batch_size = B, no gradient
  accumulation), sampling at temperature 1, top-k 0, top-p 1.
* Training arguments shared by all trainers: CPU, float32, no gradient checkpointing (TRL's configs default to it; it
  is off for every trainer here), constant learning rate 1e-5, AdamW as `transformers.Trainer` picks it, its default
  gradient clipping (max_grad_norm 1.0), no logging or saving inside the timed steps.
* Threads: `OMP_NUM_THREADS` (set to 1 when unset) and `torch.set_num_threads` to the same value.

The "loss phase" (the work boundary common to every trainer)
-------------------------------------------------------------
Everything after the completions exist, up to the end of the optimizer step: one `Trainer` optimizer step, timed from
`on_step_begin` to `on_step_end`, with the generation replaced by the fixed, pre-generated completions. For the TV-OPD
trainers that is the teacher scoring (in `_generate_and_score_completions`), the student forward and backward, the
gradient clipping, `optimizer.step()` and the trainer's own bookkeeping (callbacks, metrics); for
`DistillationTrainer` the teacher forward sits inside `compute_loss`, and for GKD inside `compute_loss` too. The
"full step" is the same step with each trainer's own transformers generation of the completions.
"""

import os


os.environ.setdefault("OMP_NUM_THREADS", "1")

import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402


THREADS = int(os.environ["OMP_NUM_THREADS"])
torch.set_num_threads(THREADS)

STUDENT_SEED, TEACHER_SEED, ROLLOUT_SEED = 0, 1, 2
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

TRAINERS = {
    "tv": "TVOPDTrainer(advantage_mode='tv')",
    "raw": "TVOPDTrainer(advantage_mode='raw')",
    "distill": "trl.DistillationTrainer(beta=1.0)",
    "gkd": "trl.experimental.gkd.GKDTrainer(beta=1.0)",
}

RESULT_PREFIX = "BENCH-RESULT "


# ----------------------------------------------------------------------------------------------------------------------
# One benchmark configuration
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    completion: int
    prompt: int = 64
    batch: int = 4
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0  # the MLP's width; 0 = 2 x hidden

    @property
    def name(self):
        return f"V{self.vocab}-H{self.hidden}-T{self.completion}-B{self.batch}"

    @property
    def completion_tokens(self):
        """Tokens trained on per optimizer step; the unit of every tokens-per-second figure."""
        return self.batch * self.completion


def grid(vocabs, hiddens, completions, prompt=64, batch=4):
    return [Shape(v, h, t, prompt, batch) for v in vocabs for h in hiddens for t in completions]


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer, models and the fixed rollout
# ----------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size):
    """A WordLevel tokenizer with exactly `vocab_size` tokens: `<pad>`, `<eos>`, `<unk>`, then `t3` ... `t{V-1}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_model(shape, seed, device=None, dtype=None):
    """A randomly initialised Qwen2 of `shape` (seed `seed`), in evaluation mode. `device` (default: CPU) is where its
    weights are created and initialised (a GPU builds a 1.5B model in seconds, a CPU in minutes); `dtype` (default
    float32) what they are cast to afterwards."""
    import contextlib

    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate or 2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(2048, shape.prompt + shape.completion),
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = Qwen2ForCausalLM(config)
    return (model.to(dtype) if dtype is not None else model).eval()


def rollout(shape, cache_dir):
    """The fixed rollout of `shape`: B random prompts of P tokens and the seed-0 student's sampled completions of
    exactly T tokens, `{"prompt_ids": (B, P), "completion_ids": (B, T)}`. Generated once, then read from
    `cache_dir`, so that every trainer and every process trains on the same token ids."""
    path = os.path.join(cache_dir, f"rollout-{shape.name}.pt")
    if os.path.exists(path):
        return torch.load(path)
    generator = torch.Generator().manual_seed(ROLLOUT_SEED)
    prompt_ids = torch.randint(3, shape.vocab, (shape.batch, shape.prompt), generator=generator)
    student = build_model(shape, STUDENT_SEED)
    torch.manual_seed(ROLLOUT_SEED)
    sequences = sample_exactly(student, prompt_ids, shape.completion)
    data = {"prompt_ids": prompt_ids, "completion_ids": sequences[:, shape.prompt :].contiguous()}
    assert data["completion_ids"].shape == (shape.batch, shape.completion)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(data, path)
    return data


def reasoning_lengths(cap, rows, at_cap=1):
    """Completion lengths distributed like a reasoning run's: lognormal with median `cap / 4` and sigma 1 (seeded),
    clipped to [1, cap], the first `at_cap` rows cut off at the cap."""
    generator = torch.Generator().manual_seed(ROLLOUT_SEED)
    lengths = (torch.randn(rows, generator=generator) + math.log(cap / 4)).exp().round().clamp(1, cap).long()
    lengths[:at_cap] = cap
    return lengths.tolist()


def ragged_rollout(shape, lengths):
    """A rollout of `shape`'s B prompts of P uniform (seeded) tokens and completions of `lengths` uniform tokens, each
    shorter than the cap (T) ending in `<eos>`: `{"prompt_ids": (B, P), "completion_ids": [B lists]}`. The loss phase's
    cost does not depend on which token ids it scores (see `bench_gpu.rollout`)."""
    generator = torch.Generator().manual_seed(ROLLOUT_SEED)
    prompt_ids = torch.randint(3, shape.vocab, (shape.batch, shape.prompt), generator=generator)
    completions = []
    for length in lengths:
        tokens = torch.randint(3, shape.vocab, (length,), generator=generator).tolist()
        completions.append(tokens if length == shape.completion else tokens[:-1] + [EOS_ID])
    return {"prompt_ids": prompt_ids, "completion_ids": completions}


# The layouts of the loss phase that `bench_packing.py` and `bench_gpu.py --packing` compare: padded; padding_free; and
# padding_free with forwards of at most one longest row's tokens (P + the cap), which keeps `sdpa`'s block-diagonal
# attention, quadratic in a forward's tokens, no costlier per token than the padded rows'.
PACKING_LAYOUTS = ("padded", "packed", "budget")


def packing_overrides(layout, shape):
    """The TVOPDConfig overrides of a `PACKING_LAYOUTS` layout at `shape` (T: the completions' cap)."""
    if layout == "padded":
        return {}
    budget = shape.prompt + shape.completion if layout == "budget" else None
    return {"padding_free": True, "max_tokens_per_micro_batch": budget}


def token_counts(shape, lengths):
    """(real tokens, padded tokens) of a rollout of completions of `lengths`, prompts included."""
    return sum(shape.prompt + n for n in lengths), shape.batch * (shape.prompt + max(lengths))


def sample_exactly(model, prompt_ids, new_tokens):
    """`model.generate` of exactly `new_tokens` tokens after each row of `prompt_ids` (no padding), sampled at
    temperature 1, top-k 0, top-p 1 (EOS never ends a row early); returns the (B, P + new_tokens) sequences."""
    with torch.no_grad():
        return model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )


# ----------------------------------------------------------------------------------------------------------------------
# The trainers under test
# ----------------------------------------------------------------------------------------------------------------------


class FixedBatchCollator:
    """GKD's batches: the fixed rollout as `input_ids` / `labels` (used when GKD does not generate, `lmbda=0`) and its
    prompts as `prompts` (what GKD generates from, `lmbda=1`). The dataset rows are ignored."""

    def __init__(self, data):
        prompt_ids, completion_ids = data["prompt_ids"], data["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        labels = input_ids.clone()
        labels[:, : prompt_ids.size(1)] = -100
        self.batch = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": labels,
            "prompts": prompt_ids,
            "prompt_attention_mask": torch.ones_like(prompt_ids),
        }

    def __call__(self, features):
        return {key: value.clone() for key, value in self.batch.items()}


def build_trainer(kind, shape, data, steps, output_dir, config_overrides=None, models=None):
    """A fresh trainer `kind` (a key of TRAINERS) on fresh seed-0 / seed-1 models, set to run `steps` optimizer
    steps per `train()` call, in loss-phase mode (see `use_fixed_completions`). `config_overrides` (a dict, default
    none) replaces or adds fields of the trainer's config, e.g. `{"log_update_norm": False}` for the TV-OPD trainers
    or `{"gradient_accumulation_steps": 4}`. `models` (default none): the (student, teacher) to train instead of fresh
    CPU float32 ones, e.g. built on a GPU by `build_model(shape, seed, device, dtype)`."""
    from datasets import Dataset

    tokenizer = build_tokenizer(shape.vocab)
    student, teacher = models or (build_model(shape, STUDENT_SEED), build_model(shape, TEACHER_SEED))
    prompts = [" ".join(tokenizer.convert_ids_to_tokens(row)) for row in data["prompt_ids"].tolist()]
    dataset = Dataset.from_dict({"prompt": prompts})
    shared = dict(
        output_dir=output_dir,
        per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=10**6,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        temperature=1.0,
    )
    shared.update(config_overrides or {})
    generation = dict(max_completion_length=shape.completion, generation_kwargs={"min_new_tokens": shape.completion})
    if kind in ("tv", "raw"):
        from tvopd_trl import TVOPDConfig, TVOPDTrainer

        trainer = TVOPDTrainer(
            model=student,
            teacher_model=teacher,
            args=TVOPDConfig(advantage_mode=kind, **generation, **shared),
            train_dataset=dataset,
            processing_class=tokenizer,
            teacher_processing_class=tokenizer,
        )
    elif kind == "distill":
        from trl import DistillationConfig, DistillationTrainer

        trainer = DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=DistillationConfig(beta=1.0, **generation, **shared),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    elif kind == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        trainer = GKDTrainer(
            model=student,
            teacher_model=teacher,
            args=GKDConfig(beta=1.0, lmbda=1.0, max_new_tokens=shape.completion, **shared),
            train_dataset=Dataset.from_dict({"prompt": prompts * steps}),
            processing_class=tokenizer,
            data_collator=FixedBatchCollator(data),
        )
        trainer.generation_config.min_new_tokens = shape.completion
    else:
        raise ValueError(f"unknown trainer {kind!r}; one of {sorted(TRAINERS)}")
    use_fixed_completions(trainer, kind, data, True)
    return trainer


def use_fixed_completions(trainer, kind, data, fixed):
    """`fixed=True`: the trainer's generation returns the pre-generated completions (loss phase); `False`: it
    generates with transformers (full step)."""
    if kind == "gkd":
        trainer.lmbda = 0.0 if fixed else 1.0  # GKD generates in `training_step` with probability lmbda
        return
    if not fixed:
        trainer.__dict__.pop("_generate_single_turn", None)
        return
    completion_ids = data["completion_ids"]  # (B, T), or B lists of uneven lengths (`ragged_rollout`)
    completion_ids = completion_ids.tolist() if torch.is_tensor(completion_ids) else completion_ids
    completions = {
        tuple(prompt): completion
        for prompt, completion in zip(data["prompt_ids"].tolist(), completion_ids, strict=True)
    }

    def fixed_completions(prompt_ids, *args, **kwargs):
        return [completions[tuple(ids)] for ids in prompt_ids]

    # DistillationTrainer._generate tokenizes the prompts, then calls this for the completion ids: replacing it on the
    # instance skips only the sampling; padding, metrics and (for TV-OPD) teacher scoring still run, inside the step.
    trainer._generate_single_turn = fixed_completions


def optimizer_state_bytes(trainer):
    """Bytes of what one optimizer step keeps per trainable parameter: the gradient and AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------------------


def _step_timer_class():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Seconds from `on_step_begin` to `on_step_end` of every optimizer step: batch preparation (generation or
        not), scoring, loss, backward, clipping, `optimizer.step()`, scheduler and the trainer's callbacks. With
        `synchronize`, both ends wait for the queued CUDA work first, so that a step's seconds are its own."""

        def __init__(self, synchronize=False):
            self.seconds = []
            self.synchronize = synchronize and torch.cuda.is_available()

        def on_step_begin(self, args, state, control, **kwargs):
            if self.synchronize:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.synchronize:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimer


def train_and_time(trainer, synchronize=False):
    """Runs `trainer.train()` (its `max_steps` steps) and returns each step's seconds (`synchronize`: each step's
    CUDA work included, see StepTimer)."""
    timer = _step_timer_class()(synchronize)
    trainer.add_callback(timer)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(timer)
    return timer.seconds


def rss_mb():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def reset_peak_rss():
    """Resets this process's peak resident set size (VmHWM); Linux >= 4.0. Returns False where it is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb():
    """Peak resident set size since the last `reset_peak_rss` (since the start without one)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024


def lifetime_peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def settle():
    gc.collect()


def measure_trainer_memory(kind, shape, data, steps, output_dir, full_step=True, config_overrides=None):
    """Peak RSS (and step times) of `steps` loss-phase steps of a fresh trainer (then, with `full_step`, of `steps`
    full steps), in this process, which must hold nothing else. Activation memory = peak - RSS after setup (both models, the trainer)
    - gradient and AdamW state of the student (`optimizer_state_bytes`): what the step itself adds. `config_overrides`
    as in `build_trainer`."""
    trainer = build_trainer(kind, shape, data, steps, output_dir, config_overrides)
    settle()
    result = {"setup_rss_mb": rss_mb(), "state_mb": optimizer_state_bytes(trainer) / 2**20}
    result["peak_reset_supported"] = reset_peak_rss()
    result["loss_seconds"] = train_and_time(trainer)
    result["loss_peak_rss_mb"] = peak_rss_mb()
    result["loss_activation_mb"] = result["loss_peak_rss_mb"] - result["setup_rss_mb"] - result["state_mb"]
    if full_step:
        use_fixed_completions(trainer, kind, data, False)
        settle()
        reset_peak_rss()
        result["full_seconds"] = train_and_time(trainer)
        result["full_peak_rss_mb"] = peak_rss_mb()
    result["lifetime_peak_rss_mb"] = lifetime_peak_rss_mb()
    return result


def summarize(seconds):
    """Median, min, max and count of a list of step times (None for an empty list)."""
    if not seconds:
        return None
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds), "n": len(seconds)}


# ----------------------------------------------------------------------------------------------------------------------
# Fresh-process workers
# ----------------------------------------------------------------------------------------------------------------------


def run_worker(script, job, timeout=None, launcher=(), env=None):
    """Runs `python script --worker JOB` in a fresh process and returns the dict it reports. A failure (an error, a
    crash, the kernel's OOM killer) comes back as `{"error": ...}` instead of raising, so one configuration that does
    not fit does not end the whole grid. `launcher`: arguments between the interpreter and the script, e.g.
    `["-m", "accelerate.commands.launch", "--config_file", PATH]`; `env`: the process's environment (default:
    this one's)."""
    command = [sys.executable, *launcher, script, "--worker", json.dumps(job)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    signal = f" (signal {-proc.returncode}{', likely out of memory' if proc.returncode == -9 else ''})"
    tail = (proc.stderr.strip().splitlines() or [""])[-1]  # the exception, for a Python error
    return {"error": f"exit {proc.returncode}{signal if proc.returncode < 0 else ''}: {tail}"}


def serve_worker(handlers):
    """Entry point of `script --worker JOB`: runs `handlers[job["task"]](job)` and prints its result for
    `run_worker`."""
    job = json.loads(sys.argv[2])
    job["shape"] = Shape(**job["shape"])
    result = handlers[job["task"]](job)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def is_worker():
    return len(sys.argv) > 2 and sys.argv[1] == "--worker"


def job(task, shape, **fields):
    return {"task": task, "shape": asdict(shape), **fields}


@functools.cache
def scratch_dir(prefix):
    """A temporary folder, one per prefix and process (trainers' `output_dir`, the rollout cache by default)."""
    return tempfile.mkdtemp(prefix=f"tvopd-bench-{prefix}-")


# ----------------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------------


def machine_info():
    import transformers
    import trl

    import tvopd_trl

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "tvopd_trl": getattr(tvopd_trl, "__version__", "unknown"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def machine_markdown(info):
    return "\n".join(f"- {key}: {value}" for key, value in info.items())


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, digits=3):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def write_outputs(out_dir, name, results, markdown):
    """Writes `name.json` (every raw number) and `name.md` (the printed report) to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")


def add_common_arguments(parser, default_out):
    parser.add_argument("--quick", action="store_true", help="the small validation configuration (about a minute)")
    parser.add_argument("--out", default=default_out, help="folder for the JSON, Markdown and PNG outputs")
    parser.add_argument("--cache-dir", default=None, help="folder of the fixed rollouts (default: a new temp folder)")


def add_grid_arguments(parser, rounds_help):
    """The grid overrides that `bench_step.py` and `bench_floor.py` share."""
    parser.add_argument("--vocab", type=int, nargs="+", help="override the grid's vocabulary sizes")
    parser.add_argument("--hidden", type=int, nargs="+", help="override the grid's hidden sizes")
    parser.add_argument("--completion", type=int, nargs="+", help="override the grid's completion lengths")
    parser.add_argument("--rounds", type=int, help=rounds_help)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (the first is dropped as warm-up)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-trainer memory processes")


def grid_config(cli, quick, full):
    """The script's configuration (`quick` or `full`) with the command line's grid overrides applied."""
    config = dict(quick if cli.quick else full)
    for key, flag in (("vocabs", "vocab"), ("hiddens", "hidden"), ("completions", "completion")):
        config[key] = getattr(cli, flag) or config[key]
    config["rounds"] = cli.rounds or config["rounds"]
    config["steps"] = cli.steps or config["steps"]
    return config


def start(cli):
    """(output folder, rollout cache folder, start time, machine info), after printing the machine."""
    out = os.path.join(cli.out, "quick") if cli.quick else cli.out
    cache_dir = cli.cache_dir or scratch_dir("rollouts")
    started = time.perf_counter()
    info = machine_info()
    print("## Machine\n\n" + machine_markdown(info) + "\n", flush=True)
    return out, cache_dir, started, info


def measure_memories(script, shape, kinds, cache_dir, tag):
    """Peak memory of each of `kinds` at `shape`, each in its own worker process of `script`."""
    memory = {}
    for kind in kinds:
        print(f"[{tag}] {shape.name}: memory of {kind}", file=sys.stderr, flush=True)
        memory[kind] = run_worker(script, job("memory", shape, kind=kind, cache_dir=cache_dir))
    return memory


def exponent(xs, ys):
    """Least-squares slope of log(y) on log(x); None with fewer than two positive points."""
    import numpy as np

    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and y > 0]
    if len(pairs) < 2:
        return None
    logs = np.log(np.array(pairs, dtype=float))
    return float(np.polyfit(logs[:, 0], logs[:, 1], 1)[0])
