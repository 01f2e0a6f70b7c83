"""Convergence of a patched model against the unpatched one, in the style of Liger-Kernel's
mini-model tests: the same initial weights, seed and batches, trained side by side; the loss
curves must agree step by step.

The text is Jane Austen, read as bytes (token id = byte, vocab 256): the six novels from the
Debian package r-cran-janeaustenr (R lazy-load data, read with the PyPI package `rdata`), or a
plain text file, or the chapter kept in tests/patch/data for the CPU test.

GPU run (a Llama-shaped model of a few layers, bf16 weights, AdamW, 200 steps; writes
convergence.json and convergence.png of both curves and exits 1 if they disagree beyond
atol 1e-2 + rtol 5e-2):

    python tests/training_stack/convergence.py --out results/convergence_h100

Text for the GPU machine: extract it here, carry the file, and pass it:

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb janeaustenr && pip install rdata
    python tests/training_stack/convergence.py --janeaustenr janeaustenr/usr/lib/R/site-library/janeaustenr \\
        --write-text austen.txt
    python tests/training_stack/convergence.py --text austen.txt --out results/convergence_h100
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CHAPTER = REPO / "tests" / "patch" / "data" / "austen_pride_and_prejudice_ch1.txt"
JANEAUSTENR = Path("/usr/lib/R/site-library/janeaustenr")


def janeaustenr_text(package_dir: Path) -> str:
    """The six novels of the R package janeaustenr (its data/Rdata.rdx + .rdb lazy-load database)."""
    try:
        import rdata
    except ImportError as e:
        raise ImportError("reading janeaustenr needs rdata: pip install rdata") from e
    data = Path(package_dir) / "data"
    index = rdata.read_rds(data / "Rdata.rdx")  # {variables: {name: [offset, length]}}
    blob = (data / "Rdata.rdb").read_bytes()
    novels = []
    for _, (offset, length) in sorted(index["variables"].items()):
        record = blob[int(offset): int(offset) + int(length)]  # a 4-byte length, then zlib
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(record[4:])))
        novels.append("\n".join(str(line) for line in lines))
    return "\n\n".join(novels)


def load_text(text: str | None = None, janeaustenr: str | None = None) -> tuple[str, str]:
    """(text, where it came from): a text file, the janeaustenr package, or the repo's chapter."""
    if text:
        return Path(text).read_text(encoding="utf-8"), str(text)
    package = Path(janeaustenr) if janeaustenr else JANEAUSTENR
    if (package / "data" / "Rdata.rdx").exists():
        return janeaustenr_text(package), f"janeaustenr ({package})"
    if janeaustenr:
        raise FileNotFoundError(f"no janeaustenr data under {package}/data")
    return CHAPTER.read_text(encoding="utf-8"), f"{CHAPTER.relative_to(REPO)} (janeaustenr not found)"


def byte_batches(text: str, steps: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` batches of `batch` random windows of `seq` bytes of the text, int64 [batch, seq]."""
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    if data.numel() <= seq:
        raise ValueError(f"the text has {data.numel()} bytes, fewer than a window of {seq}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([data[s: s + seq] for s in row.tolist()]) for row in starts]


def train_losses(model, batches, lr: float, seed: int = 0) -> list[float]:
    """AdamW on each batch (causal-LM loss, labels = inputs), from a seeded RNG; the per-step losses."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for ids in batches:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def side_by_side(base, batches, lr: float, backend: str) -> tuple[list[float], list[float]]:
    """(unpatched losses, patched losses) from two copies of `base` trained on the same batches."""
    from swiglu_patch import apply_fused_mlp

    patched = copy.deepcopy(base)
    apply_fused_mlp(patched, backend=backend)
    patched_losses = train_losses(patched, batches, lr)  # first: a backend that cannot train fails at once
    del patched
    return train_losses(copy.deepcopy(base), batches, lr), patched_losses


def curves_agree(eager: list[float], patched: list[float], atol: float, rtol: float) -> tuple[bool, float, int]:
    """(every |patched - eager| <= atol + rtol * |eager|, the worst excess over that bound, its step)."""
    excess = [abs(p - e) - (atol + rtol * abs(e)) for e, p in zip(eager, patched)]
    worst = max(range(len(excess)), key=excess.__getitem__)
    return excess[worst] <= 0, excess[worst], worst


def plot(eager, patched, path: Path, title: str, baseline_label: str = "HF eager") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    steps = range(1, len(eager) + 1)
    top.plot(steps, eager, label=baseline_label, lw=1.2)
    top.plot(steps, patched, label="swiglu-patch", lw=1.0, ls="--")
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=9)
    top.legend()
    bottom.plot(steps, [p - e for e, p in zip(eager, patched)], lw=0.8, color="k")
    bottom.axhline(0, lw=0.5, color="grey")
    bottom.set_ylabel(f"patched - {baseline_label.split()[-1]}")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for convergence.json and convergence.png (required unless --write-text)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--backend", default="auto", help="apply_fused_mlp backend (auto: Triton on CUDA)")
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=5e-2)
    p.add_argument("--text", help="a UTF-8 text file to train on")
    p.add_argument("--janeaustenr", help=f"the R package's folder (default {JANEAUSTENR} when it exists)")
    p.add_argument("--write-text", help="write the loaded text to this file and exit")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if not (args.out or args.write_text):
        p.error("--out is required (or --write-text)")

    text, source = load_text(args.text, args.janeaustenr)
    if args.write_text:
        Path(args.write_text).write_text(text, encoding="utf-8")
        print(f"wrote {len(text):,} characters from {source} to {args.write_text}")
        return 0

    from transformers import LlamaConfig, LlamaForCausalLM

    from swiglu_patch.provenance import environment

    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, hidden_act="silu",
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    base = LlamaForCausalLM(config).to(device=args.device, dtype=dtype)
    batches = byte_batches(text, args.steps, args.batch, args.seq)
    eager, patched = side_by_side(base, batches, args.lr, args.backend)
    ok, worst, step = curves_agree(eager, patched, args.atol, args.rtol)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(
        what="training loss, HF eager vs swiglu-patch, same init, seed and batches",
        config=vars(args) | {"text_source": source, "text_chars": len(text),
                             "params": sum(p.numel() for p in base.parameters())},
        environment=environment(args.device),
        losses_eager=eager, losses_patched=patched,
        max_abs_diff=max(abs(a - b) for a, b in zip(eager, patched)),
        worst_excess_over_bound=worst, worst_step=step + 1, passed=ok,
    )
    (out / "convergence.json").write_text(json.dumps(record, indent=1, default=str))
    plot(eager, patched, out / "convergence.png",
         f"Llama-shaped {args.layers}x{args.hidden} (I={args.intermediate}), {args.dtype}, {args.steps} steps, "
         f"backend {args.backend}; max |diff| {record['max_abs_diff']:.2e}")
    print(f"eager {eager[0]:.4f} -> {eager[-1]:.4f}, patched {patched[0]:.4f} -> {patched[-1]:.4f}, max |diff| "
          f"{record['max_abs_diff']:.3e}; {'PASS' if ok else 'FAIL'} (atol {args.atol}, rtol {args.rtol}); "
          f"wrote {out}/convergence.json and .png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
