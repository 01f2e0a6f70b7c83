"""`swiglu-patch memory`: the options, the measurement loop, the tables and the files.

Defining the options imports nothing heavy (``--help`` stays fast); torch and transformers load
only when a measurement runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from swiglu_patch.inputs import existing_file, int_list, nonnegative_int, one_line, positive_float, positive_int
from swiglu_patch.memory.configs import list_presets, read_json, resolve_model
from swiglu_patch.memory.profiler import WHATS, ProfileRow, predict_rows, profile_model
from swiglu_patch.memory.tables import fmt_bytes, markdown_table, writable_dir, write_json, write_text

DEFAULT_MODELS = ["llama-3.1-8b", "qwen2.5-7b", "mistral-nemo-12b", "gemma-3-12b"]

DESCRIPTION = """\
Peak activation memory of a model's forward, eager MLP against fused, measured on a CUDA GPU
(torch.cuda.max_memory_allocated) next to the prediction of swiglu-patch's memory model. For
each model (random weights from its config unless --model is a checkpoint; first --layers
decoder layers) it measures one MLP forward and one full prefill for every batch size and
sequence length, eager and then after apply_fused_mlp. Without CUDA it shows the prediction.
"""

EPILOG = """\
examples:
  swiglu-patch memory --model llama-3.1-8b --tokens 512,2048,8192 --batch-sizes 1
  swiglu-patch memory --out-dir results/memory_h100             # the four default models
  swiglu-patch memory --from-json results/memory_h100/memory_profile.json --plot memory.png

--out-dir writes memory_profile.json, memory_profile.md and memory_profile.png (the plot needs
matplotlib; without it the plot is skipped, and --from-json draws it later on any machine).
"""


def _whats(text: str) -> tuple[str, ...]:
    """argparse type: "both", or a comma-separated subset of WHATS."""
    if text == "both":
        return WHATS
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in WHATS for v in values):
        raise argparse.ArgumentTypeError(f"expected mlp, prefill or both, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swiglu-patch memory`'s options to `parser`."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", nargs="+", default=DEFAULT_MODELS, metavar="MODEL",
                        help=f"preset, config.json, checkpoint folder or hub id (default: {' '.join(DEFAULT_MODELS)}); "
                             f"presets: {', '.join(list_presets())}")
    parser.add_argument("--layers", type=nonnegative_int, default=2,
                        help="keep only the first N decoder layers (default 2; 0 = all)")
    parser.add_argument("--tokens", type=int_list, default=[512, 1024, 2048, 4096, 8192], metavar="T,T,...",
                        help="sequence lengths, comma-separated (default 512,1024,2048,4096,8192)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 2], metavar="B,B,...", help="batch sizes (default 1,2)")
    parser.add_argument("--max-tokens", type=positive_int, default=16384,
                        help="skip points with batch x tokens above this (default 16384)")
    parser.add_argument("--what", type=_whats, default=None, metavar="{mlp,prefill,both}",
                        help="one MLP forward, the full prefill, or both (default both; the MLP or experts block "
                             "alone for a model whose HF attention is not modelled: DeepSeek-V3, Qwen3.5)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="default bf16")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                        help="fused computation (default auto: the Triton kernel on CUDA)")
    parser.add_argument("--random-init", action="store_true",
                        help="random weights from the config even when --model is a checkpoint")
    parser.add_argument("--family", help="treat an unknown model_type as this family (e.g. llama)")
    parser.add_argument("--tolerance", type=positive_float, default=0.10,
                        help="relative error of the prediction that counts as a match (default 0.10)")
    parser.add_argument("--snapshot", action="store_true",
                        help="also dump a torch.cuda.memory snapshot of the largest prefill per path into --out-dir")
    parser.add_argument("--out-dir", metavar="DIR", help="write memory_profile.{json,md,png} here")
    parser.add_argument("--from-json", type=existing_file, metavar="PATH",
                        help="re-render the table and plot of an earlier run's memory_profile.json (no GPU needed)")
    parser.add_argument("--plot", metavar="PNG", help="the plot's path (default <out-dir>/memory_profile.png)")


def main(args: argparse.Namespace) -> int:
    """Run `swiglu-patch memory` with parsed `args`; returns the exit status (1: a model failed)."""
    try:
        if args.plot:
            from swiglu_patch.memory.plotting import require_matplotlib

            require_matplotlib()
        if args.out_dir is not None:
            writable_dir(args.out_dir)
        if args.from_json:
            return _rerender(args)
        if args.snapshot and not args.out_dir:
            raise ValueError("--snapshot writes into <out-dir>/snapshots; give --out-dir")
        resolved = [resolve_model(m) for m in args.model]
        shapes = [r.shape(args.family) for r in resolved]
        unwalked = [s.name for s in shapes if s.layout.hf_attention == "unwalked"]
        if args.what is not None and "prefill" in args.what and unwalked:
            raise ValueError(f"{', '.join(unwalked)}: HF's attention of this family is not modelled, so its prefill "
                             "cannot be predicted; pass --what mlp (its MLP or experts block)")
        if args.what is None and unwalked:
            print(f"swiglu-patch memory: {', '.join(unwalked)}: HF's attention of this family is not modelled; "
                  "showing its MLP or experts block only (--what mlp)\n")
        args.model_whats = {s.name: ("mlp",) if s.name in unwalked and args.what is None else (args.what or WHATS)
                            for s in shapes}
        args.what = args.what or WHATS
    except (ValueError, ImportError, OSError) as exc:
        return _fail(exc)
    return _measure(args, resolved, shapes)


def _fail(message: object) -> int:
    print(f"swiglu-patch memory: error: {one_line(message)}", file=sys.stderr)
    return 2


def _measure(args: argparse.Namespace, resolved: list, shapes: list) -> int:
    """Measure (or, without CUDA, predict) every point of every model; print and write the results."""
    layers = args.layers or None
    cuda = _cuda_available()
    if not cuda:
        print("swiglu-patch memory: CUDA is not available on this machine; showing the prediction only.\n")
    rows: list[ProfileRow] = []
    info: dict = {}
    failures: dict[str, str] = {}
    out_dir = Path(args.out_dir) if args.out_dir else None
    start = time.time()
    for res, shape in zip(resolved, shapes):
        dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
        if not cuda:
            s = shape.truncated(layers) if layers else shape
            rows += predict_rows(s, args.model_whats[shape.name], args.batch_sizes, args.tokens, dtype_bytes,
                                 args.max_tokens)
            continue
        t0 = time.time()
        try:
            model_rows, model_info = profile_model(
                res, layers=layers, whats=args.model_whats[shape.name], batches=args.batch_sizes, seq_lens=args.tokens, dtype=args.dtype,
                max_tokens=args.max_tokens, random_init=args.random_init, backend=args.backend,
                snapshot_dir=(out_dir / "snapshots") if (args.snapshot and out_dir) else None, family=args.family)
        except Exception as exc:  # noqa: BLE001 - one model's failure (OOM, an HF change) keeps the others' numbers
            failures[res.name] = f"{type(exc).__name__}: {exc}"
            print(f"{res.name}: FAILED after {time.time() - t0:.1f} s: {failures[res.name][:300]}", flush=True)
            continue
        rows += model_rows
        info[res.name] = {**model_info, "source": res.source, "seconds": round(time.time() - t0, 1)}
        print(f"{res.name}: {len(model_rows)} points in {time.time() - t0:.1f} s", flush=True)
    from swiglu_patch.provenance import environment

    env = environment("cuda" if cuda else "cpu")
    where = f"measured with torch.cuda.max_memory_allocated on {measured_on(env)}" if cuda else "PREDICTION ONLY (no CUDA)"
    header = (f"Peak memory above weights, {args.dtype}, first {layers or 'all'} layers, HF eager vs swiglu-patch "
              f"fused; prefill with logits_to_keep=1 and use_cache=True; {where}")
    table, summary = profile_table(rows, args.tolerance), match_summary(rows, args.tolerance)
    summary += "".join(f"\n- {name} FAILED: {why}" for name, why in failures.items())
    print(f"{header}\n\n{table}\n\n{summary}")
    if out_dir:
        payload = {"command": " ".join(sys.argv), "environment": env, "settings": _settings(args),
                   "models": info, "failures": failures, "seconds": round(time.time() - start, 1), "measured": cuda,
                   "rows": [r.to_dict() for r in rows]}
        write_json(out_dir / "memory_profile.json", payload)
        write_text(out_dir / "memory_profile.md", f"{header}\n\n{table}\n\n{summary}\n")
        print(f"\nwrote {out_dir / 'memory_profile.json'}, {out_dir / 'memory_profile.md'}")
    _plot(rows, args.plot or (str(out_dir / "memory_profile.png") if out_dir else None), header)
    return 1 if failures else 0


def measured_on(env: dict) -> str:
    """'<GPU> (torch X, transformers Y, commit Z)' from a results file's environment: a
    `swiglu_patch.provenance.environment` record, or the flat one of files measured before it
    existed ({"gpu": name, "torch": ..., "git_commit": ...})."""
    if "versions" in env:
        gpu, versions, commit = env.get("gpu", {}).get("name", "no GPU"), env["versions"], env.get("git", {}).get("commit")
    else:
        gpu, versions, commit = env.get("gpu", "no GPU"), env, env.get("git_commit")
    return f"{gpu} (torch {versions.get('torch')}, transformers {versions.get('transformers')}, commit {commit})"


def _plot(rows: list[ProfileRow], path: str | None, title: str) -> None:
    if not (path and rows):
        return
    try:
        from swiglu_patch.memory.plotting import plot_profile

        print(f"wrote {plot_profile([r.to_dict() for r in rows], path, title=title)}")
    except ImportError as exc:  # the numbers are written already; plot them later with --from-json
        print(f"plot skipped ({exc}); render it elsewhere with --from-json")


def _rerender(args: argparse.Namespace) -> int:
    """Table, summary, markdown and plot from a memory_profile.json, without measuring."""
    source = args.from_json
    payload = read_json(source)
    rows = payload.get("rows")
    fields = {f.name for f in dataclasses.fields(ProfileRow)}
    needed = {f.name for f in dataclasses.fields(ProfileRow) if f.default is dataclasses.MISSING}
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and needed <= set(r) for r in rows):
        raise ValueError(f"{source}: not a memory_profile.json (it needs a list 'rows' of points with "
                         f"{', '.join(sorted(needed))})")
    rows = [ProfileRow(**{k: v for k, v in r.items() if k in fields}) for r in rows]
    header = (f"Peak memory above weights on {measured_on(payload.get('environment', {}))}; HF eager vs swiglu-patch "
              "fused; prefill with logits_to_keep=1 and use_cache=True")
    table, summary = profile_table(rows, args.tolerance), match_summary(rows, args.tolerance)
    print(f"{header}\n\n{table}\n\n{summary}")
    if args.out_dir:
        write_text(Path(args.out_dir) / "memory_profile.md", f"{header}\n\n{table}\n\n{summary}\n")
    _plot(rows, args.plot or (str(Path(args.out_dir) / "memory_profile.png") if args.out_dir else None), header)
    return 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def _err(r: ProfileRow) -> str:
    return f"{100 * (r.ratio - 1):+.1f}%" if r.ratio is not None else "-"


def profile_table(rows: list[ProfileRow], tolerance: float) -> str:
    """One line per (model, what, batch, tokens): eager and fused, measured, predicted, error."""
    pairs: dict[tuple, dict[str, ProfileRow]] = {}
    for r in rows:
        pairs.setdefault((r.model, r.what, r.batch, r.seq_len), {})[r.path] = r
    lines = []
    for (model, what, batch, seq), p in pairs.items():
        e, f = p.get("eager"), p.get("fused")
        meas = lambda r: fmt_bytes(r.measured_bytes) if r and r.measured_bytes is not None else "-"  # noqa: E731
        saved = _saved(e, f)
        measured = [r for r in (e, f) if r and r.measured_bytes is not None]
        flag = "-" if not measured else "ok" if all(_ok(r, tolerance) for r in measured) else "MISS"
        lines.append([model, what, batch, seq, meas(e), fmt_bytes(e.predicted_bytes) if e else "-", _err(e) if e else "-",
                      meas(f), fmt_bytes(f.predicted_bytes) if f else "-", _err(f) if f else "-", saved, flag])
    headers = ["model", "what", "B", "T", "eager measured", "eager predicted", "err", "fused measured",
               "fused predicted", "err", "saved", f"within {100 * tolerance:.0f}%"]
    return markdown_table(headers, lines)


def _saved(e: ProfileRow | None, f: ProfileRow | None) -> str:
    """Eager minus fused: measured when both were measured, else predicted."""
    if not (e and f):
        return "-"
    if e.measured_bytes is not None and f.measured_bytes is not None:
        return fmt_bytes(e.measured_bytes - f.measured_bytes)
    return fmt_bytes(e.predicted_bytes - f.predicted_bytes) + " (pred.)"


def _ok(r: ProfileRow, tolerance: float) -> bool:
    return r.ratio is None or abs(r.ratio - 1) <= tolerance


def match_summary(rows: list[ProfileRow], tolerance: float) -> str:
    measured = [r for r in rows if r.measured_bytes is not None]
    if not measured:
        return f"{len(rows)} predicted points; nothing measured."
    ok = [r for r in measured if _ok(r, tolerance)]
    worst = max(measured, key=lambda r: abs(r.ratio - 1))
    return (f"{len(ok)}/{len(measured)} measured points within {100 * tolerance:.0f}% of the prediction; worst "
            f"{_err(worst)} ({worst.model} {worst.what} {worst.path} B={worst.batch} T={worst.seq_len}, predicted peak "
            f"at {worst.predicted_where}).")
