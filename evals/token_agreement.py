"""Token-level agreement of the eager and fused model on real text: the most sensitive check.

The text is tokenized once and cut into non-overlapping windows of `window` tokens (each
starting with the special tokens the tokenizer itself prepends, e.g. ``<bos>``). Every
window runs through the model unpatched and patched; at every position p of every window,
with e = eager logits and f = fused logits over the vocabulary V:

- KL(eager || fused) = sum_v softmax(e)_v * (log_softmax(e)_v - log_softmax(f)_v), nats;
- top-1 agreement: argmax e == argmax f;
- |e - f| (max over v, then over positions): the largest logit change;
- NLL of the true next token (positions 0 .. window-2), for perplexity exp(mean NLL).

Logits are compared in fp32, whatever the model dtype (so a KL of two nearly equal
distributions can come out a hair below zero, ~-1e-9: rounding, not a bug). With a
reference dtype (float32 for a bf16 model), each window also runs through the unpatched
model cast to it, and eager and fused are both compared with that: the fused model should
stray from the higher-precision model no further than eager does. Memory: the eager logits of a group
of windows ([windows, window, V] in the model's dtype) are kept while the patched model runs
the same group; the group is as large as `max_stored_bytes` allows, and the model is patched
and unpatched once per group. Everything stays on the model's device until the end.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from swiglu_patch.inputs import SourceError, check_source, hub_offline

from .errors import EvalSetupError
from .patching import Patcher


def special_prefix(tokenizer) -> list[int]:
    """Token ids the tokenizer puts in front of any text (e.g. [bos]); [] if none."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    if plain and with_special[-len(plain):] == plain:
        return list(with_special[: len(with_special) - len(plain)])
    return []


def make_windows(tokenizer, text: str, window: int, max_tokens: int | None = None) -> torch.Tensor:
    """Cut `text` into windows of `window` token ids, each led by the tokenizer's prefix.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the text.
        window: tokens per window, prefix included (>= prefix length + 2).
        max_tokens: stop after this many tokens in total (whole windows only).

    Returns:
        int64 tensor [num_windows, window] on CPU. The text's tail that does not fill a
        window is dropped.

    Raises:
        EvalSetupError: the text is too short for one window, or the window is too small.
    """
    prefix = special_prefix(tokenizer)
    body = window - len(prefix)
    if body < 2:
        raise EvalSetupError(f"--window {window} is too small: it must hold the prefix {prefix} and 2 tokens")
    if max_tokens is not None:
        text = text[: max(max_tokens, window) * 16]  # generous: a token is rarely > 16 chars
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // body
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // window))
    if n == 0:
        raise EvalSetupError(f"the text has {len(ids)} tokens, fewer than one window of {body} (+ prefix); give more text or a smaller --window")
    rows = [prefix + ids[i * body : (i + 1) * body] for i in range(n)]
    return torch.tensor(rows, dtype=torch.long)


class _Accumulator:
    """Running sums of the agreement statistics, on the device."""

    def __init__(self, device: torch.device):
        z = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        self.kl: list[torch.Tensor] = []
        self.top1_same = z()
        self.max_abs = z()
        self.sum_abs = z()
        self.nll_e = z()
        self.nll_f = z()
        self.n_nll = torch.zeros((), dtype=torch.int64, device=device)
        self.n_pos = 0
        self.n_logits = 0

    def add(self, e: torch.Tensor, f: torch.Tensor, targets: torch.Tensor) -> None:
        """e, f: [P, V] logits of P positions; targets: [P] next-token ids, -1 where none."""
        e32, f32 = e.float(), f.float()
        diff = (e32 - f32).abs_()
        self.max_abs = torch.maximum(self.max_abs, diff.max().double())
        self.sum_abs += diff.sum(dtype=torch.float64)
        del diff
        self.top1_same += (e32.argmax(-1) == f32.argmax(-1)).sum()
        lpe, lpf = torch.log_softmax(e32, -1), torch.log_softmax(f32, -1)
        del e32, f32
        self.kl.append((lpe.exp() * (lpe - lpf)).sum(-1))
        keep = targets >= 0
        t = targets.clamp_min(0)[:, None]
        self.nll_e -= (lpe.gather(-1, t).squeeze(-1) * keep).sum(dtype=torch.float64)
        self.nll_f -= (lpf.gather(-1, t).squeeze(-1) * keep).sum(dtype=torch.float64)
        self.n_nll += keep.sum()
        self.n_pos += e.shape[0]
        self.n_logits += e.numel()

    def result(self, a: str = "eager", b: str = "fused") -> dict:
        """The statistics of second (b) against first (a); KL is KL(a || b)."""
        kl = torch.cat(self.kl).double().cpu()
        q = torch.quantile(kl[: 2**24], torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        n_nll = max(int(self.n_nll.item()), 1)
        nll_e, nll_f = self.nll_e.item() / n_nll, self.nll_f.item() / n_nll
        return {
            "positions": self.n_pos,
            "kl_mean": kl.mean().item(),
            "kl_median": q[0],
            "kl_p99": q[1],
            "kl_max": kl.max().item(),
            "top1_agreement": self.top1_same.item() / self.n_pos,
            "top1_disagreements": int(self.n_pos - self.top1_same.item()),
            "max_abs_logit_diff": self.max_abs.item(),
            "mean_abs_logit_diff": self.sum_abs.item() / self.n_logits,
            f"nll_{a}": nll_e,
            f"nll_{b}": nll_f,
            f"ppl_{a}": math.exp(nll_e),
            f"ppl_{b}": math.exp(nll_f),
            "ppl_rel_diff": math.exp(nll_f - nll_e) - 1.0,
        }


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(8 * 2**30, 0.25 * free))
    return 2**30


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype | dict) -> dict:
    """Cast every floating parameter and buffer to `dtype` (or back, given the dict this
    returned); returns {(module, kind, name): old dtype}. bf16/fp16 -> fp32 -> back is exact."""
    old, seen = {}, set()
    with torch.inference_mode(False):  # under inference mode the cast copies would be inference tensors,
        for mod in model.modules():    # which a later run outside it (lm-eval's no_grad) refuses to use
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(mod, kind).items():
                    if t is None or not t.dtype.is_floating_point or id(t) in seen:
                        continue  # tied weights (one tensor, two modules) are cast once
                    seen.add(id(t))
                    target = dtype.get((id(mod), kind, name), t.dtype) if isinstance(dtype, dict) else dtype
                    old[(id(mod), kind, name)] = t.dtype
                    if t.dtype != target:
                        t.data = t.data.to(target)
    return old


def _forward(model, ids: torch.Tensor, batch_size: int, bar) -> list[torch.Tensor]:
    out = []
    for b in range(0, ids.shape[0], batch_size):
        out.append(model(input_ids=ids[b : b + batch_size]).logits)
        bar.update(out[-1].shape[0])
    return out


@torch.inference_mode()
def compare_tokens(
    model,
    windows: torch.Tensor,
    *,
    patcher: Patcher | None = None,
    batch_size: int = 8,
    reference_dtype: torch.dtype | None = None,
    max_stored_bytes: int | None = None,
    chunk_positions: int | None = None,
    progress: bool = True,
) -> dict:
    """Per-token agreement of `model` unpatched vs patched on the given windows.

    With `reference_dtype` (e.g. float32 for a bf16 model), every window also runs through
    the unpatched model cast to that dtype (in place, and cast back exactly), and both the
    eager and the fused logits are compared with that reference: how far the fused model
    strays from the higher-precision model, next to how far eager itself does.

    Args:
        model: a causal LM, unpatched, on its device, in eval mode.
        windows: int64 [num_windows, window] token ids (from `make_windows`).
        patcher: how to make the fused model (default `Patcher()`).
        batch_size: windows per forward pass.
        reference_dtype: dtype of the reference run, or None for none.
        max_stored_bytes: memory for logits kept while the fused model runs
            (default: 1 GiB on CPU, min(8 GiB, 25% of free) on CUDA).
        chunk_positions: positions compared at a time (bounds fp32 temporaries to about
            6 x chunk x V x 4 bytes); default 2^25 / V, at least 1.
        progress: a tqdm bar on stderr counting windows through each run (eager, reference,
            fused).

    Returns:
        The fused-vs-eager statistics (module docstring) plus window, windows, seconds,
        positions_per_second, fused_path and ``reference``: None, or {dtype, eager: stats
        of eager vs reference, fused: stats of fused vs reference}. The model is unpatched
        and in its own dtype on return.
    """
    patcher = patcher or Patcher()
    device = next(model.parameters()).device
    windows = windows.to(device)
    n_win, length = windows.shape
    vocab = model.get_output_embeddings().weight.shape[0]
    elem = max(next(model.parameters()).element_size(), 2) + (4 if reference_dtype is not None else 0)
    budget = max_stored_bytes or _default_budget(device)
    group = max(batch_size, (budget // (length * vocab * elem)) // batch_size * batch_size)
    chunk = chunk_positions or max(1, 2**25 // vocab)
    main, ref_e, ref_f = _Accumulator(device), _Accumulator(device), _Accumulator(device)
    path = patcher.path(model)
    ref_name = str(reference_dtype).replace("torch.", "")
    runs = f"eager, {ref_name} reference, fused" if reference_dtype is not None else "eager, fused"
    bar = tqdm(total=n_win * (3 if reference_dtype is not None else 2), unit="window", disable=not progress,
               desc=f"token-level ({runs})", dynamic_ncols=True)
    t0 = time.perf_counter()
    for g in range(0, n_win, group):
        ids = windows[g : g + group]
        eager = _forward(model, ids, batch_size, bar)
        ref = None
        if reference_dtype is not None:
            old = _cast_floating(model, reference_dtype)
            try:
                ref = _forward(model, ids, batch_size, bar)
            finally:
                _cast_floating(model, old)
        with torch.inference_mode(False):  # patch and unpatch make the weights later runs use: no inference tensors
            patcher.apply(model)
        try:
            for k, b in enumerate(range(0, ids.shape[0], batch_size)):
                batch = ids[b : b + batch_size]
                fused = model(input_ids=batch).logits.reshape(-1, vocab)
                bar.update(batch.shape[0])
                e = eager[k].reshape(-1, vocab)
                t = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -1)], dim=1).reshape(-1)
                r = ref[k].reshape(-1, vocab) if ref is not None else None
                for s in range(0, e.shape[0], chunk):
                    sl = slice(s, s + chunk)
                    main.add(e[sl], fused[sl], t[sl])
                    if r is not None:
                        ref_e.add(r[sl], e[sl], t[sl])
                        ref_f.add(r[sl], fused[sl], t[sl])
                eager[k] = None
                if ref is not None:
                    ref[k] = None
                del fused, e, r
        finally:
            with torch.inference_mode(False):
                patcher.restore(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bar.close()
    seconds = time.perf_counter() - t0
    out = main.result("eager", "fused")
    out["reference"] = None
    if reference_dtype is not None:
        out["reference"] = {
            "dtype": str(reference_dtype).replace("torch.", ""),
            "eager": ref_e.result("reference", "eager"),
            "fused": ref_f.result("reference", "fused"),
        }
    out.update({"window": int(length), "windows": int(n_win), "seconds": seconds,
                "positions_per_second": out["positions"] / seconds, "fused_path": path})
    return out


def load_text(path: str | None = None, dataset: str | None = None, split: str = "train", column: str = "text",
              dataset_config: str | None = None) -> str:
    """Read the text to compare on: a UTF-8 file, or a column of a dataset joined by blank lines.

    Args:
        path: a plain-text file.
        dataset: a local .jsonl/.json/.csv/.parquet/.txt file, or a hub dataset id.
        split: the dataset split.
        column: the text column.
        dataset_config: the hub dataset's config name.

    Returns:
        The text.

    Raises:
        EvalSetupError: neither or both given, file missing, or column absent.
    """
    from pathlib import Path

    if (path is None) == (dataset is None):
        raise EvalSetupError("give exactly one of --text FILE or --text-dataset DATASET")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise EvalSetupError(f"--text {path}: no such file")
        return p.read_text(encoding="utf-8", errors="replace")
    import datasets

    p = Path(dataset)
    builders = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
    try:
        if p.is_file():
            if p.suffix.lower() not in builders:
                raise EvalSetupError(f"--text-dataset {dataset}: unsupported file type; use {', '.join(builders)}")
            ds = datasets.load_dataset(builders[p.suffix.lower()], data_files={split: str(p)}, split=split)
        else:
            check_source(dataset, option="--text-dataset", what="dataset", repo_type="dataset", cache_file=None)
            ds = datasets.load_dataset(dataset, dataset_config, split=split)
    except EvalSetupError:
        raise
    except SourceError as err:
        raise EvalSetupError(str(err)) from None
    except Exception as err:  # hub, offline and parsing errors come in many types
        hint = (" HF_HUB_OFFLINE=1 is set and the dataset is not in the local cache: give a local "
                ".jsonl/.csv/.parquet/.txt file instead.") if hub_offline() and not p.is_file() else ""
        raise EvalSetupError(f"--text-dataset {dataset}: cannot load split {split!r}: {type(err).__name__}: {err}.{hint}") from err
    if column not in ds.column_names:
        raise EvalSetupError(f"--text-dataset {dataset}: no column {column!r}; columns are {ds.column_names} (use --text-column)")
    return "\n\n".join(str(x) for x in ds[column] if x)
