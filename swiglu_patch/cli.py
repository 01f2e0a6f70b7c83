"""The `swiglu-patch` command line: one subcommand per tool, each in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``, and defines
its options without importing torch, transformers or lm-eval (they load inside ``main``), so
``--help`` and argument errors are fast. Only the module of the subcommand named on the line is
imported. An argument error is one line on stderr and exit status 2; so is an output folder
(``--out-dir``, ``--output-dir``) that cannot be written, found before the subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# options naming a folder that a subcommand writes into: checked before it runs
OUTPUT_FOLDERS = ("--out-dir", "--output-dir")

# subcommand -> (module, one-line summary)
SUBCOMMANDS = {
    "eval": ("swiglu_patch.evals.cli", "does the model answer the same with its MLPs fused? (lm-eval tasks, text)"),
    "memory": ("swiglu_patch.memory.profile_cli", "peak activation memory, eager MLP against fused (measured on CUDA)"),
    "kv-capacity": ("swiglu_patch.memory.kv_cli", "KV-cache tokens the fused MLP frees on a GPU (arithmetic, any machine)"),
    "explain": ("swiglu_patch.explain_cli", "which kernel and config a gated GEMM call runs, and why (any machine)"),
}

DESCRIPTION = """\
swiglu-patch fuses the gate and up projections, the activation and the product of every
gated MLP (SwiGLU, GeGLU) of a Hugging Face model into one Triton GEMM. These tools check
what that changes: answers, memory, and KV-cache room.
"""

EPILOG = """\
examples:
  swiglu-patch eval --model ./my-checkpoint --text book.txt
  swiglu-patch memory --model llama-3.1-8b --tokens 512,8192
  swiglu-patch kv-capacity --model llama-3.1-8b --gpu H100
  swiglu-patch explain --m 16 --k 4096 --i 14336 --captured

`swiglu-patch COMMAND --help` describes each command. Without the Hugging Face hub, set
HF_HUB_OFFLINE=1 and give local paths.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (what is wrong, and where the help is) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `swiglu-patch` parser; the options of `command` (a SUBCOMMANDS key) are filled in."""
    parser = _Parser(prog="swiglu-patch", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, summary) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=summary, description=summary)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(sp)
            sp.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the process's arguments) and run the subcommand; returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    for option in OUTPUT_FOLDERS:
        folder = getattr(args, option.lstrip("-").replace("-", "_"), None)
        problem = folder_problem(folder) if folder is not None else None
        if problem:
            print(f"swiglu-patch {args.command}: error: {option} {folder}: {problem}", file=sys.stderr)
            return 2
    return int(args._main(args) or 0)


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (made into) a writable folder, or None. Nothing is created.

    Checks the path itself if it exists, else its nearest existing ancestor: a file where a
    folder must be, a broken symbolic link, a folder this user cannot write.
    """
    p = Path(path)
    if str(path) == "":
        return "empty; give a folder"
    if p.is_symlink() and not p.exists():
        return f"a broken symbolic link (to {os.readlink(p)}); give a folder"
    if p.exists():
        if not p.is_dir():
            return "exists and is not a folder; give a folder (it is created if missing)"
        return None if os.access(p, os.W_OK | os.X_OK) else "not writable by this user; give another folder"
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                return f"cannot be created: {parent} is a file, not a folder"
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"cannot be created: {parent} is not writable"
            return None
    return None


if __name__ == "__main__":
    raise SystemExit(main())
