"""What a build records of its inputs and outputs (`tvopd_trl.tiny.provenance`), and the records CI skips rebuilds by
(`.ci/rebuilds/`): an unchanged build is recognised, and any changed input is named."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tvopd_trl.tiny import provenance


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("pair", "multi-teacher", "long-addition", "vllm", "cross-tokenizer", "tools")
OPTIONS = {"seed": 0, "student_max_dev_accuracy": None, "total_steps": None, "keep_checkpoints": False}


def test_the_same_inputs_are_unchanged_and_each_changed_one_is_named():
    record = {"inputs": provenance.build_inputs("vllm", OPTIONS)}
    assert "tvopd_trl.tiny.provenance" in record["inputs"]["sources"]
    assert provenance.changed_inputs(record, "vllm", OPTIONS) == []

    assert provenance.changed_inputs(record, "pair", OPTIONS) == ["family: 'vllm' then, 'pair' now"]
    assert provenance.changed_inputs(record, "vllm", {**OPTIONS, "seed": 1})[0].startswith("overrides: ")

    stale = json.loads(json.dumps(record))
    stale["inputs"]["sources"]["tvopd_trl.tiny.task"]["sha256"] = "0" * 64
    stale["inputs"]["packages"]["torch"] = "2.0.0"
    stale["inputs"]["cpu_capability"] = "NO AVX"
    changes = provenance.changed_inputs(stale, "vllm", OPTIONS)
    assert changes[:2] == [
        f"packages: {stale['inputs']['packages']!r} then, {record['inputs']['packages']!r} now",
        f"cpu_capability: 'NO AVX' then, {record['inputs']['cpu_capability']!r} now",
    ]
    assert changes[2:] == [f"{os.path.join('tvopd_trl', 'tiny', 'task.py')} changed"]

    gone = json.loads(json.dumps(record))
    gone["inputs"]["sources"]["tvopd_trl.tiny.gone"] = {"file": "tvopd_trl/tiny/gone.py", "sha256": "0" * 64}
    assert provenance.changed_inputs(gone, "vllm", OPTIONS)[0].startswith("a recorded module no longer imports: ")
    assert provenance.changed_inputs({"settings": {}}, "vllm", OPTIONS) == [
        "the record holds no inputs (a build before provenance was recorded)"
    ]


def test_outputs_are_every_written_file_but_the_summary(tmp_path):
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "build.json").write_text("{}")
    assert provenance.build_outputs(tmp_path) == {
        os.path.join("student", "model.safetensors"): hashlib.sha256(b"weights").hexdigest()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_record_of_a_rebuild_with_the_default_options(family):
    """CI checks a family's bounds on its record when the inputs are unchanged: each record is a whole build.json of
    the builder's command line with no option but `--family`, with the files it wrote."""
    with open(os.path.join(ROOT, ".ci", "rebuilds", f"{family}.json")) as f:
        record = json.load(f)
    assert record["inputs"]["family"] == family and record["inputs"]["overrides"] == OPTIONS
    assert any(path.endswith("model.safetensors") for path in record["outputs"])


@pytest.mark.compat_skip
def test_the_builder_reports_whether_its_inputs_changed(tmp_path):
    record = tmp_path / "build.json"
    record.write_text(json.dumps({"inputs": provenance.build_inputs("vllm", OPTIONS)}))
    command = [sys.executable, "-m", "tvopd_trl.tiny.build", "--family", "vllm", "--unchanged-since", str(record)]
    unchanged = subprocess.run(command, capture_output=True, text=True)
    assert unchanged.returncode == 0, unchanged.stderr
    assert unchanged.stdout.strip() == f"vllm: the inputs of {record}, unchanged"
    changed = subprocess.run([*command, "--seed", "1"], capture_output=True, text=True)
    assert changed.returncode == 1 and changed.stdout.startswith("overrides: "), changed.stdout
