"""The experts block of a mixture-of-experts layer, tensor by tensor: HF's default path and ours.

T tokens reach the block as x [T, K]; k experts per token make S = T * k (token, expert) pairs;
E experts of I_e columns each; e bytes per activation element; w = 4 where the family keeps
its routing weights fp32 (:class:`~swiglu_patch.memory.moe_shape.MoeLayout`), else e.

- **Router** (HF's, the same on both paths): logits [T, E], its softmax or sigmoid temporaries
  in fp32, then the top-k weights [T, k] (w bytes) and expert ids [T, k] (int64). The block
  keeps all three until it returns.
- **Experts, HF default** (``grouped_mm`` in transformers/integrations/moe.py): sort the pairs
  by expert (sorted ids and the permutation, int64 [S] each), gather the permuted copy of x
  [S, K], the sorted weights [S], the histogram input [S] and per-expert counts and offsets [E];
  gate_up [S, 2 I_e]; the gate (``act(gate) * up``: [S, I_e] twice, 4 S I_e e with gate_up;
  gpt-oss's clamped gate makes five [S, I_e] temporaries besides gate_up, and its per-pair
  biases [S, 2 I_e] then [S, K]); down [S, K]; weighted [S, K] (w bytes if larger than e);
  the inverse permutation and the weighted rows put back in (token, slot) order [S, K]; the sum
  over slots [T, K]. The permuted copy of x, the down output and the weighted rows live until
  the function returns: for Qwen3-30B-A3B (K = 2048, I_e = 768) the peak is at the un-permute,
  4 S K e, not at the gate (S K e + 4 S I_e e). Up to transformers 5.17 (`hf_masks_sentinels`)
  the path also masks expert-parallel sentinel rows on every call: a bool [S] mask, and gate_up
  and down each copied by an out-of-place ``masked_fill`` (both copies alive for a moment); from
  5.18 it masks only under expert parallelism. Up to 5.23 DeepSeek's and GLM's router also
  casts its weight to fp32 on every call ([E, K] fp32 beside x's fp32 copy).
- **Experts, fused** (swiglu-patch, `kernels/experts.py` and `experts_gemm.py`): the output
  out [T, K] first (the combine writes it last); the routing metadata of `experts_routing`: the
  pairs sorted into per-expert blocks of BLOCK_M rows (int64 [capacity], capacity = S + min(S, E)
  (BLOCK_M - 1) rounded up to BLOCK_M; one more slot on the torch path taken past 4,096 pairs or
  1,023 experts) and each block's expert (int64 [capacity / BLOCK_M]), BLOCK_M from the planner's
  rule for T (`kernels/rules.EXPERTS_RULES`); the grouped gated GEMM gathers rows of x by index
  (no permuted copy) and writes h = act(gate) * up [S, I_e] in x's dtype; the down grouped GEMM
  writes y [S, K] (routing weight applied) in (token, slot) order; the combine sums y's k rows of
  each token into out in a fixed order; h and y are freed when the call returns.
  Peak T K e + S (I_e + K) e + the metadata.
- **Shared expert** (Qwen2-MoE, DeepSeek, GLM): a dense MLP of I_s, eager or fused like every
  dense MLP, run before the router (Qwen2-MoE, whose output [T, K] then lives through the
  experts and is scaled by ``sigmoid(Linear(K, 1))``) or after the experts on the block's input
  (DeepSeek, GLM, whose experts' output [T, K] lives through it); the two outputs are added.

Allocations inside one op (the grouped GEMM's workspace) are not counted.
"""

from __future__ import annotations

from .hf_releases import hf_casts_router_weight, hf_masks_sentinels

_F32, _I64, _I32 = 4, 8, 4


def moe_block(walk, x: str, tag: str) -> str:
    """The experts block on ``x`` [T, K] in ``walk`` (an activation-model walk); returns its output's name."""
    ls, m, T, K, e = walk.ls, walk.s.moe, walk.M, walk.s.hidden_size, walk.e
    lay = m.layout
    shared = None
    if m.shared_intermediate_size and lay.shared_first:
        shared = walk.mlp(x, f"{tag} shared", intermediate_size=m.shared_intermediate_size)
    routed = _router(walk, tag)
    experts = (_experts_fused if walk.fused else _experts_grouped_mm)(walk, tag, routed[1])
    out = experts
    if m.shared_intermediate_size:
        if lay.shared_first:  # sigmoid(shared_expert_gate(x)) * shared, then expert_output + shared
            ls.alloc(f"{tag}.sgate", T * e, "mlp", f"{tag}: shared_expert_gate")
            ls.alloc(f"{tag}.ssig", T * e, "mlp", f"{tag}: sigmoid")
            ls.free(f"{tag}.sgate")
            ls.alloc(f"{tag}.sgated", T * K * e, "hidden", f"{tag}: gate * shared expert")
            ls.free(f"{tag}.ssig", shared)
            shared = f"{tag}.sgated"
        else:
            shared = walk.mlp(x, f"{tag} shared", intermediate_size=m.shared_intermediate_size)
        ls.alloc(f"{tag}.sum", T * K * e, "hidden", f"{tag}: experts + shared expert")
        ls.free(experts, shared)
        out = f"{tag}.sum"
    ls.free(*routed)
    return out


def _router(walk, tag: str) -> tuple[str, str, str]:
    """HF's router on the block input; returns the names of (logits, top-k weights, top-k ids)."""
    ls, m, T, K, e = walk.ls, walk.s.moe, walk.M, walk.s.hidden_size, walk.e
    E, k, lay = m.num_experts, m.top_k, m.layout
    w = f"{tag}: router"
    logits, weights, ids = f"{tag}.logits", f"{tag}.topk_w", f"{tag}.topk_ids"
    if lay.router == "sigmoid_group":  # fp32 linear on an fp32 copy of x, sigmoid, masked grouped top-k
        ls.alloc(f"{tag}.x32", T * K * _F32 if e < _F32 else 0, "mlp", f"{w} x.float()")
        ls.alloc(f"{tag}.w32", E * K * _F32 if e < _F32 and hf_casts_router_weight() else 0, "mlp",
                 f"{w} weight.float()")
        ls.alloc(logits, T * E * _F32, "mlp", f"{w} logits")
        ls.free(f"{tag}.x32", f"{tag}.w32")
        ls.alloc(f"{tag}.scores", T * E * _F32, "mlp", f"{w} sigmoid")
        ls.alloc(f"{tag}.choice", T * E * _F32, "mlp", f"{w} scores + bias")
        ls.alloc(f"{tag}.mask", T * E * _F32, "mlp", f"{w} group mask")
        ls.alloc(f"{tag}.masked", T * E * _F32, "mlp", f"{w} masked scores")
        ls.free(f"{tag}.mask", f"{tag}.choice")
        ls.alloc(ids, T * k * _I64, "mlp", f"{w} top-k ids")
        ls.alloc(weights, T * k * _F32, "mlp", f"{w} gathered weights")
        ls.free(f"{tag}.scores", f"{tag}.masked")
        return logits, weights, ids
    ls.alloc(logits, T * E * e, "mlp", f"{w} logits")
    if lay.router == "topk_softmax":  # gpt-oss: top-k of the logits, softmax over the k in the logits' dtype
        ls.alloc(f"{tag}.topv", T * k * e, "mlp", f"{w} top-k values")
        ls.alloc(ids, T * k * _I64, "mlp", f"{w} top-k ids")
        ls.alloc(weights, T * k * e, "mlp", f"{w} softmax")
        ls.free(f"{tag}.topv")
        return logits, weights, ids
    if lay.routing_fp32 and e < _F32:  # Mixtral: softmax(logits.float())
        ls.alloc(f"{tag}.l32", T * E * _F32, "mlp", f"{w} logits.float()")
    ls.alloc(f"{tag}.probs", T * E * _F32, "mlp", f"{w} softmax fp32")
    ls.free(f"{tag}.l32")
    ls.alloc(f"{tag}.topv", T * k * _F32, "mlp", f"{w} top-k values")
    ls.alloc(ids, T * k * _I64, "mlp", f"{w} top-k ids")
    if lay.routing_fp32 or e == _F32:  # the fp32 top-k values are the weights
        ls.rename(f"{tag}.topv", weights, "mlp")
    else:  # Qwen: .to(logits.dtype)
        ls.alloc(weights, T * k * e, "mlp", f"{w} weights .to(dtype)")
        ls.free(f"{tag}.topv")
    ls.free(f"{tag}.probs")
    return logits, weights, ids


def _experts_grouped_mm(walk, tag: str, _weights: str) -> str:
    """transformers' grouped_mm experts forward; returns the [T, K] output's name."""
    ls, m, T, K, e = walk.ls, walk.s.moe, walk.M, walk.s.hidden_size, walk.e
    E, k, I, lay = m.num_experts, m.top_k, m.intermediate_size, m.layout
    S = T * k
    wb = _F32 if lay.routing_fp32 else e
    ob = max(e, wb)  # proj_out * weights: promoted to fp32 when the weights are
    w = f"{tag}: experts grouped_mm"
    n = lambda s: f"{tag}.{s}"  # noqa: E731
    ls.alloc(n("ids_sorted"), S * _I64, "mlp", f"{w} sort")
    ls.alloc(n("perm"), S * _I64, "mlp", f"{w} sort")
    ls.alloc(n("perm_div"), S * _I64, "mlp", f"{w} perm // k")
    ls.alloc(n("x_g"), S * K * e, "mlp", f"{w} permuted copy of x")
    ls.free(n("perm_div"))
    ls.alloc(n("w_g"), S * wb, "mlp", f"{w} sorted weights")
    ls.alloc(n("histc_in"), S * 4, "mlp", f"{w} histc input")
    ls.alloc(n("counts"), E * 4, "mlp", f"{w} tokens per expert")
    ls.alloc(n("offsets"), E * _I32, "mlp", f"{w} offsets")
    masks = hf_masks_sentinels()
    if masks:
        ls.alloc(n("sentinel"), S, "mlp", f"{w} sentinel mask (bool)")
    if lay.expert_bias:
        ls.alloc(n("bias"), S * 2 * I * e, "mlp", f"{w} gate_up bias per pair")
    ls.alloc(n("gate_up"), S * 2 * I * e, "mlp", f"{w} gate_up")
    if masks:
        _masked_copy(ls, n("gate_up"), S * 2 * I * e, w)
    if lay.gate == "clamp":  # gpt-oss: clamp both halves, gate * sigmoid(alpha * gate), (up + 1) * glu
        ls.alloc(n("gate_c"), S * I * e, "mlp", f"{w} gate.clamp")
        ls.alloc(n("up_c"), S * I * e, "mlp", f"{w} up.clamp")
        ls.alloc(n("ga"), S * I * e, "mlp", f"{w} gate * alpha")
        ls.alloc(n("sig"), S * I * e, "mlp", f"{w} sigmoid")
        ls.free(n("ga"))
        ls.alloc(n("glu"), S * I * e, "mlp", f"{w} gate * sigmoid")
        ls.free(n("sig"))
        ls.alloc(n("up1"), S * I * e, "mlp", f"{w} up + 1")
        ls.alloc(n("h"), S * I * e, "mlp", f"{w} (up + 1) * glu")
        ls.free(n("up1"), n("gate_c"), n("up_c"), n("glu"))
    else:
        ls.alloc(n("act"), S * I * e, "mlp", f"{w} act(gate)")
        ls.alloc(n("h"), S * I * e, "mlp", f"{w} act(gate) * up")
        ls.free(n("act"))
    ls.free(n("gate_up"))
    if lay.expert_bias:
        ls.alloc(n("bias_down"), S * K * e, "mlp", f"{w} down bias per pair")
        ls.free(n("bias"))
    ls.alloc(n("down"), S * K * e, "mlp", f"{w} down")
    ls.free(n("h"))
    if masks:
        _masked_copy(ls, n("down"), S * K * e, w)
    ls.alloc(n("weighted"), S * K * ob, "mlp", f"{w} down * routing weight")
    ls.alloc(n("inv_perm"), S * _I64, "mlp", f"{w} inverse permutation")
    ls.alloc(n("arange"), S * _I64, "mlp", f"{w} arange")
    ls.free(n("arange"))
    ls.alloc(n("unperm"), S * K * ob, "mlp", f"{w} weighted rows in token order")
    ls.free(n("weighted"))
    out = n("out")
    ls.alloc(out, T * K * ob, "hidden", f"{w} sum over the k slots")
    if ob != e:
        ls.alloc(n("out_cast"), T * K * e, "hidden", f"{w} .to(dtype)")
        ls.free(out)
        out = n("out_cast")
    ls.free(*(n(s) for s in ("ids_sorted", "perm", "x_g", "w_g", "histc_in", "counts", "offsets", "bias_down",
                             "down", "unperm", "inv_perm", "sentinel")))
    return out


def _masked_copy(ls, name: str, nbytes: int, where: str) -> None:
    """``t = t.masked_fill(sentinel_mask, 0)``: a copy of ``name`` beside it, then the original freed;
    the copy keeps the name."""
    ls.alloc(f"{name} (masked)", nbytes, "mlp", f"{where} masked_fill")
    ls.free(name)
    ls.rename(f"{name} (masked)", name, "mlp")


def _experts_fused(walk, tag: str, _weights: str) -> str:
    """swiglu-patch's grouped experts (`kernels/experts.experts_forward`); returns the [T, K] output's name."""
    from swiglu_patch.kernels.experts_routing import KERNEL_EXPERTS
    ls, m, T, K, e = walk.ls, walk.s.moe, walk.M, walk.s.hidden_size, walk.e
    S, E, w, n = T * m.top_k, m.num_experts, f"{tag}: fused experts", lambda s: f"{tag}.{s}"
    block_m = experts_block_m(T)
    rows = -(-(S + min(S, E) * (block_m - 1)) // block_m) * block_m
    torch_path = E > KERNEL_EXPERTS  # its sorted_pairs has a spare slot
    ls.alloc(n("out"), T * K * e, "hidden", f"{w} output")
    ls.alloc(n("sorted_pairs"), (rows + torch_path) * _I64, "mlp", f"{w} pairs sorted into expert blocks")
    ls.alloc(n("block_expert"), rows // block_m * _I64, "mlp", f"{w} expert of each block")
    ls.alloc(n("h"), S * m.intermediate_size * e, "mlp", f"{w} grouped act(gate) * up")
    ls.alloc(n("y"), S * K * e, "mlp", f"{w} grouped down * routing weight")
    ls.free(n("h"), n("y"), n("sorted_pairs"), n("block_expert"))
    return n("out")


def experts_block_m(tokens: int) -> int:
    """BLOCK_M of the experts kernels' rule for a call of ``tokens`` tokens (`kernels/rules.EXPERTS_RULES`)."""
    from swiglu_patch.kernels.rules import EXPERTS_RULES

    for rule in EXPERTS_RULES:
        lo, hi = rule.m
        if (lo is None or tokens >= lo) and (hi is None or tokens <= hi) and not rule.gpus:
            return rule.config.block_m
    raise ValueError(f"experts_block_m: no experts rule covers {tokens} tokens")
