"""Measure peak activation memory on CUDA, eager against fused, next to the prediction.

"One MLP" is the first experts block of a mixture-of-experts model (the first dense MLP when the
kept layers have none): :func:`mlp_layer` says which layer, for the prediction and the measurement.

For each model: build it on the GPU (random init from the config, truncated to ``layers``, or a
checkpoint's weights), measure every (what, batch, tokens) with HF eager, then
``apply_fused_mlp(model)`` and measure the same again on the same model.

A measurement (:func:`measure_peak`) runs the call once to warm up (Triton autotuning, the cuBLAS
workspace and the allocator's segments all land outside the measured call), then
``reset_peak_memory_stats()``, reads ``memory_allocated()`` as the baseline and reports
``max_memory_allocated() - baseline`` around a second call: the peak above the weights and inputs.
Forwards run under ``torch.inference_mode()``; the full-model prefill passes ``logits_to_keep=1``
(lm_head on the last position only, as servers do) and ``use_cache=True`` (HF's DynamicCache
counts: K and V of every layer).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from swiglu_patch.memory.activation_model import predict_mlp_peak, predict_prefill_peak
from swiglu_patch.memory.configs import ResolvedModel
from swiglu_patch.memory.shape import ModelShape

WHATS = ("mlp", "prefill")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ProfileRow:
    """One (model, what, batch, tokens, path) point. Bytes above weights and inputs."""

    model: str
    what: str
    batch: int
    seq_len: int
    tokens: int
    path: str
    predicted_bytes: int
    predicted_where: str
    measured_bytes: int | None = None

    @property
    def ratio(self) -> float | None:
        """predicted / measured."""
        return self.predicted_bytes / self.measured_bytes if self.measured_bytes else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def mlp_layer(shape: ModelShape) -> int:
    """The decoder layer whose MLP the "mlp" points run: the first experts block, else layer 0."""
    return shape.moe.sparse_layers.index(True) if shape.moe and any(shape.moe.sparse_layers) else 0


def predict_rows(shape: ModelShape, whats, batches, seq_lens, dtype_bytes: int, max_tokens: int) -> list[ProfileRow]:
    """The predicted peaks of every point (no GPU needed).

    Raises:
        NotImplementedError: prefill points of a family whose HF attention is not modelled.
    """
    rows = []
    for path in ("eager", "fused"):
        for what in whats:
            for batch in batches:
                for seq in seq_lens:
                    if batch * seq > max_tokens:
                        continue
                    fused = path == "fused"
                    if what == "mlp":
                        peak = predict_mlp_peak(shape, batch * seq, fused=fused, dtype_bytes=dtype_bytes,
                                                layer=mlp_layer(shape))
                    else:
                        peak = predict_prefill_peak(shape, batch, seq, fused=fused, dtype_bytes=dtype_bytes,
                                                    use_cache=True, logits_to_keep=1, attention="hf")
                    rows.append(ProfileRow(shape.name, what, batch, seq, batch * seq, path, peak.bytes, peak.where))
    return rows


def measure_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated above the current allocation during ``fn()`` (after one warm-up call)."""
    import torch

    fn()  # warm-up: autotuning, cuBLAS workspace, allocator segments
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def build_model(resolved: ResolvedModel, layers: int | None, dtype: str, random_init: bool, attn_implementation: str,
                device: str = "cuda"):
    """The model on ``device`` in ``dtype``, eval mode, no grads; truncated to ``layers`` decoder layers."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, _DTYPES[dtype])
    config = copy.deepcopy(resolved.config)
    if layers:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[: config.num_hidden_layers]
    if resolved.checkpoint and not random_init:
        kwargs = {"num_hidden_layers": config.num_hidden_layers} if layers else {}
        model = AutoModelForCausalLM.from_pretrained(resolved.checkpoint, dtype=torch_dtype, device_map=device,
                                                     attn_implementation=attn_implementation, **kwargs)
    else:
        with torch.device(device):  # initialize on the GPU: fast, and no CPU copy of the weights
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
        model.to(device)
    model.eval().requires_grad_(False)
    return model


def decoder_layers(model):
    """The model's decoder layers (``model.model.layers`` for every supported family)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers; the profiler supports decoder-only HF models")
    return layers


def measure_rows(model, rows: list[ProfileRow], shape: ModelShape, dtype: str, snapshot_dir: Path | None,
                 path: str, device: str = "cuda", measure: Callable | None = None, progress: bool = True) -> None:
    """Fill ``measured_bytes`` of the rows of one path ("eager" or "fused") on ``model`` as it is now.

    ``measure(fn) -> bytes`` defaults to :func:`measure_peak` (CUDA); tests pass a CPU tracker.
    ``progress`` shows a tqdm bar over the points (on stderr).
    """
    import torch

    from tqdm.auto import tqdm

    measure = measure or measure_peak
    torch_dtype = getattr(torch, _DTYPES[dtype])
    mlp = decoder_layers(model)[mlp_layer(shape)].mlp
    todo = [r for r in rows if r.path == path]
    largest = max((r.tokens for r in todo if r.what == "prefill"), default=None)
    with torch.inference_mode():
        for r in tqdm(todo, desc=f"{shape.name} {path}", unit="point", disable=not progress, dynamic_ncols=True):
            if r.what == "mlp":
                x = torch.randn(r.batch, r.seq_len, shape.hidden_size, device=device, dtype=torch_dtype)
                r.measured_bytes = measure(lambda: mlp(x))
                del x
            else:
                ids = torch.randint(0, shape.vocab_size, (r.batch, r.seq_len), device=device)
                call = lambda: model(input_ids=ids, logits_to_keep=1, use_cache=True)  # noqa: E731
                if snapshot_dir is not None and r.tokens == largest:
                    stem = f"{shape.name.replace('/', '_')}_{path}_{r.tokens}"
                    r.measured_bytes = _with_snapshot(call, snapshot_dir / f"{stem}.pickle")
                else:
                    r.measured_bytes = measure(call)
                del ids
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


def _with_snapshot(call, out: Path) -> int:
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        peak = measure_peak(call)
        torch.cuda.memory._dump_snapshot(str(out))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak


def profile_model(resolved: ResolvedModel, *, layers: int | None, whats, batches, seq_lens, dtype: str = "bf16",
                  max_tokens: int = 16384, random_init: bool = True, backend: str = "auto",
                  snapshot_dir: Path | None = None, family: str | None = None, device: str = "cuda",
                  measure: Callable | None = None) -> tuple[list[ProfileRow], dict]:
    """Predict and measure one model: eager, then ``apply_fused_mlp``, then fused.

    Args:
        device, measure: "cuda" with :func:`measure_peak` for real numbers; tests run the same
            pipeline on "cpu" with a tensor-tracking ``measure``.

    Returns:
        (rows, info) where info has the patch report and the attention implementation used.

    Raises:
        RuntimeError: CUDA is not available.
    """
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("swiglu-patch memory: CUDA is not available; measurements need a CUDA GPU")
    from swiglu_patch import apply_fused_mlp

    shape = resolved.shape(family)
    if layers:
        shape = shape.truncated(layers)
    dtype_bytes = torch.finfo(getattr(torch, _DTYPES[dtype])).bits // 8
    rows = predict_rows(shape, whats, batches, seq_lens, dtype_bytes, max_tokens)
    attn = "sdpa" if shape.layout.hf_attention == "sdpa" else "eager"
    snapshot_dir = snapshot_dir if device == "cuda" else None
    model = build_model(resolved, layers, dtype, random_init, attn, device)
    try:
        measure_rows(model, rows, shape, dtype, snapshot_dir, "eager", device, measure)
        report = apply_fused_mlp(model, backend=backend)
        measure_rows(model, rows, shape, dtype, snapshot_dir, "fused", device, measure)
    finally:
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, {"attn_implementation": attn, "patch_report": str(report), "layers": shape.num_layers}
