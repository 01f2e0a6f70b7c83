"""Small text helpers shared by the memory commands: byte formatting, markdown tables, run metadata."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

MIB = 1024**2
GIB = 1024**3


def fmt_bytes(nbytes: float) -> str:
    """'58.3 MiB', '15.0 GiB' (binary units)."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB"


def fmt_int(n: int) -> str:
    return f"{n:,}"


def int_list(text: str) -> list[int]:
    """argparse type: "512,1024" -> [512, 1024] (positive integers)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    def align(col: int) -> str:
        numeric = all(isinstance(r[col], (int, float)) or _looks_numeric(str(r[col])) for r in rows) if rows else False
        return "---:" if numeric else "---"

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align(i) for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    head = text.replace(",", "").replace("+", "").replace("-", "").replace("%", "").split(" ")[0]
    try:
        float(head)
    except ValueError:
        return False
    return True


def git_commit(cwd: str | Path | None = None) -> str | None:
    """HEAD's hash (with '-dirty' when tracked files changed); outside a git checkout (a copy of the
    tree on a GPU machine) the ``SWIGLU_PATCH_COMMIT`` environment variable, else None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SWIGLU_PATCH_COMMIT")
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment() -> dict:
    """Versions that the numbers depend on (torch, triton, transformers, python, the GPU if any)."""
    info: dict = {"python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_total_memory_bytes"] = props.total_memory
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    for module in ("triton", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    info["git_commit"] = git_commit(Path(__file__).resolve().parent)
    return info


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path
