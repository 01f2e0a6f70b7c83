"""Predicted peak activation memory of a Hugging Face eager forward, eager MLP against fused.

The model walks one forward pass tensor by tensor, in the order HF transformers' Python code
(5.17 to 5.23) creates and drops them under ``torch.inference_mode()``, and keeps the largest
live total (:class:`~swiglu_patch.memory.live_set.LiveSet`). With the CUDA caching allocator
``max_memory_allocated() - memory_allocated()`` before the call is that total, up to 512-byte
rounding. Weights and the input ids exist before the call and are not counted.

What is live, M = B * T tokens, e = bytes per activation element (2 for bf16):

- **MLP, eager** (``down(act(gate(x)) * up(x))``): gate out, act(gate), up out, product:
  peak 3 * M * I * e while the product is made (gate out dies as soon as act(gate) exists).
  Phi-3's packed ``gate_up_proj`` keeps its [M, 2I] output alive through the MLP: 4 * M * I * e.
- **MLP, fused** (swiglu-patch): the [M, I] kernel output and the [M, K] down_proj output:
  (M * I + M * K) * e.
- **Around it**: the embeddings (held by the model's ``inputs_embeds`` for the whole forward),
  the layer input (held by the model loop), the post-attention residual and the normed MLP input:
  4 * M * K * e during a layer's MLP. RMSNorm upcasts: two fp32 copies [M, K] at its peak.
- **Attention, sdpa** (HF's default): q, k, v projections; RoPE makes three temporaries per
  tensor (q*cos, rotate_half, its product with sin); the DynamicCache copies k and v with
  ``torch.cat`` and keeps them (all layers' K and V are live at the end: counted when
  ``use_cache``); SDPA (flash on CUDA: GQA without copies) returns [B, T, H, D] plus an fp32
  log-sum-exp [B, H, T]. A sliding-window layer with T >= window gets a bool [T, T] mask from HF,
  which SDPA turns into a [B, 1, T, T] additive mask and runs the memory-efficient kernel on
  repeated k/v copies (Gemma 3 from 1024 tokens, Mistral 7B v0.1 from 4096).
- **Attention, eager** (Gemma 2, whose soft-capping HF's sdpa path refuses): [B, H, T, T] scores
  in several copies, fp32 softmax, and the probabilities stay alive (HF returns them) until the
  layer ends.
- **Logits**: lm_head on the last ``logits_to_keep`` positions only (1, as servers do); 0 = all.

- **Experts block** (mixture-of-experts layers): :mod:`swiglu_patch.memory.moe_walk`, HF's
  default ``grouped_mm`` path against swiglu-patch's fused grouped GEMMs. Shared experts and
  dense layers are dense MLPs as above.
- **gpt-oss's attention with sinks, DeepSeek's latent attention** (``attention="flash"`` only
  for DeepSeek): :mod:`swiglu_patch.memory.attention_walk`.

``attention="flash"`` instead assumes a fused attention kernel for every layer (no masks, no
k/v repeats, no [T, T] tensors), and ``server_kernels=True`` RMSNorm and RoPE kernels as servers
(vLLM, SGLang) run them: a norm writes only its output (no fp32 copies), RoPE rotates q and k in
place. The KV-capacity calculator uses both, with ``use_cache=False`` (a server writes K and V
into its preallocated cache). The MLP is the same either way: a server's merged gate_up [M, 2I]
plus its act-and-mul output [M, I] is the same 3 * M * I as HF eager.
"""

from __future__ import annotations

from swiglu_patch.memory.attention_walk import eager_sinks_attention, latent_attention, rope_halves
from swiglu_patch.memory.live_set import LiveSet, Peak
from swiglu_patch.memory.moe_walk import moe_block
from swiglu_patch.memory.shape import SLIDING, ModelShape

ATTENTION_MODES = ("hf", "flash")
_F32 = 4
_I64 = 8


def predict_mlp_peak(shape: ModelShape, tokens: int, *, fused: bool, dtype_bytes: int = 2, layer: int = 0) -> Peak:
    """Peak bytes above the input of one MLP forward on [tokens, K]: ``model.model.layers[layer].mlp(x)``.

    Args:
        shape: the model (K, I, family; the experts of a mixture-of-experts model).
        tokens: M, all leading dims flattened (batch * sequence).
        fused: swiglu-patch's fused first half (fused grouped experts) instead of HF's default.
        dtype_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        layer: which decoder layer's MLP (the profiler measures layer 0's): a dense MLP or an
            experts block (see :func:`predict_moe_peak`).

    Returns:
        The :class:`Peak`: dense eager 3*M*I*e (Phi-3: 4*M*I*e), fused (M*I + M*K)*e.

    Raises:
        ValueError: a non-positive size, or a layer the model does not have.
    """
    _check_positive(tokens=tokens, dtype_bytes=dtype_bytes)
    if not 0 <= layer < shape.num_layers:
        raise ValueError(f"layer must be in [0, {shape.num_layers}), got {layer}")
    walk = _Walk(shape, batch=1, seq_len=tokens, fused=fused, e=dtype_bytes, attention="hf", use_cache=False)
    walk.ffn("mlp", layer, tag="mlp")
    return walk.ls.peak


def predict_moe_peak(shape: ModelShape, tokens: int, *, fused: bool, dtype_bytes: int = 2) -> Peak:
    """Peak bytes above the input of one experts block forward on [tokens, K] (the first sparse layer's).

    What ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` before the call reads
    around ``layer.mlp(x)`` for x [1, tokens, K] under ``torch.inference_mode()``, up to 512-byte
    rounding and the grouped GEMMs' workspaces. HF's default (``grouped_mm``) or, with
    ``fused``, swiglu-patch's grouped experts; the router is HF's either way, and a shared
    expert is a dense MLP (fused with ``fused``). See :mod:`swiglu_patch.memory.moe_walk`.

    Args:
        shape: a mixture-of-experts model (``shape.moe`` set); shard it with ``shape.sharded(tp)``
            for one GPU's share under tensor parallelism.
        tokens: T tokens into the block (batch * sequence).
        fused: swiglu-patch's fused experts instead of HF's default.
        dtype_bytes: bytes per activation element.

    Returns:
        The :class:`Peak`, with the step that reached it.

    Raises:
        ValueError: a dense model, or a non-positive size.
    """
    if shape.moe is None or not shape.moe.num_sparse_layers:
        raise ValueError(f"{shape.name}: not a mixture-of-experts model (no experts block); use predict_mlp_peak")
    return predict_mlp_peak(shape, tokens, fused=fused, dtype_bytes=dtype_bytes,
                            layer=shape.moe.sparse_layers.index(True))


def predict_prefill_peak(
    shape: ModelShape,
    batch: int,
    seq_len: int,
    *,
    fused: bool,
    dtype_bytes: int = 2,
    use_cache: bool = True,
    logits_to_keep: int = 1,
    attention: str = "hf",
    server_kernels: bool = False,
) -> Peak:
    """Peak bytes above the weights and input ids of one full-model prefill forward.

    Args:
        shape: the model as built (truncate it with ``shape.truncated(n)`` to match ``--layers n``;
            shard it with ``shape.sharded(tp)`` for one GPU's share).
        batch: B sequences.
        seq_len: T tokens each, none cached before.
        fused: every MLP's first half fused (swiglu-patch) instead of HF eager.
        dtype_bytes: bytes per activation element.
        use_cache: count the DynamicCache HF builds during the forward (K and V of every layer).
        logits_to_keep: positions lm_head runs on (1 = last token, 0 = all T).
        attention: "hf" (what HF runs for the family: sdpa, or eager for Gemma 2) or "flash"
            (a fused attention kernel everywhere; the server assumption).
        server_kernels: fused RMSNorm (output only) and in-place RoPE instead of HF's eager ops.

    Returns:
        The :class:`Peak`, with where it happens and the live bytes by kind.

    Raises:
        ValueError: a non-positive size or an unknown attention mode.
    """
    _check_positive(batch=batch, seq_len=seq_len, dtype_bytes=dtype_bytes)
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "hf" and shape.layout.hf_attention == "unwalked":
        raise NotImplementedError(
            f"{shape.name}: HF's own attention for {shape.family} is not modelled (only its MLP or experts block, "
            "and a server's fused attention); use attention='flash' (CLI: --what mlp, or kv-capacity)")
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    walk = _Walk(shape, batch, seq_len, fused=fused, e=dtype_bytes, attention=attention, use_cache=use_cache,
                 server_kernels=server_kernels)
    walk.model(logits_to_keep)
    return walk.ls.peak


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


class _Walk:
    """One forward pass, tensor by tensor (see the module docstring for what each step keeps)."""

    def __init__(self, shape: ModelShape, batch: int, seq_len: int, *, fused: bool, e: int,
                 attention: str, use_cache: bool, server_kernels: bool = False) -> None:
        self.s, self.layout = shape, shape.layout
        self.B, self.T, self.M = batch, seq_len, batch * seq_len
        self.fused, self.e, self.use_cache, self.server_kernels = fused, e, use_cache, server_kernels
        self.mode = "flash" if attention == "flash" else "sdpa" if self.layout.hf_attention == "sdpa" else "eager"
        self.ls = LiveSet()
        self.masked: set[str] = set()  # layer types whose HF mask is materialized
        self.probs: str | None = None  # eager attention probabilities kept alive until the layer ends

    # -- building blocks ----------------------------------------------------------------------
    def norm(self, src_tag: str, n: int, out: str, out_kind: str = "hidden") -> str:
        """RMSNorm over ``n`` elements; the input stays live (the caller holds it)."""
        ls, e, up = self.ls, self.e, self.e < _F32
        w = f"{out}: rmsnorm"
        if self.server_kernels:  # one fused kernel: fp32 math in registers, only the output is written
            ls.alloc(out, n * e, out_kind, f"{w} (fused kernel)")
            return out
        if up:
            ls.alloc(f"{out}.f32", n * _F32, "norm", f"{w} x.float()")
        ls.alloc(f"{out}.pow", n * _F32, "norm", f"{w} x.pow(2)")
        ls.free(f"{out}.pow")
        ls.alloc(f"{out}.scaled", n * _F32, "norm", f"{w} x * rsqrt(var)")
        ls.free(f"{out}.f32")
        if self.layout.norm_style == "gpt_oss":  # (weight * x).to(dtype): x stays referenced until it returns
            ls.alloc(f"{out}.weighted", n * _F32, "norm", f"{w} weight * x")
            ls.alloc(out, n * e if up else 0, out_kind, f"{w} .to(dtype)")
            if not up:
                ls.rename(f"{out}.weighted", out, out_kind)
            ls.free(f"{out}.weighted", f"{out}.scaled")
        elif self.layout.norm_style == "llama":  # weight * x.to(dtype)
            if up:
                ls.alloc(f"{out}.cast", n * e, "norm", f"{w} .to(dtype)")
            ls.alloc(out, n * e, out_kind, f"{w} weight * x")
            ls.free(f"{out}.cast", f"{out}.scaled")
        else:  # (x * (1 + weight)).type_as(x), in fp32
            ls.alloc(f"{out}.weighted", n * _F32, "norm", f"{w} x * (1 + weight)")
            ls.free(f"{out}.scaled")
            if up:
                ls.alloc(out, n * e, out_kind, f"{w} .type_as(x)")
                ls.free(f"{out}.weighted")
            else:
                ls.rename(f"{out}.weighted", out, out_kind)
        return out

    def rope(self, src: str, n: int, out: str) -> str:
        """q * cos + rotate_half(q) * sin: three temporaries of ``n`` elements besides the output.

        With a rotary fraction below 1 (GLM) only that share of ``n`` is rotated here; the caller
        concatenates the pass-through part (:meth:`attention`).
        """
        ls, e, w = self.ls, self.e, f"{out}: rope"
        if self.server_kernels:  # rotated in place
            return src
        if self.layout.hf_attention == "eager_sinks":  # gpt-oss rotates the two halves of each head
            return rope_halves(self, n, out)
        n = int(n * self.layout.rotary_fraction)
        ls.alloc(f"{out}.cos", n * e, "attention", f"{w} x * cos")
        ls.alloc(f"{out}.neg", n * e // 2, "attention", f"{w} -x2")
        ls.alloc(f"{out}.rot", n * e, "attention", f"{w} cat(-x2, x1)")
        ls.free(f"{out}.neg")
        ls.alloc(f"{out}.sin", n * e, "attention", f"{w} rotate_half(x) * sin")
        ls.free(f"{out}.rot")
        ls.alloc(out, n * e, "attention", f"{w} sum")
        ls.free(f"{out}.cos", f"{out}.sin")
        return out

    def ffn(self, x: str, layer: int, tag: str) -> str:
        """Layer ``layer``'s MLP or experts block on ``x`` [M, K]; returns its output's name."""
        return moe_block(self, x, tag) if self.s.is_sparse(layer) else self.mlp(x, tag)

    def mlp(self, x: str, tag: str, intermediate_size: int | None = None) -> str:
        """A dense MLP (of the model's I unless given) on ``x`` [M, K]; returns the down_proj output's name."""
        ls, M, K, e = self.ls, self.M, self.s.hidden_size, self.e
        I = intermediate_size or self.s.intermediate_size  # noqa: E741
        if self.fused:
            ls.alloc(f"{tag}.h", M * I * e, "mlp", f"{tag}: fused act(gate) * up")
            ls.alloc(f"{tag}.down", M * K * e, "hidden", f"{tag}: down_proj")
            ls.free(f"{tag}.h")
        elif self.layout.fused_gate_up:  # Phi-3: gate and up are views of one [M, 2I] output
            ls.alloc(f"{tag}.gate_up", 2 * M * I * e, "mlp", f"{tag}: gate_up_proj")
            ls.alloc(f"{tag}.act", M * I * e, "mlp", f"{tag}: act(gate)")
            ls.alloc(f"{tag}.prod", M * I * e, "mlp", f"{tag}: up * act(gate)")
            ls.free(f"{tag}.act")
            ls.alloc(f"{tag}.down", M * K * e, "hidden", f"{tag}: down_proj")
            ls.free(f"{tag}.prod", f"{tag}.gate_up")
        else:
            ls.alloc(f"{tag}.gate", M * I * e, "mlp", f"{tag}: gate_proj")
            ls.alloc(f"{tag}.act", M * I * e, "mlp", f"{tag}: act(gate)")
            ls.free(f"{tag}.gate")
            ls.alloc(f"{tag}.up", M * I * e, "mlp", f"{tag}: up_proj")
            ls.alloc(f"{tag}.prod", M * I * e, "mlp", f"{tag}: act(gate) * up")
            ls.free(f"{tag}.act", f"{tag}.up")
            ls.alloc(f"{tag}.down", M * K * e, "hidden", f"{tag}: down_proj")
            ls.free(f"{tag}.prod")
        return f"{tag}.down"

    # -- attention -----------------------------------------------------------------------------
    def attention(self, x: str, layer: int) -> str:
        """Self-attention on the normed ``x``; returns o_proj's output name."""
        ls, s, M, e = self.ls, self.s, self.M, self.e
        tag = f"layer {layer} attn"
        if s.mla:
            return latent_attention(self, tag)
        nq, nkv = M * s.q_dim, M * s.kv_dim
        views: list[str] = []  # tensors q/k/v are views of (freed when attention returns)
        if self.layout.fused_qkv:
            ls.alloc(f"{tag}.qkv", (nq + 2 * nkv) * e, "attention", f"{tag}: qkv_proj")
            q, k, v, views = None, None, None, [f"{tag}.qkv"]
        else:
            q, k, v = f"{tag}.q", f"{tag}.k", f"{tag}.v"
            for name, n in ((q, nq), (k, nkv), (v, nkv)):
                ls.alloc(name, n * e, "attention", f"{tag}: {name[-1]}_proj")
                if self.layout.qk_norm and self.layout.qk_norm_before_transpose and name != v:
                    self.norm(name, n, f"{name}n", "attention")
                    ls.free(name)
            if self.layout.qk_norm:
                if self.layout.qk_norm_before_transpose:
                    q, k = f"{q}n", f"{k}n"
                else:
                    for name, n in ((q, nq), (k, nkv)):
                        self.norm(name, n, f"{name}n", "attention")
                        ls.free(name)
                    q, k = f"{q}n", f"{k}n"
        qe = self.rope(q, nq, f"{tag}.q_rope")
        ke = self.rope(k, nkv, f"{tag}.k_rope")
        if qe != q and self.layout.rotary_fraction < 1:  # torch.cat([rotated, pass-through]) for q, then k
            for name, n in ((qe, nq), (ke, nkv)):
                ls.alloc(f"{name}.cat", n * e, "attention", f"{tag}: rope cat(rotated, pass)")
                ls.free(name)
            qe, ke = f"{qe}.cat", f"{ke}.cat"
        ls.free(*(n for n in (q, k) if n and n not in (qe, ke)))
        if self.use_cache:  # DynamicCache: torch.cat([empty, k]) copies; the cache keeps the copies
            ls.alloc(f"cache {layer}.k", nkv * e, "kv_cache", f"{tag}: cache k")
            ls.alloc(f"cache {layer}.v", nkv * e, "kv_cache", f"{tag}: cache v")
            ls.free(ke, *(n for n in (v,) if n))
            held = []
        else:
            held = [ke] + ([v] if v else [])
        out = self.attention_core(tag, layer)
        ls.alloc(f"{tag}.o", M * s.hidden_size * e, "hidden", f"{tag}: o_proj")
        ls.free(out, qe, *held, *views)
        return f"{tag}.o"

    def attention_core(self, tag: str, layer: int) -> str:
        """softmax(q k^T) v for one layer; returns the [B, T, H, D] output's name."""
        ls, s, B, T, e = self.ls, self.s, self.B, self.T, self.e
        nq = self.M * s.q_dim
        groups = s.num_heads // s.num_kv_heads
        layer_type = s.layer_types[layer]
        w = f"{tag}: attention"
        if self.mode == "eager" and self.layout.hf_attention == "eager_sinks":
            return eager_sinks_attention(self, tag)
        if self.mode == "eager":
            return self._eager_attention(tag, layer_type)
        masked = self.mode == "sdpa" and layer_type in self.masked
        reps = []
        if masked and groups > 1:  # HF repeats k/v when a mask rules out SDPA's GQA path
            reps = [f"{tag}.k_rep", f"{tag}.v_rep"]
            for name in reps:
                ls.alloc(name, nq * e, "attention", f"{w} repeat_kv")
        if masked:  # SDPA: where(bool mask, 0, -inf) -> [B, 1, T, T] in the query dtype
            ls.alloc(f"{tag}.mask_f", B * T * T * e, "mask", f"{w} additive mask")
        lse_len = -(-T // 32) * 32 if masked else T  # memory-efficient kernel pads lse to 32
        ls.alloc(f"{tag}.out", nq * e, "attention", f"{w} output")
        ls.alloc(f"{tag}.lse", B * s.num_heads * lse_len * _F32, "attention", f"{w} logsumexp")
        ls.free(f"{tag}.lse", f"{tag}.mask_f", *reps)
        return f"{tag}.out"

    def _eager_attention(self, tag: str, layer_type: str) -> str:
        ls, s, B, T, e = self.ls, self.s, self.B, self.T, self.e
        nq, groups = self.M * s.q_dim, s.num_heads // s.num_kv_heads
        scores = B * s.num_heads * T * T
        w = f"{tag}: eager attention"
        reps = [f"{tag}.k_rep", f"{tag}.v_rep"] if groups > 1 else []
        for name in reps:
            ls.alloc(name, nq * e, "attention", f"{w} repeat_kv")
        # Gemma 2 (the family HF runs eager) soft-caps the scores: / cap, tanh, * cap
        steps = ["qk", "scaled"] + (["capdiv", "tanh", "capmul"] if s.layout.hf_attention == "eager" else [])
        steps.append("masked")
        prev = None
        for step in steps:
            ls.alloc(f"{tag}.{step}", scores * e, "attention", f"{w} scores {step}")
            ls.free(*(p for p in (prev,) if p))
            prev = f"{tag}.{step}"
        # attn_weights = softmax(attn_weights, dtype=fp32).to(dtype): the input lives until rebound
        ls.alloc(f"{tag}.softmax32", scores * _F32, "attention", f"{w} softmax fp32")
        ls.alloc(f"{tag}.probs", scores * e, "attention", f"{w} probs .to(dtype)")
        ls.free(f"{tag}.softmax32", prev)
        ls.alloc(f"{tag}.pv", nq * e, "attention", f"{w} probs @ v")
        ls.alloc(f"{tag}.out", nq * e, "attention", f"{w} transpose.contiguous")
        ls.free(f"{tag}.pv", *reps)
        self.probs = f"{tag}.probs"  # returned by HF and held by the layer's `_` until it returns
        return f"{tag}.out"

    # -- layer and model -----------------------------------------------------------------------
    def layer(self, x: str, i: int) -> str:
        ls, MK, e = self.ls, self.M * self.s.hidden_size, self.e
        tag = f"layer {i}"
        four = self.layout.norms_per_layer == 4
        hn = self.norm(x, MK, f"{tag} input_norm")
        o = self.attention(hn, i)
        ls.free(hn)
        if four:
            o = self._swap(o, self.norm(o, MK, f"{tag} post_attn_norm"))
        ls.alloc(f"{tag} h1", MK * e, "hidden", f"{tag}: residual + attn")
        ls.free(o)
        hn2 = self.norm(f"{tag} h1", MK, f"{tag} pre_mlp_norm")
        d = self.ffn(hn2, i, tag=f"{tag} mlp")
        if self.probs and self.layout.hf_attention == "eager_sinks":  # `_` rebound to the MLP's router scores
            ls.free(self.probs)
            self.probs = None
        ls.free(hn2)
        if four:
            d = self._swap(d, self.norm(d, MK, f"{tag} post_mlp_norm"))
        ls.alloc(f"{tag} out", MK * e, "hidden", f"{tag}: residual + mlp")
        ls.free(d, f"{tag} h1")
        if self.probs:
            ls.free(self.probs)
            self.probs = None
        return f"{tag} out"

    def _swap(self, old: str, new: str) -> str:
        self.ls.free(old)
        return new

    def model(self, logits_to_keep: int) -> None:
        ls, s, B, T, e = self.ls, self.s, self.B, self.T, self.e
        MK = self.M * s.hidden_size
        if self.layout.embed_scale:
            ls.alloc("embed.raw", MK * e, "hidden", "embed_tokens")
            ls.alloc("embeds", MK * e, "hidden", "embeddings * sqrt(K)")
            ls.free("embed.raw")
        else:
            ls.alloc("embeds", MK * e, "hidden", "embed_tokens")
        ls.alloc("position_ids", T * _I64, "other", "position_ids")
        self._masks()
        rope_types = set(s.layer_types) if s.family == "gemma3_text" else {"all"}
        for kind in sorted(rope_types):
            for name in ("cos", "sin"):
                rotary = s.mla.qk_rope_head_dim if s.mla else int(s.head_dim * self.layout.rotary_fraction)
                rotary //= 2 if self.layout.hf_attention == "eager_sinks" else 1  # gpt-oss: cos of head_dim / 2
                ls.alloc(f"rope {kind}.{name}", T * rotary * e, "other", "rotary cos/sin")
        x = "embeds"
        for i in range(s.num_layers):
            out = self.layer(x, i)
            if x != "embeds":
                ls.free(x)
            x = out
        self.norm(x, MK, "final_norm")
        if x != "embeds":
            ls.free(x)
        rows = B * (logits_to_keep or T)
        ls.alloc("logits", rows * s.vocab_size * e, "logits", "lm_head")
        if s.final_logit_softcapping:  # logits / cap, tanh, * cap: each a new tensor
            prev = "logits"
            for step in ("div", "tanh", "mul"):
                ls.alloc(f"logits.{step}", rows * s.vocab_size * e, "logits", f"logit softcap {step}")
                ls.free(prev)
                prev = f"logits.{step}"

    def _masks(self) -> None:
        """The masks HF materializes at the model level (kept for the whole forward)."""
        s, T, B = self.s, self.T, self.B
        if self.mode == "flash":
            return
        for kind in sorted(set(s.layer_types)):
            sliding = kind == SLIDING and s.sliding_window is not None
            if self.mode == "eager":  # float [B, 1, T, T] additive masks, one per layer type
                self.masked.add(kind)
                self.ls.alloc(f"mask {kind}", B * T * T * self.e, "mask", f"{kind} mask")
            elif sliding and T >= s.sliding_window:  # bool [1, 1, T, T], expanded over the batch
                self.masked.add(kind)
                self.ls.alloc(f"mask {kind}", T * T, "mask", f"{kind} mask")
        if self.mode == "sdpa" and self.layout.unused_sliding_mask and SLIDING not in s.layer_types:
            self.ls.alloc(f"mask {SLIDING}", T * T, "mask", "sliding mask no layer uses")
