"""The committed coverage table (docs/coverage.md) is the installed transformers' and shows no failure."""

import re

import pytest
import transformers

from zoo.tiny_zoo import COVERAGE_TABLE, VARIANTS, model_types, recorded_with

REGENERATE = "regenerate it: python tests/zoo/coverage_table.py --out docs/coverage.md"


def test_coverage_table_lists_every_model_type_and_variant():
    text = COVERAGE_TABLE.read_text(encoding="utf-8")
    version = recorded_with()
    if version != transformers.__version__:
        pytest.skip(f"docs/coverage.md is for transformers {version}, {transformers.__version__} is installed; {REGENERATE}")
    rows = re.findall(r"^\| `([^`]+)`(?: \(([^)]+)\))? \|", text, re.MULTILINE)
    assert {t for t, v in rows if not v} == set(model_types()), REGENERATE
    assert {(t, v) for t, v in rows if v} == set(VARIANTS), REGENERATE
    assert "FAILED" not in text
