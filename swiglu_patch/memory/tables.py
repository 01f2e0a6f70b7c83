"""Small text helpers shared by the memory commands: byte formatting, markdown tables, writing files.

Where a result was measured (versions, GPU, commit) comes from :mod:`swiglu_patch.provenance`.
"""

from __future__ import annotations

import json
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
