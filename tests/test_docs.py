"""The generated configuration reference is up to date and documents every field."""

import dataclasses

from trl import DistillationConfig

from tvopd_trl.config import TVOPDConfig
from tvopd_trl.config_reference import PATH, documented_fields, render
from tvopd_trl.scripts.evaluate import EvalArguments
from tvopd_trl.scripts.train import MainJobArguments


def test_config_reference_is_not_stale():
    with open(PATH, encoding="utf-8") as f:
        assert f.read() == render(), "docs/config-reference.md is stale: run `python -m tvopd_trl.config_reference`"


def test_every_field_we_add_is_documented():
    inherited = {field.name for field in dataclasses.fields(DistillationConfig)}
    ours = {field.name for field in dataclasses.fields(TVOPDConfig)} - inherited
    assert ours and not ours - documented_fields(TVOPDConfig), ours - documented_fields(TVOPDConfig)
    for cls in (MainJobArguments, EvalArguments):
        fields = {field.name for field in dataclasses.fields(cls)}
        assert not fields - documented_fields(cls), (cls.__name__, fields - documented_fields(cls))
