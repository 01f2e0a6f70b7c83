"""The `swiglu-patch` command line: one subcommand per tool, each in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``; it is
imported only when its subcommand runs, so `swiglu-patch kv-capacity` never imports lm-eval.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "eval": ("swiglu_patch.evals.cli", "lm-eval tasks and token-level agreement, eager vs fused"),
    "memory": ("swiglu_patch.memory.profile_cli", "measure activation memory, eager vs fused (CUDA)"),
    "kv-capacity": ("swiglu_patch.memory.kv_cli", "KV-cache tokens bought by the fused MLP"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swiglu-patch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only the module that will run
            mod = importlib.import_module(module)
            mod.add_arguments(sp)
            sp.set_defaults(_main=mod.main)
    args = parser.parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
