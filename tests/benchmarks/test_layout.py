"""benchmarks/: the benchmarks a user runs at the top, their harness below them, frozen studies
aside. Imports point down (a top-level benchmark imports the harness, never the reverse), and
nothing but a study imports a study: studies are frozen at the commit they last ran at."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCH.parent
TOP_LEVEL = {"bench_mlp", "bench_e2e", "bench_host", "tune", "summarize", "accuracy_gemma3", "bench_train",
             "bench_train_step", "bench_tp", "bench_lora"}


def _imports(path: Path) -> set[str]:
    """Absolute names of the benchmarks modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            out |= {stem} | {f"{stem}.{a.name}" for a in node.names}
    return {name for name in out if name.startswith("benchmarks")}


def test_the_benchmarks_a_user_runs_are_at_the_top():
    assert {p.stem for p in BENCH.glob("*.py")} - {"__init__"} == TOP_LEVEL


def test_the_harness_imports_no_benchmark():
    for path in (BENCH / "harness").glob("*.py"):
        up = {n for n in _imports(path) if n.split(".")[1:2] and n.split(".")[1] in TOP_LEVEL}
        assert not up, f"{path.name} imports {up}: the harness must not import a benchmark"


def test_nothing_but_a_study_imports_a_study():
    for path in list(BENCH.glob("*.py")) + list((BENCH / "harness").glob("*.py")) + list(REPO.glob("tests/**/*.py")):
        studies = {n for n in _imports(path) if n.startswith("benchmarks.studies")}
        assert not studies, f"{path.relative_to(REPO)} imports {studies}: studies are frozen, not product"


def test_every_study_has_its_conclusion_in_the_readme():
    readme = (BENCH / "studies" / "README.md").read_text()
    for path in (BENCH / "studies").glob("*.py"):
        assert f"`{path.name}`" in readme, f"benchmarks/studies/README.md says nothing of {path.name}"
