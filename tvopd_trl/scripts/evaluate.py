# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
`tvopd-trl eval`: the paper's evaluation of a model, or of every checkpoint of a run, on math benchmarks.

```bash
tvopd-trl eval --model Qwen/Qwen3-8B --benchmarks aime24,math500 --k 16 --output_dir eval/qwen3-8b
tvopd-trl eval --model outputs/my-run --k 16   # each checkpoint-N into outputs/my-run/eval/mean@16/step-N
tvopd-trl eval --model "$(python -c 'import tvopd_trl.tiny as t; print(t.student_path())')" --benchmarks tiny \
    --k 4 --max_new_tokens 16 --output_dir eval/tiny-student
```

Each evaluation writes `<benchmark>.jsonl` (one record per response), `results.json` and `table.md`.
"""

import glob
import json
import os
import re
from dataclasses import dataclass, field

from ..eval.benchmarks import PAPER_BENCHMARKS
from ..eval.generation import PAPER_MAX_NEW_TOKENS, PAPER_TEMPERATURE, PAPER_TOP_K, PAPER_TOP_P
from ..eval.grading import DEFAULT_TIMEOUT_SECONDS


@dataclass
class EvalArguments:
    r"""
    Arguments of `tvopd-trl eval`.

    Parameters:
        > Parameters that control what is evaluated

        model (`str`):
            Model id or path, or a run directory: then every `checkpoint-<N>` in it is evaluated into
            `<run>/eval/mean@<k>/step-<N>/`, skipping the benchmarks already evaluated there. A LoRA adapter's folder
            (a `--use_peft` run's) is evaluated on the base model its `adapter_config.json` names, merged into it.
        benchmarks (`str`, *optional*, defaults to the paper's six):
            Comma-separated benchmark names (`tvopd_trl.eval.BENCHMARKS`) or JSONL files with `id`, `problem`,
            `answer`.
        data_dir (`str`, *optional*):
            Where the paper's benchmarks are read from: a folder with `<benchmark>.jsonl` files, or `hub` for their
            Hub datasets. Defaults to the copies that ship with the package (offline).
        limit (`int`, *optional*):
            Evaluate only the first `limit` problems of each benchmark.
        output_dir (`str`, *optional*):
            Where a single model's evaluation is written. Defaults to `eval/<model name>`.
        student (`str`, *optional*):
            With a run directory: the model the run started from, evaluated as its step 0
            (`<run>/eval/mean@<k>/step-0/`), the "Student" row of `tvopd-trl report`. The main job writes it itself
            when it evaluates.
        shard (`str`, *optional*):
            `INDEX/COUNT`: with a run directory, only every COUNT-th of its checkpoints (step 0 included), from the
            INDEX-th (0-based): COUNT commands, one per GPU, evaluate a run between them (docs/first-real-run.md).

        > Parameters that control generation

        backend (`str`, *optional*, defaults to `"auto"`):
            `"transformers"` (batched `generate`), `"vllm"` (offline `LLM.generate`), or `"auto"`: vLLM when it is
            installed and a GPU is visible.
        k (`int`, *optional*, defaults to `16`):
            Samples per problem: the reported accuracy is mean@k.
        temperature, top_p, top_k, max_new_tokens, seed:
            Sampling settings; the defaults are the paper's (0.6, 0.95, 20, 31,744) and seed 0.
        prompt_template (`str`, *optional*):
            User turn with `{problem}` where the problem goes; defaults to each benchmark's own (the paper's
            benchmarks: the problem, then "Please reason step by step, and put your final answer within \\boxed{}.").
        chat_template_kwargs (`str`, *optional*):
            A JSON object passed to the chat template, as training's TRL option of that name: `'{"enable_thinking":
            false}'` evaluates Qwen3 without its thinking (trained so). Unset, the template's defaults (Qwen3 thinks).
        batch_size (`int`, *optional*, defaults to `64`):
            Sequences per `generate` call (transformers backend).
        dtype (`str`, *optional*, defaults to `"auto"`):
            Weights dtype, for both backends. `"auto"` is each backend's own choice: transformers keeps the
            checkpoint's dtype, vLLM serves a float32 checkpoint in 16 bits.
        vllm_tensor_parallel_size, vllm_gpu_memory_utilization, vllm_max_model_len:
            Passed to `vllm.LLM`.

        > Parameters that control grading and records

        workers (`int`, *optional*, defaults to `2`):
            Grading processes.
        grading_timeout (`float`, *optional*, defaults to `10`):
            Seconds allowed to grade one response; a timeout counts as wrong and is recorded as `"timeout"`.
        save_responses (`bool`, *optional*, defaults to `False`):
            Also write each full response into the records.
    """

    model: str = field(metadata={"help": "Model id or path, or a run directory with checkpoint-N folders."})
    benchmarks: str = field(default=",".join(PAPER_BENCHMARKS), metadata={"help": "Comma-separated benchmarks."})
    data_dir: str | None = field(
        default=None, metadata={"help": "Folder with <benchmark>.jsonl files, or hub (default: the packaged copies)."}
    )
    limit: int | None = field(default=None, metadata={"help": "First N problems of each benchmark only."})
    output_dir: str | None = field(default=None, metadata={"help": "Output folder of a single model's evaluation."})
    student: str | None = field(default=None, metadata={"help": "With a run: the model it started from (step 0)."})
    shard: str | None = field(default=None, metadata={"help": "INDEX/COUNT: with a run, every COUNT-th checkpoint."})
    backend: str = field(default="auto", metadata={"help": "transformers, vllm or auto."})
    k: int = field(default=16, metadata={"help": "Samples per problem (mean@k)."})
    temperature: float = field(default=PAPER_TEMPERATURE, metadata={"help": "Sampling temperature (0: greedy)."})
    top_p: float = field(default=PAPER_TOP_P, metadata={"help": "Top-p."})
    top_k: int = field(default=PAPER_TOP_K, metadata={"help": "Top-k."})
    max_new_tokens: int = field(default=PAPER_MAX_NEW_TOKENS, metadata={"help": "Generation budget per response."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    prompt_template: str | None = field(default=None, metadata={"help": "User turn with {problem}."})
    chat_template_kwargs: str | None = field(
        default=None, metadata={"help": "JSON object for the chat template, e.g. '{\"enable_thinking\": false}'."}
    )
    batch_size: int = field(default=64, metadata={"help": "Sequences per generate call (transformers)."})
    dtype: str = field(default="auto", metadata={"help": "Weights dtype (auto: vLLM serves float32 in 16 bits)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM GPU memory share."})
    vllm_max_model_len: int | None = field(default=None, metadata={"help": "vLLM context length."})
    workers: int = field(default=2, metadata={"help": "Grading processes."})
    grading_timeout: float = field(default=DEFAULT_TIMEOUT_SECONDS, metadata={"help": "Seconds per graded item."})
    save_responses: bool = field(default=False, metadata={"help": "Write full responses into the records."})


def _json_object(text, name):
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, such as '{{\"enable_thinking\": false}}' (got {text!r}).")
    return value


def _shard(text):
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"--shard is INDEX/COUNT with 0 <= INDEX < COUNT, such as 0/8 (got {text!r}).")
    return index, count


def checkpoints(run_dir):
    """`{step: path}` of the `checkpoint-<N>` folders of a run directory."""
    found = {}
    for path in glob.glob(os.path.join(run_dir, "checkpoint-*")):
        match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if match and os.path.isdir(path):
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _generator(args, model_path, benchmarks):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..eval import VLLMGenerator, local_generator
    from ..job import check_model_source

    check_model_source(model_path, "--model")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    adapter = os.path.isfile(os.path.join(model_path, "adapter_config.json"))
    backend = args.backend
    if backend == "auto":
        import importlib.util

        vllm = importlib.util.find_spec("vllm") and torch.cuda.is_available() and not adapter
        backend = "vllm" if vllm and not any(benchmark.generator for benchmark in benchmarks) else "transformers"
    if backend == "vllm":
        if any(benchmark.generator for benchmark in benchmarks):
            raise ValueError(
                f"{', '.join(b.name for b in benchmarks if b.generator)} is answered through a tool loop, which runs "
                "on the transformers backend: set `--backend transformers`."
            )
        if adapter:
            raise ValueError(
                f"{model_path} is a LoRA adapter, which the vllm backend does not load: evaluate it with `--backend "
                "transformers`, or merge it into its base model first (peft's `merge_and_unload`) and save that."
            )
        return VLLMGenerator(
            model_path,
            tokenizer,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len,
            dtype=args.dtype,
            seed=args.seed,
        )
    if backend != "transformers":
        raise ValueError(f"`backend` must be 'auto', 'transformers' or 'vllm' (got {backend!r}).")
    if adapter:
        from peft import AutoPeftModelForCausalLM

        # Merged, generation runs at the base model's speed.
        model = AutoPeftModelForCausalLM.from_pretrained(model_path, dtype=args.dtype).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    return local_generator(
        benchmarks, model.to("cuda" if torch.cuda.is_available() else "cpu"), tokenizer, args.batch_size
    )


def results_table(results):
    """A Markdown table of an evaluation's scores (mean@k in %, with its standard error)."""
    lines = [
        "| benchmark | problems | k | mean@k (%) | pass@k (%) | no answer | timeouts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, scores in results["benchmarks"].items():
        k, stderr = scores["k"], scores["stderr"]
        mean = f"{100 * scores[f'mean@{k}']:.2f}" + ("" if stderr is None else f" ± {100 * stderr:.2f}")
        lines.append(
            f"| {name} | {scores['problems']} | {k} | {mean} | {100 * scores[f'pass@{k}']:.2f} | "
            f"{scores['no_answer']} | {scores['timeouts']} |"
        )
    return "\n".join(lines) + "\n"


def main(args):
    from ..eval import SamplingSettings, evaluate, get_benchmark, load_problems, step_dir
    from ..eval.evaluate import check_protocol, evaluation_protocol, read_results

    settings = SamplingSettings(
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        chat_template_kwargs=_json_object(args.chat_template_kwargs, "--chat_template_kwargs"),
    )
    names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    for name in names:  # bad names and files fail before any model is loaded
        load_problems(get_benchmark(name), args.data_dir, args.limit)
    run_checkpoints = checkpoints(args.model) if os.path.isdir(args.model) else {}
    if (
        os.path.isdir(args.model)
        and not run_checkpoints
        and not any(os.path.isfile(os.path.join(args.model, name)) for name in ("config.json", "adapter_config.json"))
    ):
        raise ValueError(
            f"{args.model} is neither a model (no config.json) nor a run directory (no checkpoint-<N> folders): "
            "nothing to evaluate. Save checkpoints during training (`save_strategy`), or point at a model."
        )
    # What an evaluation folder records as the evaluated model: the run for a run's checkpoints (the step folder says
    # which one; `BenchmarkEvalCallback` does the same), else the model as named.
    if (args.student or args.shard) and not run_checkpoints:
        raise ValueError(
            f"--student and --shard go with a run directory (checkpoint-<N> folders); {args.model} is not one."
        )
    if run_checkpoints:
        run = os.path.abspath(args.model)
        if args.student:
            run_checkpoints = {0: args.student, **run_checkpoints}
        elif not os.path.isfile(os.path.join(step_dir(args.model, 0, args.k), "results.json")):
            print(
                f"{args.model} has no step-0 evaluation (the model it started from), which `tvopd-trl report` shows as "
                "its Student row: add --student MODEL to make it."
            )
        steps = list(run_checkpoints)
        if args.shard:
            index, count = _shard(args.shard)
            steps = steps[index::count]
        targets = [(run_checkpoints[step], step_dir(args.model, step, args.k), run) for step in steps]
    else:
        model_id = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
        output_dir = args.output_dir or os.path.join(
            "eval", os.path.normpath(args.model).strip("/").replace("/", "--")
        )
        targets = [(args.model, output_dir, model_id)]
    options = dict(
        data_dir=args.data_dir,
        limit=args.limit,
        prompt_template=args.prompt_template,
        workers=args.workers,
        timeout_seconds=args.grading_timeout,
        save_responses=args.save_responses,
    )
    todo = {}
    for _, output_dir, model_id in targets:  # every conflict is reported before any model loads
        previous = read_results(output_dir)
        if previous is not None:
            check_protocol(
                output_dir, previous, evaluation_protocol(settings, args.limit, args.prompt_template, model_id)
            )
        done = set(previous["benchmarks"]) if previous is not None else set()
        todo[output_dir] = [name for name in names if get_benchmark(name).name not in done]
    all_results = []
    for model_path, output_dir, model_id in targets:
        if not todo[output_dir]:
            print(f"{model_path}: {', '.join(names)} already evaluated in {output_dir}")
            all_results.append(read_results(output_dir))
            continue
        generator = _generator(args, model_path, [get_benchmark(name) for name in todo[output_dir]])
        results = evaluate(generator, todo[output_dir], settings, output_dir, model=model_id, **options)
        table = results_table(results)
        with open(os.path.join(output_dir, "table.md"), "w") as f:
            f.write(table)
        print(f"{model_path} -> {output_dir}\n{table}")
        all_results.append(results)
        # Before the next checkpoint's engine starts: a vLLM engine holds its memory share until it is shut down, and
        # the next one would not find that memory free.
        if hasattr(generator, "close"):
            generator.close()
    return all_results


def make_parser(prog=None):
    from ..job import RecipeParser

    return RecipeParser((EvalArguments,), prog=prog)


def run(argv=None):
    (args,) = make_parser(prog="tvopd-trl eval").parse_args_and_config(args=argv)
    main(args)
    return 0


if __name__ == "__main__":
    run()
