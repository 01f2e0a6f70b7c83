"""Attention of the families whose HF code differs from Llama's, tensor by tensor.

- **gpt-oss** (HF runs it eager: its attention sinks have no SDPA path). RoPE rotates the two
  halves of each head: ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with cos/sin of
  head_dim / 2. Attention: k and v repeated to H heads; scores [B, H, T, T], scaled, plus the
  additive mask; ``cat`` with the sink logit [B, H, T, T + 1], minus its row max, softmax in the
  activation dtype; the probabilities without the sink column (a strided view, no copy) go into
  ``matmul`` with v. The probabilities [B, H, T, T + 1] are returned and held by the decoder
  layer until its MLP returns.
- **DeepSeek's latent attention** (``attention="flash"`` only): q_a, its norm, q [M, H (nope +
  rope)], the kv latent [M, kv_lora + rope], its norm, kv_b [M, H (nope + v)], k [M, H (nope +
  rope)], the output [M, H v]: counted from the projections' sizes, not walked through HF's code.
"""

from __future__ import annotations

_F32, _I64 = 4, 8


def rope_halves(walk, n: int, out: str) -> str:
    """gpt-oss's RoPE on ``n`` elements: four [n / 2] products, two [n / 2] sums, then ``cat``."""
    ls, e, w, h = walk.ls, walk.e, f"{out}: rope", n // 2
    ls.alloc(f"{out}.a", h * e, "attention", f"{w} x1 * cos")
    ls.alloc(f"{out}.b", h * e, "attention", f"{w} x2 * sin")
    ls.alloc(f"{out}.first", h * e, "attention", f"{w} x1 * cos - x2 * sin")
    ls.free(f"{out}.a", f"{out}.b")
    ls.alloc(f"{out}.c", h * e, "attention", f"{w} x2 * cos")
    ls.alloc(f"{out}.d", h * e, "attention", f"{w} x1 * sin")
    ls.alloc(f"{out}.second", h * e, "attention", f"{w} x2 * cos + x1 * sin")
    ls.free(f"{out}.c", f"{out}.d")
    ls.alloc(out, n * e, "attention", f"{w} cat")
    ls.free(f"{out}.first", f"{out}.second")
    return out


def eager_sinks_attention(walk, tag: str) -> str:
    """gpt-oss's eager attention with sinks; returns the [B, T, H, D] output's name (probs kept in ``walk.probs``)."""
    ls, s, B, T, e = walk.ls, walk.s, walk.B, walk.T, walk.e
    nq, H = walk.M * s.q_dim, s.num_heads
    scores, with_sink = B * H * T * T, B * H * T * (T + 1)
    w, n = f"{tag}: eager attention", lambda name: f"{tag}.{name}"  # noqa: E731
    reps = [n("k_rep"), n("v_rep")] if H > s.num_kv_heads else []
    for name in reps:
        ls.alloc(name, nq * e, "attention", f"{w} repeat_kv")
    ls.alloc(n("qk"), scores * e, "attention", f"{w} q k^T")
    ls.alloc(n("scaled"), scores * e, "attention", f"{w} * scaling")
    ls.free(n("qk"))
    ls.alloc(n("masked"), scores * e, "attention", f"{w} + mask")
    ls.free(n("scaled"))
    ls.alloc(n("cat"), with_sink * e, "attention", f"{w} cat(scores, sinks)")
    ls.alloc(n("max"), B * H * T * e, "attention", f"{w} row max")
    ls.alloc(n("argmax"), B * H * T * _I64, "attention", f"{w} row argmax")
    ls.free(n("argmax"))
    ls.alloc(n("shifted"), with_sink * e, "attention", f"{w} - max")
    ls.free(n("cat"), n("max"))
    ls.alloc(n("probs"), with_sink * e, "attention", f"{w} softmax")
    ls.free(n("masked"))  # attn_weights rebound to the probabilities' view
    ls.alloc(n("pv"), nq * e, "attention", f"{w} probs @ v")
    ls.alloc(n("out"), nq * e, "attention", f"{w} transpose.contiguous")
    ls.free(n("pv"), n("shifted"), *reps)
    walk.probs = n("probs")
    return n("out")


def latent_attention(walk, tag: str) -> str:
    """DeepSeek's latent attention from its projection sizes; returns o_proj's output name."""
    ls, s, M, e, a = walk.ls, walk.s, walk.M, walk.e, walk.s.mla
    H, n = s.num_heads, lambda name: f"{tag}.{name}"  # noqa: E731
    q_width, kv_b_width = H * a.qk_head_dim, H * (a.qk_nope_head_dim + a.v_head_dim)
    if a.q_lora_rank:
        ls.alloc(n("q_a"), M * a.q_lora_rank * e, "attention", f"{tag}: q_a_proj")
        walk.norm(n("q_a"), M * a.q_lora_rank, n("q_an"), "attention")
        ls.free(n("q_a"))
    ls.alloc(n("q"), M * q_width * e, "attention", f"{tag}: q_b_proj")
    ls.free(n("q_an"))
    ls.alloc(n("kv_a"), M * a.latent_dim * e, "attention", f"{tag}: kv_a_proj_with_mqa")
    walk.norm(n("kv_a"), M * a.kv_lora_rank, n("kv_an"), "attention")
    ls.alloc(n("kv_b"), M * kv_b_width * e, "attention", f"{tag}: kv_b_proj")
    ls.free(n("kv_an"))
    ls.alloc(n("k"), M * q_width * e, "attention", f"{tag}: k = cat(k_nope, k_rope)")
    ls.free(n("kv_a"))
    ls.alloc(n("out"), M * H * a.v_head_dim * e, "attention", f"{tag}: attention output")
    ls.alloc(n("lse"), M * H * _F32, "attention", f"{tag}: attention logsumexp")
    ls.free(n("lse"))
    ls.alloc(f"{tag}.o", M * s.hidden_size * e, "hidden", f"{tag}: o_proj")
    ls.free(n("out"), n("q"), n("k"), n("kv_b"))
    return f"{tag}.o"
