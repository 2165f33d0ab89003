"""The recipes in recipes/ parse into their configs and hold the paper's values; the prompt adapters they rely on.

Fast: no model is loaded. vLLM is made unimportable while recipes parse, so nothing here needs it.
"""

import re
import sys
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, load_dataset

from tvopd_trl.eval import DEFAULT_PROMPT_TEMPLATE
from tvopd_trl.prompts import PROMPT_COLUMNS, to_prompt_dataset


ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
TRAIN_DATA = Path(__file__).resolve().parent / "data" / "train"
DAPO, DEEPMATH = TRAIN_DATA / "dapo_math_17k_sample.jsonl", TRAIN_DATA / "deepmath_103k_sample.jsonl"
PAIRS = {"justrl-1.5b_to_ds-distill-qwen-1.5b": DAPO, "qwen3-8b_to_qwen3-8b-sft": DEEPMATH}
OPD_RECIPES = sorted(
    path
    for path in RECIPES.glob("*/*.yaml")
    if path.parent.name != "accelerate_configs" and path.name != "sft.yaml" and not path.name.startswith("study")
)
PAIR_RECIPES = [path for path in OPD_RECIPES if path.parent.name in PAIRS]
SFT_RECIPE = RECIPES / "qwen3-8b_to_qwen3-8b-sft" / "sft.yaml"
UNSTATED = "not stated in the paper"

# Keys in which the recipes of one pair may differ from its tvopd.yaml: the method and where it writes.
METHOD_KEYS = {"output_dir", "advantage_mode", "advantage_clip_low", "advantage_clip_high", "power_gamma"}
METHOD_KEYS |= {"tv_alpha", "tv_ema_decay", "tv_min_scale", "tv_eps"}
# ... and the vLLM variants in their rollout engine and, for a server on half the GPUs, their process layout, and in
# sampling ahead of the trainers (`max_staleness`).
VLLM_KEYS = {"use_vllm", "num_processes", "gradient_accumulation_steps", "max_staleness"}
# ... and a served teacher in where it runs.
SERVED_TEACHER_KEYS = {"teacher_model_server_url", "teacher_model_server_timeout", "teacher_model_init_kwargs"}
# ... and the sequence-parallel recipes in their accelerate config, the batch layout that keeps 64 prompts per step over
# SP groups, and the attention implementation Ulysses wraps; `<name>_<n>k.yaml` in its response length (n x 1024).
SEQUENCE_PARALLEL_KEYS = {"accelerate_config", "per_device_train_batch_size", "gradient_accumulation_steps"}
SEQUENCE_PARALLEL_KEYS |= {"attn_implementation", "parallelism_config_dp_shard_size"}
LONGER_RESPONSE_KEYS = {"max_completion_length"}
# ... and a LoRA recipe in its adapter, its learning rate and its one process (`<name>_lora.yaml`)
LORA_KEYS = {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "dtype", "learning_rate"}
LORA_KEYS |= {"accelerate_config", "per_device_train_batch_size"}


def load(path):
    return yaml.safe_load(path.read_text())


def rel(path):
    return str(path.relative_to(RECIPES))


@pytest.fixture
def without_vllm(monkeypatch):
    # A `None` entry makes `import vllm` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "vllm", None)


def check_launch_flags(flags):
    """Recipe keys a training script does not know go to `accelerate launch`: each must be one of its flags, and the
    named accelerate config must ship in recipes/accelerate_configs/."""
    from accelerate.commands.launch import launch_command_parser

    flags = list(flags)
    if "--accelerate_config" in flags:
        index = flags.index("--accelerate_config")
        name = flags[index + 1]
        assert (RECIPES / "accelerate_configs" / f"{name}.yaml").is_file(), f"no accelerate config named {name!r}"
        flags[index : index + 2] = ["--config_file", str(RECIPES / "accelerate_configs" / f"{name}.yaml")]
    _, unknown = launch_command_parser().parse_known_args([*flags, "train.py"])
    assert unknown == [], f"recipe keys that neither the script nor `accelerate launch` know: {unknown}"


def parse_opd(path, *flags):
    from tvopd_trl.scripts.train import make_parser

    # bf16 is refused at config construction on a machine without a GPU unless use_cpu is set
    return make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "true", *flags],
        return_remaining_strings=True,
        separate_remaining_strings=True,
    )


@pytest.mark.parametrize("path", OPD_RECIPES, ids=rel)
def test_every_opd_recipe_parses_into_tvopd_config(path, without_vllm):
    from tvopd_trl.config import TVOPDConfig

    _, training_args, model_args, config_remaining, cli_remaining = parse_opd(path)
    assert isinstance(training_args, TVOPDConfig)
    assert model_args.model_name_or_path == load(path).get("model_name_or_path")  # TRL's `ModelConfig` holds it
    assert training_args.advantage_mode == load(path)["advantage_mode"]
    assert cli_remaining == []
    check_launch_flags(config_remaining)


@pytest.mark.parametrize("path", [p for p in OPD_RECIPES if load(p).get("use_vllm")], ids=rel)
def test_vllm_recipes_parse_without_vllm_installed(path, without_vllm):
    _, training_args, *_ = parse_opd(path)
    # [tvopd_]vllm_<mode>.yaml, and tvopd_vllm_server_async.yaml: server mode, sampling ahead
    mode = path.stem.split("vllm_", 1)[1]
    assert training_args.use_vllm and training_args.vllm_mode == mode.removesuffix("_async")
    assert training_args.max_staleness == (1 if mode.endswith("_async") else 0)


def test_sft_recipe_parses_into_sft_config_and_builds_the_opd_student(without_vllm):
    from trl import SFTConfig
    from trl.scripts.sft import make_parser

    script_args, training_args, model_args, dataset_args, config_remaining, cli_remaining = (
        make_parser().parse_args_and_config(
            ["--config", str(SFT_RECIPE), "--use_cpu", "true"],
            return_remaining_strings=True,
            separate_remaining_strings=True,
        )
    )
    assert isinstance(training_args, SFTConfig)
    assert model_args.model_name_or_path == "Qwen/Qwen3-8B-Base"
    [dataset] = dataset_args.datasets
    assert (dataset.path, dataset.split) == ("open-thoughts/OpenThoughts3-1.2M", "train[:400000]")
    assert cli_remaining == []
    check_launch_flags(config_remaining)
    students = {load(path)["model_name_or_path"] for path in PAIR_RECIPES if path.parent == SFT_RECIPE.parent}
    assert students == {training_args.output_dir}


def accelerate_config_of(recipe):
    return load(RECIPES / "accelerate_configs" / f"{recipe['accelerate_config']}.yaml")


def sp_size(accelerate_config):
    return (accelerate_config.get("parallelism_config") or {}).get("parallelism_config_sp_size", 1)


def response_length(path):
    """`<name>_<n>k[_<engine>].yaml` samples responses of up to n x 1024 tokens; the paper's recipes, 16,384."""
    match = re.search(r"_(\d+)k(?:_|$)", path.stem)
    return int(match.group(1)) * 1024 if match else 16384


def prompts_per_step(recipe):
    # The sp_size processes of an SP group are one data-parallel replica: per_device_train_batch_size counts its rows.
    accelerate_config = accelerate_config_of(recipe)
    processes = recipe.get("num_processes", accelerate_config["num_processes"])
    replicas = processes // sp_size(accelerate_config)
    shards = recipe.get("parallelism_config_dp_shard_size")
    assert shards in (None, replicas), "a recipe's dp_shard_size must be its SP groups"
    return recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] * replicas


@pytest.mark.parametrize("path", PAIR_RECIPES, ids=rel)
def test_pair_recipes_hold_the_papers_hyperparameters(path):
    recipe = load(path)
    # The paper's hyperparameter table (appendix "Full Experimental Setup")
    assert prompts_per_step(recipe) == 64
    expected = {
        "max_prompt_length": 1024,
        "max_completion_length": response_length(path),
        "temperature": 1.0,
        "top_p": 1.0,
        "optim": "adamw_torch_fused",  # the paper's AdamW, in torch's fused kernel (tests/test_bf16_engine.py)
        # LoRA's optimal rate is about 10x full fine-tuning's (the LoRA recipe's header)
        "learning_rate": 1e-5 if recipe.get("use_peft") else 1e-6,
        "lr_scheduler_type": "constant_with_warmup",
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "bf16": True,
        "gradient_checkpointing": True,
        "num_iterations": 1,  # one rollout batch per optimizer step
        "steps_per_generation": 1,
    }
    assert {key: recipe.get(key) for key in expected} == expected
    if recipe["advantage_mode"] == "tv":
        assert (recipe["tv_ema_decay"], recipe["tv_min_scale"], recipe["tv_eps"]) == (0.95, 0.1, 1e-5)
    assert recipe["output_dir"] == f"outputs/{path.parent.name}/{path.stem}"
    # As the paper, these recipes evaluate their saved checkpoints offline; they shard with ZeRO-3, with or without
    # sequence parallelism.
    assert recipe["eval_problems"] == 0
    assert recipe["accelerate_config"] in (("single_gpu",) if recipe.get("use_peft") else ("zero3", "zero3_sp"))


@pytest.mark.parametrize("pair", PAIRS)
def test_recipes_of_a_pair_share_its_budget(pair):
    reference = load(RECIPES / pair / "tvopd.yaml")
    for path in sorted((RECIPES / pair).glob("*.yaml")):
        if path.name == "sft.yaml":
            continue
        recipe = load(path)
        allowed = METHOD_KEYS | (VLLM_KEYS if recipe.get("use_vllm") else set())
        allowed |= SERVED_TEACHER_KEYS if recipe.get("teacher_model_server_url") else set()
        allowed |= SEQUENCE_PARALLEL_KEYS if sp_size(accelerate_config_of(recipe)) > 1 else set()
        allowed |= LONGER_RESPONSE_KEYS if response_length(path) != 16384 else set()
        allowed |= LORA_KEYS if recipe.get("use_peft") else set()
        differing = {key for key in reference.keys() | recipe.keys() if reference.get(key) != recipe.get(key)}
        differing -= {key for key in differing if key.startswith("vllm_") and recipe.get("use_vllm")}
        assert differing <= allowed, f"{rel(path)} also changes {sorted(differing - allowed)}"


SP_CONFIGS = [path for path in (RECIPES / "accelerate_configs").glob("*.yaml") if sp_size(load(path)) > 1]


@pytest.mark.parametrize("path", SP_CONFIGS, ids=rel)
def test_sequence_parallel_accelerate_configs_add_up(path):
    """Ulysses runs through DeepSpeed's engine, and accelerate counts DeepSpeed's batch size with dp_shard_size: it must
    be the number of SP groups."""
    config = load(path)
    parallelism = config["parallelism_config"]
    assert config["distributed_type"] == "DEEPSPEED"
    assert parallelism.get("parallelism_config_sp_backend", "deepspeed") == "deepspeed"
    assert parallelism.get("parallelism_config_cp_size", 1) == 1
    shards = parallelism.get("parallelism_config_dp_shard_size", 1)
    assert shards * sp_size(config) == config["num_processes"], "dp_shard_size must be num_processes / sp_size"


@pytest.mark.parametrize("path", [p for p in PAIR_RECIPES if sp_size(accelerate_config_of(load(p))) > 1], ids=rel)
def test_sequence_parallel_recipes_fit_their_layout(path):
    recipe = load(path)
    config = accelerate_config_of(recipe)
    size = sp_size(config)
    # Each process samples 1/sp_size of its group's rollout rows, so sp_size divides them.
    rows_per_group = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    assert rows_per_group * recipe["steps_per_generation"] % size == 0
    # DeepSpeed checks that Ulysses wraps the attention the student was loaded with.
    implementation = config["parallelism_config"].get("parallelism_config_sp_attn_implementation", "sdpa")
    assert recipe.get("attn_implementation", "sdpa") == implementation
    # Neither packed rows nor a token budget per forward goes with Ulysses.
    assert not recipe.get("padding_free") and not recipe.get("max_tokens_per_micro_batch")


@pytest.mark.parametrize("pair", PAIRS)
def test_every_method_and_the_alpha_sweep_have_a_recipe(pair):
    folder = RECIPES / pair
    modes = {path.stem: load(path)["advantage_mode"] for path in folder.glob("*.yaml") if path.name != "sft.yaml"}
    for name, mode in {"tvopd": "tv", "sign": "sign", "raw": "raw", "clip": "clip", "power": "power"}.items():
        assert modes[name] == mode
    assert modes["vopd"] == "vopd"
    sweep = {
        float(path.stem.removeprefix("tvopd_alpha")): load(path)["tv_alpha"] for path in folder.glob("tvopd_alpha*")
    }
    assert all(alpha == float(value) for alpha, value in sweep.items())
    assert {*sweep, load(folder / "tvopd.yaml")["tv_alpha"]} == {0.0, 0.25, 0.5, 1.0}


def marked_unstated(lines, key):
    """Whether the line that sets `key`, or the comment block right above it, says the paper does not state it."""
    index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
    block = [lines[index]]
    while index > 0 and lines[index - 1].startswith("#"):
        index -= 1
        block.append(lines[index])
    return any(UNSTATED in line for line in block)


OUR_CHOICES = {"seed", "epsilon", "warmup_steps", "max_steps", "save_steps", "save_only_model"}
OUR_CHOICES |= {"advantage_clip_low", "advantage_clip_high", "power_gamma", "vllm_gpu_memory_utilization"}
SFT_CHOICES = {"seed", "attn_implementation", "datasets", "max_length", "packing", "assistant_only_loss", "optim"}
SFT_CHOICES |= {"per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type"}
SFT_CHOICES |= {"warmup_steps", "weight_decay", "max_grad_norm", "num_train_epochs"}


@pytest.mark.parametrize("path", [*PAIR_RECIPES, SFT_RECIPE], ids=rel)
def test_values_the_paper_does_not_state_are_marked(path):
    lines = path.read_text().splitlines()
    keys = SFT_CHOICES if path == SFT_RECIPE else OUR_CHOICES & load(path).keys()
    if path.parent.name == "justrl-1.5b_to_ds-distill-qwen-1.5b":
        keys = keys | {"dataset_prompt_column"}  # the paper names DeepMath's column, not DAPO's
    unmarked = sorted(key for key in keys if not marked_unstated(lines, key))
    assert not unmarked, f"{rel(path)}: mark {unmarked} `# {UNSTATED}`"


# ----------------------------------------------------------------------------------------------------------------------
# Prompt adapters, on copies of the shared training samples
# ----------------------------------------------------------------------------------------------------------------------


def sample(path):
    return load_dataset("json", data_files=str(path), split="train")


def test_dapo_chat_prompt_is_kept_as_is():
    raw = sample(DAPO)
    prompts = to_prompt_dataset(raw, "prompt")
    assert prompts.column_names == ["prompt"]  # OPD trains on prompts only
    assert prompts["prompt"] == raw["prompt"]
    assert prompts[0]["prompt"][0]["content"].startswith("Solve the following math problem step by step.")


def test_dapo_question_is_posed_with_the_evaluation_instruction():
    raw = sample(DAPO)
    prompts = to_prompt_dataset(raw, "question")
    for row, question in zip(prompts, raw["question"], strict=True):
        assert row["prompt"] == [{"role": "user", "content": DEFAULT_PROMPT_TEMPLATE.replace("{problem}", question)}]
    assert prompts[0]["prompt"][0]["content"].endswith("put your final answer within \\boxed{}.")


def test_the_prompt_column_is_found_when_none_is_named():
    assert to_prompt_dataset(sample(DAPO))["prompt"] == sample(DAPO)["prompt"]  # `prompt` comes first
    deepmath = sample(DEEPMATH)  # no `prompt` column: its `question` is used
    assert "prompt" not in deepmath.column_names and PROMPT_COLUMNS.index("question") == 1
    prompts = to_prompt_dataset(deepmath)
    assert len(prompts) == len(deepmath) == 200
    assert prompts[5]["prompt"][0]["content"].startswith(deepmath[5]["question"])


def test_the_teacher_id_column_survives_the_prompt_adapter():
    # A dataset for several teachers routes by `teacher_id`; the adapter drops every other column.
    raw = sample(DEEPMATH).select(range(4))
    raw = raw.add_column("teacher_id", ["algebra", "geometry", "algebra", "calculus"])
    prompts = to_prompt_dataset(raw, "question")
    assert sorted(prompts.column_names) == ["prompt", "teacher_id"]
    assert prompts["teacher_id"] == ["algebra", "geometry", "algebra", "calculus"]
    assert prompts[1]["prompt"][0]["content"].startswith(raw[1]["question"])


@pytest.mark.parametrize("pair", PAIRS)
def test_each_pair_recipes_prompt_column_fits_its_dataset_sample(pair):
    recipe = load(RECIPES / pair / "tvopd.yaml")
    prompts = to_prompt_dataset(sample(PAIRS[pair]), recipe["dataset_prompt_column"])
    assert all(row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"] for row in prompts)


def test_a_missing_column_names_the_columns_that_exist():
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are: id, question, final_answer"):
        to_prompt_dataset(sample(DEEPMATH), "problem")
    with pytest.raises(ValueError, match=r"no prompt column among the dataset's columns \(id, answer\)"):
        to_prompt_dataset(Dataset.from_dict({"id": ["a"], "answer": ["1"]}))


@pytest.mark.parametrize(
    "values, message",
    [
        ([["not", "messages"]], r"Row 0 of column 'question': expected a problem text or a list of chat messages"),
        (["Compute 1 + 1.", "  "], r"Row 1 of column 'question': the problem text is empty"),
    ],
)
def test_a_row_that_is_no_prompt_is_named(values, message):
    with pytest.raises(ValueError, match=message):
        to_prompt_dataset(Dataset.from_dict({"question": values}))


def test_a_template_without_the_problem_is_refused():
    with pytest.raises(ValueError, match=r"must contain '\{problem\}'"):
        to_prompt_dataset(sample(DEEPMATH), template="Solve it.")


class _Captured(Exception):
    pass


@pytest.fixture
def captured_dataset(monkeypatch):
    """Stops the main job where it would build the trainer, and keeps the dataset it would train on."""
    import tvopd_trl.trainer

    def stop(*args, train_dataset, **kwargs):
        raise _Captured(train_dataset)

    monkeypatch.setattr(tvopd_trl.trainer, "TVOPDTrainer", stop)


def run_main_job(tmp_path, *flags):
    from tvopd_trl import tiny
    from tvopd_trl.scripts.train import run

    run(
        [
            "--config",
            str(RECIPES / "tiny" / "tvopd.yaml"),
            "--output_dir",
            str(tmp_path),
            "--model_name_or_path",
            tiny.student_path(),
            "--teacher_model_name_or_path",
            tiny.teacher_path(),
            "--eval_problems",
            "0",
            *flags,
        ]
    )


def test_main_job_trains_on_the_adapted_prompt_column(tmp_path, captured_dataset):
    with pytest.raises(_Captured) as caught:
        run_main_job(tmp_path, "--dataset_name", str(DAPO), "--dataset_prompt_column", "question")
    [dataset] = caught.value.args
    assert dataset.column_names == ["prompt"] and len(dataset) == 59
    question = sample(DAPO)[0]["question"]
    assert dataset[0]["prompt"] == [
        {"role": "user", "content": DEFAULT_PROMPT_TEMPLATE.replace("{problem}", question)}
    ]


def test_main_job_names_the_columns_before_loading_a_model(tmp_path, captured_dataset):
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are: id, question, final_answer"):
        run_main_job(tmp_path, "--dataset_name", str(DEEPMATH), "--dataset_prompt_column", "problem")


def test_long_completion_recipes_share_one_budget():
    reference = load(RECIPES / "tiny" / "long_tvopd.yaml")
    recipes = sorted((RECIPES / "tiny").glob("long_*.yaml"))
    assert len(recipes) == 9
    for path in recipes:
        recipe = load(path)
        differing = {key for key in reference.keys() | recipe.keys() if reference.get(key) != recipe.get(key)}
        assert differing <= METHOD_KEYS, f"{rel(path)} also changes {sorted(differing - METHOD_KEYS)}"
        assert recipe["output_dir"] == f"outputs/tiny/{path.stem}" and recipe["embedded_task"] == "long_addition"
