"""Command-line plumbing of the benchmarks: one-line errors with exit code 2, and JSON output.

A bad argument, a missing input file or a missing GPU ends a benchmark with one line on
stderr, ``<prog>: error: <what> ; <the fix>``, and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse's own adds the usage block)."""

    def error(self, message: str):  # argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A problem with the arguments or the machine found after parsing; `guarded` prints it as one line."""


def guarded(prog: str, fn: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run fn(argv); a UsageError becomes one line on stderr and SystemExit(2)."""
    try:
        return fn(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def require_cuda(prog: str) -> None:
    """Raise UsageError unless a CUDA device is present."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"no CUDA device here; run {prog} on the GPU, or pass --dry-run (CPU, tiny shapes)")


def require_device(prog: str, dry_run: bool) -> None:
    """Raise UsageError unless this run can happen here: a dry run needs Triton's interpreter (on
    before Triton is imported), any other run a CUDA device (`require_cuda`)."""
    from swiglu_patch.kernels.device import interpreting

    if not dry_run:
        require_cuda(prog)
    elif not interpreting():
        raise UsageError("--dry-run runs the kernels in Triton's interpreter, which must be on before Triton is "
                         f"imported: run `TRITON_INTERPRET=1 {prog} --dry-run ...`")


def read_json(path: Path) -> dict:
    """The JSON object in `path`.

    Raises:
        UsageError: the file is missing or is not JSON (the message names the file).
    """
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a results JSON ({type(e).__name__}: {e})") from None


def sanitize(obj):
    """The same structure with inf/nan floats replaced by None, so the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


def write_json(data: dict, path: Path) -> Path:
    """Write `data` (inf/nan as null) to `path` as compact JSON (results.md is the readable form), creating its
    folder; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sanitize(data), separators=(",", ":"), allow_nan=False, default=str))
    return path


def render_or_run(args, kind: str, schema: int, run: Callable, render_markdown: Callable[[dict], str]) -> int:
    """The body of a benchmark's command line: with ``args.render``, rebuild results.md from a
    results JSON of this `kind` and `schema`; else ``run(args)`` and write results.json and
    results.md under ``args.out`` (a run returning {} is a rank other than 0 and writes nothing).

    Raises:
        UsageError: the JSON is missing, not JSON, or of another kind or schema.
    """
    if args.render:
        data = read_json(args.render)
        if data.get("kind") != kind or data.get("schema") != schema:
            raise UsageError(f"{args.render}: not a {kind} results JSON of schema {schema} (found kind "
                             f"{data.get('kind')!r}, schema {data.get('schema')!r})")
        out = args.out or args.render.parent
    else:
        out = args.out
        data = run(args)
        if not data:
            return 0
        print(f"[{kind}] wrote {write_json(data, out / 'results.json')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(render_markdown(data))
    print(f"[{kind}] wrote {out / 'results.md'}")
    return 0
