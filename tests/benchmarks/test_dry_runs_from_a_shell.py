"""Every benchmark's CPU dry run as benchmarks/README.md gives it, from a plain shell:
`python -m benchmarks.<name> --dry-run --out DIR` with TRITON_INTERPRET unset exits 0 and writes
its report under DIR (`benchmarks/__init__.py` switches the interpreter on for it). Where the
interpreter is switched off by hand, the scripts that need it exit 2 with the fix, never a
traceback. (The other tests call each script's `main` in a process whose interpreter
`tests/conftest.py` has already switched on.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import interpreter_subprocess_env

ROOT = Path(__file__).parents[2]
TORCHRUN = {"bench_tp", "bench_moe_parallel"}  # dry runs under torchrun: test_bench_tp.py, test_bench_moe_parallel.py
DRY_RUNS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                  if not p.stem.startswith("_") and '"--dry-run"' in p.read_text() and p.stem not in TORCHRUN)
NEEDS_INTERPRETER = [name for name in DRY_RUNS if "require_device(" in (ROOT / "benchmarks" / f"{name}.py").read_text()]


def shell_env(**extra: str) -> dict[str, str]:
    env = interpreter_subprocess_env(**extra)
    if "TRITON_INTERPRET" not in extra:
        del env["TRITON_INTERPRET"]
    return env


def run(name: str, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_the_list_is_every_dry_run():
    assert {"bench_moe", "bench_train", "tune"} <= set(DRY_RUNS), DRY_RUNS
    assert {"bench_moe", "bench_moe_lora", "bench_moe_train", "bench_train"} <= set(NEEDS_INTERPRETER)


@pytest.mark.parametrize("name", DRY_RUNS)
def test_dry_run_from_a_plain_shell(name, tmp_path):
    done = run(name, tmp_path / "out", shell_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert any(p.is_file() and p.stat().st_size > 0 for p in (tmp_path / "out").rglob("*")), "no report written"


@pytest.mark.parametrize("name", NEEDS_INTERPRETER)
def test_dry_run_with_the_interpreter_off_names_the_fix(name, tmp_path):
    done = run(name, tmp_path / "out", shell_env(TRITON_INTERPRET="0"))
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    assert re.search(r"TRITON_INTERPRET=1 python -m benchmarks\.\w+ --dry-run", done.stderr), done.stderr
