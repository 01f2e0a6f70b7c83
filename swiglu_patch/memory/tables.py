"""Small text helpers shared by the memory commands: byte formatting, markdown tables, writing files.

Where a result was measured (versions, GPU, commit) comes from :mod:`swiglu_patch.provenance`.
"""

from __future__ import annotations

import json
import os
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


def writable_dir(path: str | Path, option: str = "--out-dir") -> Path:
    """``path`` checked as a folder that exists and can be written, or that can be created; nothing is created.

    A missing folder is judged by its nearest existing ancestor (the writers create it later).

    Raises:
        ValueError: it is empty, a broken link or a file, sits under a file, or it (or the ancestor
            it would be created in) is not writable; the message names the option, the path and the fix.
    """
    fix = "give a folder you can write to"
    if str(path) == "":
        raise ValueError(f"{option} is empty; {fix}")
    path = Path(path).expanduser()
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{option} {path}: a broken symbolic link; {fix}")
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{option} {path}: a file is in the way (not a folder); {fix}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {path}: not writable; {fix}")
        return path
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option} {path}: part of the path ({parent}) is a file, not a folder; {fix}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"{option} {path}: cannot be created in {parent} (not writable); {fix}")
            break
    return path


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
