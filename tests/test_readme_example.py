"""The README's "Use it from Python" block, run as written: only the Hub is replaced, the models by the real
SmolLM2-135M-Instruct (`smollm2_dir`) and DAPO-Math-17K by a few of its problems, and the batch and lengths shrunk to
a step that fits this CPU. The precision is left as the block leaves it."""

import re
from pathlib import Path

import pytest
from datasets import Dataset


README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- python-example:"
PAPER_PAIR = {"model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "teacher_model": "hbx/JustRL-DeepSeek-1.5B"}
# open-r1/DAPO-Math-17k-Processed's `prompt` column: the problem as text
PROBLEMS = [
    "Find the sum of all positive integers $n$ such that $n^2 - 19n + 99$ is a perfect square.",
    "How many positive divisors does $6!$ have?",
]


def readme_example():
    text = README.read_text(encoding="utf-8")
    after = text[text.index(MARKER) :]
    return re.search(r"```python\n(.*?)```", after, flags=re.DOTALL).group(1)


@pytest.mark.long  # end to end on the real model: the test command runs it, the compatibility leg does not
def test_the_readme_python_example_trains(smollm2_dir, tmp_path, monkeypatch):
    import datasets

    import tvopd_trl

    real_config, real_trainer = tvopd_trl.TVOPDConfig, tvopd_trl.TVOPDTrainer
    loaded = []

    def load_dataset(name, config, split):
        loaded.append((name, config, split))
        rows = {"prompt": PROBLEMS, "solution": ["1", "30"], "data_source": ["dapo", "dapo"]}
        return Dataset.from_dict(rows)

    configs = []

    def config(**kwargs):
        assert kwargs["output_dir"] and kwargs["advantage_mode"] == "tv"
        assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 64
        small = dict(
            per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=8, max_steps=1
        )
        configs.append(real_config(**{**kwargs, **small, "output_dir": str(tmp_path), "report_to": "none"}))
        return configs[-1]

    trainers = []

    def trainer(model, teacher_model, **kwargs):
        assert {"model": model, "teacher_model": teacher_model} == PAPER_PAIR
        trainers.append(real_trainer(model=smollm2_dir, teacher_model=smollm2_dir, **kwargs))
        return trainers[-1]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(tvopd_trl, "TVOPDConfig", config)
    monkeypatch.setattr(tvopd_trl, "TVOPDTrainer", trainer)
    namespace = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)

    assert loaded == [("open-r1/DAPO-Math-17k-Processed", "all", "train")]
    (args,) = configs
    assert not args.bf16  # this CPU has no bf16: the config's default follows the machine
    (run,) = trainers
    assert run.state.global_step == 1 and namespace["trainer"] is run
    # The prompts the student trained on: one user turn, the problem and the evaluation's \boxed{} instruction
    prompts = namespace["prompts"]
    assert prompts.column_names == ["prompt"]
    assert prompts[0]["prompt"] == [
        {
            "role": "user",
            "content": f"{PROBLEMS[0]}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        }
    ]


def test_the_example_names_the_paper_s_first_pair():
    recipe = (README.parent / "recipes" / "justrl-1.5b_to_ds-distill-qwen-1.5b" / "tvopd.yaml").read_text()
    assert f"model_name_or_path: {PAPER_PAIR['model']}" in recipe
    assert f"teacher_model_name_or_path: {PAPER_PAIR['teacher_model']}" in recipe
    example = readme_example()
    assert all(f'"{name}"' in example for name in PAPER_PAIR.values())
    assert "dataset_config: all" in recipe and 'load_dataset("open-r1/DAPO-Math-17k-Processed", "all"' in example
