"""The committed coverage table (docs/coverage.md) is the installed transformers' and shows no failure."""

import re
from pathlib import Path

import pytest
import transformers

from zoo.tiny_zoo import VARIANTS, model_types

TABLE = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"
REGENERATE = "regenerate it: python tests/zoo/coverage_table.py --out docs/coverage.md"


def test_coverage_table_lists_every_model_type_and_variant():
    text = TABLE.read_text(encoding="utf-8")
    version = re.search(r"every model type of transformers (\S+)", text).group(1)
    if version != transformers.__version__:
        pytest.skip(f"docs/coverage.md is for transformers {version}, {transformers.__version__} is installed; {REGENERATE}")
    rows = re.findall(r"^\| `([^`]+)`(?: \(([^)]+)\))? \|", text, re.MULTILINE)
    assert {t for t, v in rows if not v} == set(model_types()), REGENERATE
    assert {(t, v) for t, v in rows if v} == set(VARIANTS), REGENERATE
    assert "FAILED" not in text
