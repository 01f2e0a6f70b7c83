"""How many KV-cache tokens fit on a GPU, eager MLP against fused, at a given prefill chunk.

    KV budget per GPU = GPU memory x fraction - overhead - weights per GPU - peak activation per chunk
    KV bytes per token = layers x 2 (K and V) x KV heads per GPU x head_dim x KV dtype bytes
                         (latent attention: layers x (kv_lora_rank + rope dim) x bytes, on every GPU)
    KV tokens          = floor(budget / KV bytes per token)

The activation peak comes from :mod:`swiglu_patch.memory.activation_model`, the walk of HF's
forward that ``swiglu-patch memory`` checks against the GPU, run for one prefill chunk with a
server's kernels (``runtime="server"``: fused attention, fused RMSNorm, in-place RoPE) or with
HF's own norms and RoPE (``runtime="hf"``), and ``use_cache=False``: a server writes K and V into
the cache pool it preallocated, so they are KV memory, not activation. Fusing the MLP shrinks only
that peak, so every byte it saves becomes KV cache: (eager peak - fused peak) / KV bytes per token.

Mixture-of-experts models: every expert's weights are resident; the experts block's activation
peak is modelled for HF's default ``grouped_mm`` path and for swiglu-patch's fused grouped
experts (:mod:`swiglu_patch.memory.moe_walk`), the pairs of one chunk being chunk x top-k.

A hybrid model's linear-attention layers (Qwen3.5) cache no tokens; their fixed state per
sequence is added to the per-sequence KV bytes.

Sliding-window layers (Gemma 2/3, Mistral 7B v0.1, Phi-3 mini) are reported two ways: the full
count (every layer keeps every token) and the count capped at the window (sliding layers keep at
most ``window`` tokens of each sequence, as servers with a hybrid KV allocator do), which depends
on the sequence length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from swiglu_patch.memory.activation_model import predict_prefill_peak
from swiglu_patch.memory.tables import GIB
from swiglu_patch.memory.shape import ModelShape
from swiglu_patch.memory.weights import weight_bytes_per_gpu

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ACTIVATION_BYTES = 2  # activations in bf16/fp16 whatever the weight dtype
TP_CANDIDATES = (1, 2, 4, 8, 16)

RUNTIMES = ("server", "hf")

ASSUMPTIONS = (
    "Activation peak: the tensors live in the forward of one prefill chunk, walked through HF's decoder code "
    "(the walk `swiglu-patch memory` checks against torch.cuda.max_memory_allocated) with a server's kernels: "
    "fused attention (no [T, T] tensors, no k/v repeats), RMSNorm writing only its output, RoPE in place "
    "(--runtime hf keeps HF's fp32 norm copies and RoPE temporaries); K/V written straight to the cache pool, "
    "logits for the last token only, activations in bf16.",
    "Eager MLP: gate out, act(gate), up out and their product live together (3 x chunk x I/tp elements); "
    "fused: the [chunk, I/tp] kernel output and the down_proj output.",
    "KV budget = GPU memory x fraction - overhead - weights - activation peak (vLLM's gpu_memory_utilization "
    "accounting). CUDA graphs, NCCL buffers and allocator fragmentation belong in the overhead (0 unless given).",
    "Tensor parallel: heads, I and the vocabulary split tp ways; KV heads split too, or are replicated one per "
    "GPU when fewer than tp; norm weights are replicated; K is whole on every GPU.",
    "Mixture of experts: all experts' weights resident (split tp ways, no expert parallelism; routers "
    "replicated); the experts block of a chunk holds chunk x top-k (token, expert) pairs. Eager: HF's "
    "default grouped_mm path (permuted copy of x, gate_up [pairs, 2 I_e], act and product, down, weighted and "
    "un-permuted rows; a server's own fused-MoE kernel holds less and is not modelled); fused: index-gathered rows, "
    "out [chunk, K], the pairs' expert blocks, h [pairs, I_e], y [pairs, K] (both paths checked on an H100). Latent attention "
    "(DeepSeek) caches kv_lora_rank + rope dim values per token and layer, on every GPU.",
    "Sliding-window layers: 'full' keeps every token in every layer; 'capped' keeps at most the window in "
    "sliding layers (hybrid KV allocators such as vLLM V1's), so it depends on the sequence length.",
    "Linear-attention layers (Qwen3.5's Gated DeltaNet): no K/V per token; each sequence holds their state "
    "(the convolution's last kernel - 1 inputs in the KV dtype, the recurrent state [Hv, Dk, Dv] in fp32), "
    "counted in the per-sequence figures. In the activation walk every layer of such a model is walked as a fused "
    "attention of its full-attention layers' shape (DeltaNet's own temporaries are not modelled); the "
    "experts block holds the peak at these chunk sizes.",
)


class InsufficientMemoryError(ValueError):
    """The weights (and one chunk's activations) do not fit in the usable GPU memory."""


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """Full count: attention layers x 2 x KV heads per GPU x head_dim x bytes (every attention layer
    keeps every token; a hybrid model's linear-attention layers keep a fixed state per sequence instead,
    counted by `kv_bytes_per_sequence`).

    Raises:
        ValueError: unknown KV dtype, or tp not compatible with the heads.
    """
    attention_layers = shape.num_layers - shape.num_linear_layers
    return attention_layers * _kv_values_per_layer_token(shape, tp) * _kv_bytes(kv_dtype)


def _kv_values_per_layer_token(shape: ModelShape, tp: int) -> int:
    """K and V values one GPU caches per token and layer (the latent, whole, for latent attention)."""
    per_gpu = shape.sharded(tp)  # validates tp
    if shape.mla:
        return shape.mla.latent_dim
    return 2 * per_gpu.num_kv_heads * shape.head_dim


def kv_bytes_per_sequence(shape: ModelShape, seq_len: int, kv_dtype: str = "bf16", tp: int = 1,
                          capped: bool = True) -> int:
    """KV bytes of one sequence of ``seq_len`` tokens on one GPU.

    With ``capped``, each sliding-window layer keeps min(seq_len, window) tokens. Each linear-attention
    layer adds its state (`LinearAttnShape.state_bytes`: the convolution's inputs in the KV dtype, the
    recurrent state in fp32), whatever seq_len is.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    per_layer_token = _kv_values_per_layer_token(shape, tp) * _kv_bytes(kv_dtype)
    window = shape.sliding_window
    sliding_tokens = min(seq_len, window) if capped and window else seq_len
    state = shape.num_linear_layers * shape.linear.state_bytes(_kv_bytes(kv_dtype), tp) if shape.linear else 0
    return per_layer_token * (shape.num_full_layers * seq_len + shape.num_sliding_layers * sliding_tokens) + state


def _kv_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"KV-cache dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    return KV_DTYPE_BYTES[kv_dtype]


@dataclass(frozen=True)
class CapacityResult:
    """KV-cache capacity of one model on one GPU, eager MLP against fused (bytes unless named otherwise)."""

    model: str
    source: str
    runtime: str
    gpu_mem_bytes: int
    mem_fraction: float
    overhead_bytes: int
    tp: int
    weight_dtype: str
    kv_dtype: str
    chunk_tokens: int
    seq_len: int
    weights_per_gpu: int
    act_eager: int
    act_fused: int
    act_eager_where: str
    act_fused_where: str
    kv_per_token_full: int
    kv_per_seq_full: int
    kv_per_seq_capped: int
    budget_eager: int
    budget_fused: int
    tokens_eager_full: int
    tokens_fused_full: int
    tokens_eager_capped: int
    tokens_fused_capped: int
    seqs_eager: int
    seqs_fused: int
    seqs_eager_full: int
    seqs_fused_full: int
    sliding_window: int | None
    num_sliding_layers: int
    assumptions: tuple[str, ...] = field(default=ASSUMPTIONS)

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_mem_bytes * self.mem_fraction) - self.overhead_bytes

    @property
    def extra_tokens_full(self) -> int:
        return self.tokens_fused_full - self.tokens_eager_full

    @property
    def extra_tokens_capped(self) -> int:
        return self.tokens_fused_capped - self.tokens_eager_capped

    @property
    def extra_pct(self) -> float:
        """Extra KV tokens as a percentage of the eager count (the same for full and capped)."""
        return 100.0 * self.extra_tokens_full / self.tokens_eager_full if self.tokens_eager_full else float("inf")

    @property
    def extra_seqs(self) -> int:
        return self.seqs_fused - self.seqs_eager

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d.update(usable_bytes=self.usable_bytes, extra_tokens_full=self.extra_tokens_full,
                 extra_tokens_capped=self.extra_tokens_capped, extra_pct=self.extra_pct, extra_seqs=self.extra_seqs)
        return d


def kv_capacity(
    shape: ModelShape,
    *,
    gpu_mem_gib: float,
    chunk_tokens: int = 512,
    tp: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    mem_fraction: float = 0.9,
    seq_len: int = 8192,
    overhead_gib: float = 0.0,
    runtime: str = "server",
) -> CapacityResult:
    """KV-cache tokens and sequences that fit, eager MLP against fused.

    Args:
        shape: the whole model.
        gpu_mem_gib: memory of one GPU, GiB.
        chunk_tokens: prefill chunk size (vLLM's max_num_batched_tokens), tokens per forward.
        tp: tensor-parallel degree.
        weight_dtype: "bf16", "fp16", "fp8", "int8", "int4" or "fp32".
        kv_dtype: "bf16", "fp16", "fp8" or "fp32".
        mem_fraction: share of the GPU the server may use (vLLM's gpu_memory_utilization).
        seq_len: sequence length for the concurrent-sequence count and the capped KV count.
        overhead_gib: memory outside weights, activations and KV (CUDA graphs, NCCL, fragmentation).
        runtime: "server" (fused attention, RMSNorm and RoPE kernels) or "hf" (fused attention, HF's
            eager norms and RoPE).

    Returns:
        A :class:`CapacityResult`; a path whose budget is not positive gets 0 tokens.

    Raises:
        InsufficientMemoryError: the weights plus the smaller activation peak exceed the usable memory.
        ValueError: a bad size, fraction, dtype or tp.
    """
    _check_settings(gpu_mem_gib=gpu_mem_gib, chunk_tokens=chunk_tokens, mem_fraction=mem_fraction, seq_len=seq_len,
                    overhead_gib=overhead_gib, runtime=runtime)
    per_gpu = shape.sharded(tp)
    weights = int(round(weight_bytes_per_gpu(shape, weight_dtype, tp, hf_tp_plan=runtime == "hf")))
    peaks = {fused: predict_prefill_peak(per_gpu, 1, chunk_tokens, fused=fused, dtype_bytes=ACTIVATION_BYTES,
                                         use_cache=False, logits_to_keep=1, attention="flash",
                                         server_kernels=runtime == "server")
             for fused in (False, True)}
    gpu_bytes, overhead = int(gpu_mem_gib * GIB), int(overhead_gib * GIB)
    usable = int(gpu_bytes * mem_fraction) - overhead
    if weights + min(p.bytes for p in peaks.values()) >= usable:
        raise InsufficientMemoryError(
            f"{shape.name}: {weights / GIB:.1f} GiB of {weight_dtype} weights per GPU (tp={tp}) plus "
            f"{peaks[True].bytes / GIB:.2f} GiB of activations for a {chunk_tokens}-token chunk do not fit in "
            f"{usable / GIB:.1f} GiB usable ({mem_fraction:g} x {gpu_mem_gib:g} GiB - {overhead_gib:g} GiB overhead); "
            "no room is left for the KV cache. Use a larger --tp, a smaller --weight-dtype, a smaller chunk, "
            "or a bigger GPU."
        )
    per_token = kv_bytes_per_token(shape, kv_dtype, tp)
    seq_full = kv_bytes_per_sequence(shape, seq_len, kv_dtype, tp, capped=False)
    seq_capped = kv_bytes_per_sequence(shape, seq_len, kv_dtype, tp, capped=True)
    budget = {f: usable - weights - p.bytes for f, p in peaks.items()}
    fit = {f: max(0, b) for f, b in budget.items()}
    return CapacityResult(
        model=shape.name, source=shape.source, runtime=runtime, gpu_mem_bytes=gpu_bytes, mem_fraction=mem_fraction,
        overhead_bytes=overhead, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, chunk_tokens=chunk_tokens,
        seq_len=seq_len, weights_per_gpu=weights,
        act_eager=peaks[False].bytes, act_fused=peaks[True].bytes,
        act_eager_where=peaks[False].where, act_fused_where=peaks[True].where,
        kv_per_token_full=per_token, kv_per_seq_full=seq_full, kv_per_seq_capped=seq_capped,
        budget_eager=budget[False], budget_fused=budget[True],
        tokens_eager_full=fit[False] // per_token, tokens_fused_full=fit[True] // per_token,
        # capped: tokens at the per-token cost of a seq_len-long sequence
        tokens_eager_capped=fit[False] * seq_len // seq_capped, tokens_fused_capped=fit[True] * seq_len // seq_capped,
        seqs_eager=fit[False] // seq_capped, seqs_fused=fit[True] // seq_capped,
        seqs_eager_full=fit[False] // seq_full, seqs_fused_full=fit[True] // seq_full,
        sliding_window=shape.sliding_window, num_sliding_layers=shape.num_sliding_layers,
    )


def _check_settings(*, gpu_mem_gib: float, chunk_tokens: int = 512, mem_fraction: float = 0.9, seq_len: int = 8192,
                    overhead_gib: float = 0.0, runtime: str = "server", **_) -> None:
    """Raise ValueError for a setting no GPU could have (the message names it and the value)."""
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    if not gpu_mem_gib > 0:
        raise ValueError(f"gpu_mem_gib must be > 0, got {gpu_mem_gib}")
    if not overhead_gib >= 0:
        raise ValueError(f"overhead_gib must be >= 0, got {overhead_gib}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")


def smallest_tp(shape: ModelShape, **kwargs) -> int:
    """The smallest tp in (1, 2, 4, 8, 16) that divides the model and leaves room for the KV cache.

    Args:
        shape: the whole model.
        **kwargs: as for :func:`kv_capacity` (without ``tp``).

    Raises:
        ValueError: a bad setting (checked once, before trying any tp).
        InsufficientMemoryError: no tp fits.
    """
    _check_settings(**kwargs)
    last: Exception | None = None
    for tp in TP_CANDIDATES:
        try:
            result = kv_capacity(shape, tp=tp, **kwargs)
        except InsufficientMemoryError as exc:
            last = exc
            continue
        except ValueError as exc:  # tp does not divide the heads or I
            last = exc
            continue
        if result.seqs_eager >= 1:
            return tp
    raise InsufficientMemoryError(f"{shape.name}: no tensor-parallel degree in {TP_CANDIDATES} fits ({last})")
