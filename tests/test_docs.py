"""The documentation: generated references are up to date, links resolve, and the metric and config names it mentions
are the ones the code uses."""

import dataclasses
import importlib
import inspect
import os
import re
import sys

import pytest
import torch
from trl import DistillationConfig, ModelConfig, SFTConfig

from tvopd_trl import async_rollouts as async_rollouts_module
from tvopd_trl import callbacks as callbacks_module
from tvopd_trl import metrics as metrics_module
from tvopd_trl import rewards as rewards_module
from tvopd_trl import scoring as scoring_module
from tvopd_trl import trainer as trainer_module
from tvopd_trl.advantages import ADVANTAGE_MODES
from tvopd_trl.cli import COMMANDS
from tvopd_trl.config import TVOPDConfig
from tvopd_trl.eval import callback as eval_callback_module
from tvopd_trl.job import MainJobArguments
from tvopd_trl.metrics import advantage_dispersion
from tvopd_trl.scripts.doctor import DoctorArguments
from tvopd_trl.scripts.evaluate import EvalArguments
from tvopd_trl.served_teacher import TeacherServerPool


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The generators of the references are tools of the checkout, in scripts/, not modules of the package.
sys.path.insert(0, os.path.join(ROOT, "scripts"))
cli_reference = importlib.import_module("cli_reference")
config_reference = importlib.import_module("config_reference")
DOCS = os.path.join(ROOT, "docs")
DOC_PAGES = sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))
LINKED_PAGES = [os.path.join(ROOT, name) for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")] + DOC_PAGES
# Hand-written pages whose metric and config names are checked against the code.
PROSE_PAGES = [os.path.join(DOCS, f"{name}.md") for name in ("method", "modes", "migration", "troubleshooting")]


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose(text):
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _code_spans(text):
    return re.findall(r"`([^`\n]+)`", _prose(text))


# ----------------------------------------------------------------------------------------------------------------------
# Generated references
# ----------------------------------------------------------------------------------------------------------------------


def test_config_reference_is_not_stale():
    with open(config_reference.PATH, encoding="utf-8") as f:
        assert f.read() == config_reference.render(), (
            "docs/config-reference.md is stale: run `python scripts/config_reference.py`"
        )


def test_every_field_we_add_is_documented():
    inherited = {field.name for field in dataclasses.fields(DistillationConfig)}
    ours = {field.name for field in dataclasses.fields(TVOPDConfig)} - inherited
    documented_fields = config_reference.documented_fields
    assert ours and not ours - documented_fields(TVOPDConfig), ours - documented_fields(TVOPDConfig)
    for cls in (MainJobArguments, EvalArguments, DoctorArguments):
        fields = {field.name for field in dataclasses.fields(cls)}
        assert not fields - documented_fields(cls), (cls.__name__, fields - documented_fields(cls))


def test_cli_reference_is_not_stale():
    text = _read(cli_reference.PATH)
    assert text == cli_reference.render(), "docs/cli.md is stale: run `python scripts/cli_reference.py`"


def test_cli_reference_ignores_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_reference.render()
    monkeypatch.setenv("COLUMNS", "300")
    assert cli_reference.render() == narrow


def test_cli_reference_covers_every_command():
    text = cli_reference.render()
    for command in COMMANDS:
        assert command in cli_reference.EXAMPLES, f"add examples of `{command}` to scripts/cli_reference.py"
        assert f"## tvopd-trl {command}\n" in text
        assert f"usage: tvopd-trl {command} " in text, command
        examples, _ = cli_reference.EXAMPLES[command]
        assert examples and all(line.startswith(("tvopd-trl ", "    ")) for line in examples), command
        assert examples[0].startswith(f"tvopd-trl {command} "), command
    assert set(cli_reference.EXAMPLES) == set(COMMANDS), "examples for a command that does not exist"


# ----------------------------------------------------------------------------------------------------------------------
# Links
# ----------------------------------------------------------------------------------------------------------------------


def _slug(heading):
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(_read(path)), flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _relative_links(path):
    text = re.sub(r"`[^`\n]+`", "", _prose(_read(path)))
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img [^>]*src="([^"]+)"', text)
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path", LINKED_PAGES, ids=lambda path: os.path.relpath(path, ROOT))
def test_relative_links_and_anchors_resolve(path):
    broken = []
    for target in _relative_links(path):
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(resolved):
            broken.append(f"{target}: no such file")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    readme = _read(os.path.join(ROOT, "README.md"))
    section = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    index = _read(os.path.join(DOCS, "README.md"))
    for page in DOC_PAGES:
        name = os.path.basename(page)
        if name != "README.md":
            assert f"](docs/{name})" in section, f"README's Documentation section does not link docs/{name}"
            assert f"]({name})" in index, f"docs/README.md does not link {name}"
    for target in re.findall(r"\]\(([^)#\s]+)", section):
        assert os.path.exists(os.path.join(ROOT, target)), target


# ----------------------------------------------------------------------------------------------------------------------
# Names: metrics and config fields
# ----------------------------------------------------------------------------------------------------------------------

METRIC_GROUPS = (
    "tv",
    "advantage",
    "clip_ratio",
    "update",
    "kl",
    "sampling",
    "prompts",
    "teacher",
    "cross_tokenizer",
    "rewards",
    "completions",
)
METRIC = re.compile(rf"(?:eval_)?(?:{'|'.join(METRIC_GROUPS)})/[\w/@*<>]+|(?:eval_)?policy_loss|eval/[\w/@<>]+")


def _logged_metrics():
    """The metric names TVOPDTrainer records (its source is the source of truth), and those TRL's base trainer adds."""
    names = "|".join(METRIC_GROUPS[:-1])
    # The trainer logs its own metrics, those of `metrics.StepStatistics` and those of its callbacks
    source = "".join(
        inspect.getsource(module) for module in (trainer_module, metrics_module, callbacks_module, rewards_module)
    )
    ours = set(
        re.findall(rf'"((?:{names})/[\w/]+|policy_loss|entropy|reward|reward_std|frac_reward_zero_std)"', source)
    )
    # TRL GRPO's per-function reward metrics, `rewards/<func>/mean|std`
    ours |= {f"rewards/<func>/{key}" for key in re.findall(r'f"rewards/\{name\}/(\w+)"', source)}
    # Per teacher: `_scale_metric("tv/scale", index)` logs `tv/<teacher>/scale`; StepStatistics `kl/<teacher>/...`
    ours |= {f"tv/<teacher>/{key}" for key in re.findall(r'_scale_metric\("tv/(\w+)"', source)}
    ours |= {f"{group}/<teacher>/{key}" for group, key in re.findall(r'f"(kl|tv)/\{name\}/(\w+)"', source)}
    # A served teacher's request statistics (`TeacherServerPool.last_stats`), recorded by the scoring as `teacher/...`
    # (`teacher/<teacher>/...` with several teachers)
    scoring_source = inspect.getsource(scoring_module)
    assert 'f"teacher/{stat}"' in scoring_source and 'f"teacher/{teacher.name}/{stat}"' in scoring_source
    stats = re.findall(r'^\s+"(\w+)": ', inspect.getsource(TeacherServerPool.score), flags=re.M)
    ours |= {f"teacher/{stat}" for stat in stats} | {f"teacher/<teacher>/{stat}" for stat in stats}
    # A teacher with another tokenizer's alignment statistics, `cross_tokenizer/...` (`cross_tokenizer/<teacher>/...`)
    assert '"cross_tokenizer/" if len(self.teachers) == 1 else f"cross_tokenizer/{name}/"' in scoring_source
    aligned = re.findall(r'^\s+"(\w+)": .*(?:spans|largest|scored)', scoring_source, flags=re.M)
    ours |= {f"cross_tokenizer/{stat}" for stat in aligned} | {f"cross_tokenizer/<teacher>/{stat}" for stat in aligned}
    assert 'f"advantage/{name}"' in source
    ours |= {f"advantage/{name}" for name in advantage_dispersion(torch.zeros(0))}
    # Asynchronous rollouts' metrics (`max_staleness`), which the trainer's `AsyncRolloutMixin` records
    ours |= set(re.findall(r'"(async/[\w/]+)"', inspect.getsource(async_rollouts_module)))
    from trl.trainer import distillation_trainer

    trl_names = set(re.findall(r'_metrics\[mode\]\["(completions/\w+)"\]', inspect.getsource(distillation_trainer)))
    return ours, trl_names


def _unknown_metrics(name, ours, trl_names):
    if name.startswith("eval/"):  # BenchmarkEvalCallback's scores
        return name != "eval/<benchmark>/mean@k" or 'f"eval/{b.name}/mean@{k}"' not in inspect.getsource(
            eval_callback_module
        )
    name = name.removeprefix("eval_")
    if name.endswith("/*"):
        return not any(metric.startswith(name[:-1]) for metric in ours | trl_names)
    return name not in ours | trl_names


def test_method_page_documents_exactly_the_logged_metrics():
    ours, trl_names = _logged_metrics()
    assert {"tv/estimate", "tv/scale", "update/norm", "advantage/top1pct_energy", "policy_loss"} <= ours
    table = _read(os.path.join(DOCS, "method.md")).split("## 5. Metrics", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert not ours - rows, f"metrics the trainer logs but docs/method.md's table omits: {sorted(ours - rows)}"
    assert not rows - ours - {"eval/<benchmark>/mean@k"}, sorted(rows - ours)


@pytest.mark.parametrize("path", PROSE_PAGES, ids=os.path.basename)
def test_metric_names_in_the_docs_are_logged(path):
    ours, trl_names = _logged_metrics()
    mentioned = {span for span in _code_spans(_read(path)) if METRIC.fullmatch(span)}
    unknown = sorted(name for name in mentioned if _unknown_metrics(name, ours, trl_names))
    assert not unknown, f"{os.path.basename(path)} names metrics nobody logs: {unknown}"


def _fields(*classes):
    return {field.name for cls in classes for field in dataclasses.fields(cls)}


# snake_case names in the pages that are not config fields: API names, tensors, TRL functions.
OTHER_NAMES = {
    "compute_advantages",
    "decoupled_weight_decay",
    "extract_logprobs",
    "tv_estimate",
    "teacher_processing_class",
    "teacher_id",
    "old_logps",
    "teacher_logps",
    "prepare_deepspeed",
    "prepare_fsdp",
    "vllm_serve",
    "get_sequence_logprobs",
    "trainer_state",
    "grad_norm",  # TRL's metric
    "reward_std",  # TRL GRPO's metrics, logged with a task reward
    "frac_reward_zero_std",
    "vocab_size",  # a model config's
    "accelerate_config",  # a recipe key that `tvopd-trl train` passes to `accelerate launch`
    "teacher_model",  # the trainer's argument
    "teacher_prompt",  # a dataset column
    "num_items_in_batch",  # `compute_loss`'s argument
    "logit_scale",  # model config attributes
    "final_logit_softcapping",
    "eval_loss",  # TRL's metrics
    "num_tokens",
    "step_time",
}


def _config_names(path):
    """snake_case identifiers in code spans, alone or as `name=value` / `name: value`."""
    names = set()
    for span in _code_spans(_read(path)):
        match = re.fullmatch(r"([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\s*[=:].*)?", span)
        if match and not METRIC.fullmatch(span):
            names.add(match.group(1))
    return names


@pytest.mark.parametrize("path", PROSE_PAGES, ids=os.path.basename)
def test_config_field_names_in_the_docs_exist(path):
    known = _fields(TVOPDConfig, MainJobArguments, ModelConfig, EvalArguments) | set(ADVANTAGE_MODES) | OTHER_NAMES
    try:
        from tvopd_trl.scripts.doctor import DoctorArguments

        known |= _fields(DoctorArguments)
    except ImportError:
        pass
    if path.endswith("migration.md"):  # it maps other trainers' fields
        from trl.experimental.gkd import GKDConfig
        from trl.experimental.server_distillation import ServerDistillationConfig

        known |= _fields(GKDConfig, SFTConfig, ServerDistillationConfig)
    names = _config_names(path)
    assert {"tv_alpha", "tv_ema_decay"} & names or not path.endswith("method.md")
    assert not names - known, f"{os.path.basename(path)} names unknown fields: {sorted(names - known)}"
