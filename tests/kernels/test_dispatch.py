"""The planner (kernels/dispatch.py) and its tables (kernels/rules.py).

Table properties (buckets, kernels, cited sweeps, full coverage for every op), the kernels'
capability records against their `can_run`, the choice per GPU and shape as the sweeps decided
it, `explain` (and the command line's refusal), the one plan cache, and on a GPU that
`gated_gemm` runs what `choose` names, eager and captured into a CUDA graph.
"""

from pathlib import Path

import pytest
import torch
from helpers import CUDA, DEVICE, check, make_case, packed_of

from swiglu_patch.kernels import dispatch
from swiglu_patch.kernels.configs import GatedGemmConfig as C
from swiglu_patch.kernels.configs import m_bucket
from swiglu_patch.kernels.rules import BACKWARD_KERNELS, KERNELS, RULES, TABLES

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
SHAPES_KI = {"qwen2.5-7b": (18944, 3584), "llama-3-8b": (14336, 4096), "gemma-2-9b": (14336, 3584),
             "llama-3-70b": (28672, 8192), "gemma-2-27b": (36864, 4608), "llama-3.2-1b": (8192, 2048)}


def test_rule_bounds_sit_on_bucket_edges():
    """Plans are cached per M bucket: every rule must decide the same for all M of a bucket."""
    for n, rule in enumerate(RULES):
        low, high = rule.m
        for m in range(1, 20000):
            by_m = (low is None or m >= low) and (high is None or m <= high)
            by_bucket = (low is None or m_bucket(m) >= low) and (high is None or m_bucket(m) <= high)
            assert by_m == by_bucket, f"rule {n}: M bound {rule.m} cuts bucket {m_bucket(m)} at M = {m}"


def test_rules_name_known_kernels_and_existing_sweeps():
    for n, rule in enumerate(RULES):
        assert rule.kernel in KERNELS, n
        assert rule.sweep and rule.why, f"rule {n} says neither what measured it nor why"
        for path in rule.sweep:
            assert (RESULTS / path).is_file(), f"rule {n} cites {path}, which is not under benchmarks/results/"


def test_every_table_says_why_and_cites_sweeps_that_exist():
    for table, rules in TABLES.items():
        for n, rule in enumerate(rules):
            assert rule.why, f"{table} rule {n} says not why"
            for path in rule.sweep:
                assert (RESULTS / path).is_file(), f"{table} rule {n} cites {path}, not under benchmarks/results/"


@pytest.mark.parametrize("op", list(dispatch.OPS))
@pytest.mark.parametrize("gpu", [H100, H200, "NVIDIA A100-SXM4-80GB", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_call_of_every_op_gets_a_rule_its_kernel_serves(op, gpu, dtype):
    if gpu == "cpu" and dtype == torch.bfloat16:
        pytest.skip("refused before any rule: test_cpu_bf16_is_refused_not_explained")
    table, features = dispatch.OPS[op]
    for m in (1, 2, 17, 33, 65, 129, 1025, 4097, 100000):
        for k, i in [(64, 72), (4096, 14336), (8192, 28672)]:
            for aligned, captured in ((True, True), (False, True), (True, False)):
                _, rule, config = dispatch.choose(gpu, dtype, m, k, i, captured, tma_aligned=aligned, op=op)
                cap = dispatch.MODULES[rule.kernel].CAPABILITY
                assert table in cap.ops and features <= cap.features, (op, rule)
                assert cap.runs(dtype, m, i, aligned), (op, gpu, m, k, i, rule)


def test_capability_records_agree_with_the_tables_and_with_can_run():
    """Each table's kernels serve it; a record's tensor-free `runs` says what its file's `can_run`
    says on tensors (dtypes, M, I, alignment)."""
    assert set(TABLES) == {t for t, _ in dispatch.OPS.values()}
    assert KERNELS == tuple(n for n, m in dispatch.MODULES.items() if "forward" in m.CAPABILITY.ops)
    assert BACKWARD_KERNELS == tuple(n for n, m in dispatch.MODULES.items() if "backward" in m.CAPABILITY.ops)
    for table, rules in TABLES.items():
        assert all(table in dispatch.MODULES[r.kernel].CAPABILITY.ops for r in rules), table
        assert dispatch.MODULES[rules[-1].kernel].CAPABILITY.runs_every_call, f"{table} must end with a catch-all"
    for dtype in (torch.float16, torch.float32):
        for m, k, i in [(1, 64, 48), (2, 64, 48), (1, 64, 40), (3, 60, 48), (5, 64, 32)]:
            for offset in (0, 1):  # 1: x starts 2 or 4 bytes past an aligned address
                x = torch.zeros(m * k + offset, dtype=dtype)[offset:].view(m, k)
                w, out = torch.zeros(2 * i, k, dtype=dtype), torch.zeros(m, i, dtype=dtype)
                aligned = offset == 0 and (k * x.element_size()) % 16 == 0 and (i * x.element_size()) % 16 == 0
                for name, module in dispatch.MODULES.items():
                    if "forward" in module.CAPABILITY.ops:
                        runs = module.CAPABILITY.runs(dtype, m, i, aligned, on_gpu=False)
                        assert module.can_run(x, w, out) == runs, (name, m, k, i)
                dy, wd = torch.zeros(m, k, dtype=dtype)[:, :], torch.zeros(k, i, dtype=dtype)
                p = torch.zeros(m * 2 * i + offset, dtype=dtype)[offset:].view(m, 2 * i)
                aligned = offset == 0 and (k * x.element_size()) % 16 == 0 and (i * x.element_size()) % 16 == 0
                for name in BACKWARD_KERNELS:
                    module = dispatch.MODULES[name]
                    got = module.can_run(dy, wd, p, p, out)
                    assert got == module.CAPABILITY.runs(dtype, m, i, aligned, on_gpu=False), (name, m, k, i, offset)


def test_cpu_bf16_is_refused_not_explained(capsys):
    """The interpreter refuses bf16 at run time, so `explain` names no kernel for it, and the command
    line says why in one line with exit status 2."""
    from swiglu_patch.cli import main

    with pytest.raises(ValueError, match="refused.*interpreter computes bfloat16"):
        dispatch.explain("cpu", torch.bfloat16, 8, 64, 48)
    with pytest.raises(ValueError, match="refused"):
        dispatch.choose("cpu", torch.bfloat16, 8, 64, 48, op="backward")
    assert main(["explain", "--gpu", "cpu", "--dtype", "bf16", "--m", "8", "--k", "64", "--i", "48"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "refused" in captured.err and "CHOSEN" not in captured.err
    assert main(["explain", "--gpu", "cpu", "--dtype", "fp16", "--m", "8", "--k", "64", "--i", "48"]) == 0
    assert "pointer" in capsys.readouterr().out.split("CHOSEN")[0].splitlines()[-1]


def test_explain_op_on_the_command_line(capsys):
    """`--op` reads the op's table: training's backward GEMM, and the forward that stores P (no GEMV);
    an op the planner does not have is one line and exit status 2."""
    from swiglu_patch.cli import main

    assert main(["explain", "--op", "backwards", "--m", "8", "--k", "64", "--i", "48"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--op must be one of forward," in err and "'backwards'" in err
    assert main(["explain", "--op", "backward", "--m", "4096", "--k", "4096", "--i", "14336"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("backward call") and "backward_ws" in out.split("CHOSEN")[0].splitlines()[-1]
    assert main(["explain", "--op", "forward_low_rank_preact", "--m", "1", "--k", "4096", "--i", "14336"]) == 0
    out = capsys.readouterr().out
    assert "gemv" in out and "the gemv kernel has no store_preact" in out
    assert "pointer" in out.split("CHOSEN")[0].splitlines()[-1]


def test_rows_bucket_is_half_an_octave_inside_m_bucket():
    """rows_bucket(m): the least of 2^k and 3 * 2^(k-1) at or above m, capped as m_bucket is."""
    from swiglu_patch.kernels.configs import rows_bucket

    assert [rows_bucket(m) for m in (0, 1, 2, 3, 4, 5, 7, 600, 768, 769, 1024, 1025, 1536, 1537, 8192, 9000)] == \
        [1, 1, 2, 3, 4, 6, 8, 768, 768, 1024, 1024, 1536, 1536, 2048, 8192, 8192]
    for m in range(1, 9000):
        assert min(m, 8192) <= rows_bucket(m) <= m_bucket(m), m
        assert rows_bucket(m) <= rows_bucket(m + 1), m


def test_experts_rules_on_rows_per_expert(capsys):
    """The experts tables may bound the mean rows per expert, rows_bucket(T) * top_k // num_experts: on the
    H200, 64-row tiles past T = 512 while that is at most 48 (Qwen3.5-35B-A3B: 256 experts, top 8, to
    T = 1536; Qwen3-30B-A3B: 128 experts, to T = 768), the 128-row tiles from 64; a call that gives no
    experts skips such a rule."""
    from swiglu_patch.cli import main

    assert [dispatch.expert_rows(t, 256, 8) for t in (1, 600, 1024, 1025, 1536, 1537, 8192)] == \
        [1, 24, 32, 48, 48, 64, 256]
    assert dispatch.expert_rows(1, 512, 1) == 1

    def tiles(gpu, tokens, experts, op="experts"):
        _, rule, config = dispatch.choose(gpu, torch.bfloat16, tokens, 2048, 512, op=op, experts=experts)
        return config.block_m, config.warp_specialized, config.warp_specialized_preact

    assert tiles(H200, 513, (256, 8))[0] == tiles(H200, 1024, (256, 8))[0] == tiles(H200, 1536, (256, 8))[0] == 64
    assert tiles(H200, 1024, (256, 8), op="experts_preact")[0] == 64
    assert tiles(H200, 512, (256, 8))[0] == 64  # the 64-row rule by T, before it
    assert tiles(H200, 1537, (256, 8)) == (128, True, False)  # 64 rows per expert: the warp-specialized prefill
    assert tiles(H200, 768, (128, 8))[0] == 64  # 48 rows per expert
    assert tiles(H200, 769, (128, 8)) == tiles(H200, 1024, (128, 8)) == (128, False, False)  # 64
    assert tiles(H200, 1024, None) == (128, False, False)
    assert tiles(H100, 1024, (256, 8)) == (128, False, False)  # measured on the H200 only
    # the H200's warp-specialized prefill from T = 1025, its preact form from the Hopper rule at 2049
    assert tiles(H200, 2048, (128, 8)) == (128, True, False) and tiles(H100, 2048, (128, 8)) == (128, False, False)
    assert tiles(H200, 2049, (128, 8)) == (128, True, True)
    text = dispatch.explain(H200, torch.bfloat16, 1024, 2048, 512, op="experts")
    assert "bounds the rows per expert: give the call's experts and top_k" in text
    text = dispatch.explain(H200, torch.bfloat16, 1024, 2048, 768, op="experts", experts=(128, 8))
    assert "128 experts, top 8: 64 rows per expert" in text and "rows per expert = 64 is outside ..48" in text
    argv = ["explain", "--op", "experts", "--gpu", H200, "--m", "1024", "--k", "2048", "--i", "512"]
    assert main(argv + ["--experts", "256", "--top-k", "8"]) == 0
    assert "CHOSEN: 64x(2*128)x64" in capsys.readouterr().out
    for bad, says in ((["--experts", "256"], "go together"), (["--top-k", "8"], "go together")):
        assert main(argv + bad) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    assert main(["explain", "--m", "8", "--k", "64", "--i", "48", "--experts", "4", "--top-k", "2"]) == 2
    assert "for the experts ops, not 'forward'" in capsys.readouterr().err


def _kernel(gpu, m, name, captured=False, dtype=torch.bfloat16):
    i, k = SHAPES_KI[name]
    _, rule, config = dispatch.choose(gpu, dtype, m, k, i, captured)
    return rule.kernel, config


def test_decode_and_middle_choices_per_gpu_and_shape():
    for gpu in (H100, H200):
        assert _kernel(gpu, 1, "llama-3.2-1b") == ("pointer", C(16, 32, 128, num_warps=4, num_stages=4))
        assert _kernel(gpu, 1, "llama-3-8b")[0] == _kernel(gpu, 1, "gemma-2-9b")[0] == "gemv"
        assert _kernel(gpu, 2, "llama-3-8b") == ("pointer", C(16, 64, 256, num_warps=4, num_stages=3))
        assert _kernel(gpu, 16, "qwen2.5-7b") == ("pointer", C(16, 32, 256, num_warps=4, num_stages=4))  # table
        assert _kernel(gpu, 1, "llama-3-70b") == _kernel(gpu, 1, "qwen2.5-7b")
        # a tensor-parallel shard of Llama-3-70B: 1 of 4 GPUs takes the 4096..16384 rule, 1 of 8 the table
        assert dispatch.choose(gpu, torch.bfloat16, 1, 8192, 7168)[2] == C(16, 64, 256, num_warps=4, num_stages=3)
        assert dispatch.choose(gpu, torch.bfloat16, 1, 8192, 3584)[2] == C(16, 32, 256, num_warps=4, num_stages=4)
        assert _kernel(gpu, 32, "llama-3-8b") == ("pointer", C(32, 64, 128, num_warps=4, num_stages=4))
        assert _kernel(gpu, 256, "llama-3-8b")[0] == "tma"
        assert _kernel(gpu, 2, "llama-3-8b", dtype=torch.float32)[1].block_k == 128  # fp32: halved
    assert _kernel(H100, 32, "qwen2.5-7b")[1] != _kernel(H200, 32, "qwen2.5-7b")[1]  # a tile per GPU
    assert _kernel(H100, 64, "llama-3-70b") == ("tma", C(64, 64, 128, group_m=4, num_warps=4, num_stages=2,
                                                           programs_per_sm=2))
    assert _kernel(H200, 64, "llama-3-70b")[0] == "pointer"  # not measured on the H200
    assert _kernel("NVIDIA A100-SXM4-80GB", 1, "llama-3-8b")[0] == "pointer"  # no rule measured there
    assert _kernel("NVIDIA A100-SXM4-80GB", 1024, "llama-3-8b")[0] == "pointer"  # no TMA before Hopper


# What a captured call runs per (M, shape) on each GPU, from the sweeps the rules cite; a pair
# not listed runs what an eager call runs.
def _g(bm, bn, bk, stages, boxes, group_m=4):
    return C(bm, bn, bk, group_m=group_m, num_warps=4, num_stages=stages, weight_boxes=boxes)


_Q16, _Q32, _N64, _A64, _N128 = (_g(16, 64, 128, 2, 2), _g(32, 64, 128, 2, 2), _g(64, 64, 128, 2, 1),
                                 _g(64, 64, 128, 3, 1), _g(128, 64, 64, 4, 1, group_m=8))
GRAPH_PICKS = {
    H100: {(1, "qwen2.5-7b"): _Q16, (16, "qwen2.5-7b"): _Q16, (32, "qwen2.5-7b"): _Q32,
           (64, "qwen2.5-7b"): _g(32, 64, 128, 2, 1), (64, "llama-3-8b"): _N64, (64, "gemma-2-9b"): _N64,
           (64, "llama-3-70b"): _N64, (64, "gemma-2-27b"): _A64, (64, "llama-3.2-1b"): _A64,
           (128, "llama-3-8b"): _N128, (128, "gemma-2-9b"): _N128, (128, "llama-3.2-1b"): _N128},
    H200: {(1, "qwen2.5-7b"): _Q16, (16, "qwen2.5-7b"): _Q16, (32, "qwen2.5-7b"): _Q32,
           (16, "llama-3-8b"): _g(16, 128, 128, 3, 1), (16, "gemma-2-9b"): _g(16, 128, 128, 3, 1),
           (1, "gemma-2-27b"): _g(16, 64, 128, 2, 2), (16, "gemma-2-27b"): _g(16, 64, 128, 2, 2),
           (32, "gemma-2-27b"): _g(32, 64, 128, 2, 1), (32, "llama-3-8b"): _g(32, 128, 128, 3, 2),
           (32, "gemma-2-9b"): _g(32, 128, 128, 3, 2), (32, "llama-3-70b"): _g(32, 128, 128, 3, 2),
           (64, "qwen2.5-7b"): _g(64, 64, 64, 3, 1), (64, "gemma-2-27b"): _g(64, 64, 64, 3, 1),
           (64, "llama-3-8b"): _N64, (64, "gemma-2-9b"): _N64, (64, "llama-3-70b"): _N64,
           (64, "llama-3.2-1b"): _A64, (128, "llama-3-8b"): _N128, (128, "gemma-2-9b"): _N128,
           (128, "llama-3.2-1b"): _N128},
}


@pytest.mark.parametrize("gpu", [H100, H200])
def test_graph_rules_apply_only_to_captured_calls(gpu):
    """The grid kernel runs only for calls captured into a CUDA graph, with the tiles each GPU's
    sweep picked; the GEMV keeps M = 1 on Llama-3-8B / Gemma-2-9B, captured or not."""
    for m in (1, 16, 32, 64, 128, 256):
        for name in SHAPES_KI:
            eager = _kernel(gpu, m, name)
            assert eager[0] != "grid", (m, name)
            want = GRAPH_PICKS[gpu].get((m, name))
            assert _kernel(gpu, m, name, captured=True) == (("grid", want) if want else eager), (m, name)
    assert _kernel(gpu, 1, "llama-3-8b", captured=True)[0] == "gemv"
    assert dispatch.choose(gpu, torch.bfloat16, 64, 8192, 3584, True)[1].kernel == "pointer"  # a 70B TP shard
    reached = set(GRAPH_PICKS[H100].values()) | set(GRAPH_PICKS[H200].values())
    assert {r.config for r in RULES if r.kernel == "grid"} == reached  # every grid rule is reached


def test_explain_names_the_rule_and_why_the_others_missed():
    text = dispatch.explain(H100, torch.bfloat16, 8, 4096, 14336, captured=True)
    assert "CHOSEN" in text and text.count("CHOSEN") == 1
    assert "pointer" in text.split("CHOSEN")[0].splitlines()[-1]
    assert "K = 4096 is outside ..2048" in text and "M = 8 is outside 1..1" in text
    assert "benchmarks/results/h100/tune/" in text
    unaligned = dispatch.explain(H100, torch.bfloat16, 512, 4096, 14336, tma_aligned=False)
    assert "the tma kernel cannot run these tensors" in unaligned


def test_one_plan_cache_for_every_op_holding_no_tensors(monkeypatch):
    monkeypatch.setattr(dispatch, "_PLANS", {})
    x, gate, up, _, _ = make_case(3, 32, 48, torch.float32, bias=False)
    w = packed_of(gate, up)
    dispatch.gated_gemm(x, w)
    _, preact = dispatch.gated_gemm_with_preact(x, w)
    dispatch.gated_gemm_low_rank(x, w, x[:, :4], w[:, :4], store_preact=True)
    dispatch.gated_backward(x, gate.t().contiguous(), preact.clone())
    dispatch.gated_backward(x, gate.t().contiguous(), preact.clone(), dh_in=x.new_zeros(3, 48))
    ops = {key[0] for key in dispatch._PLANS if isinstance(key[0], str)}
    assert ops == {"forward_preact", "forward_low_rank_preact", "backward", "backward_dh_in"}, dispatch._PLANS.keys()
    assert len(dispatch._PLANS) == 5  # and gated_gemm's own signature
    dispatch.gated_gemm_with_preact(x, w)  # a repeated call builds nothing
    assert len(dispatch._PLANS) == 5
    for _ in range(2):  # a call naming its kernel keeps its launcher once
        dispatch.gated_gemm_with_preact(x, w, kernel="pointer")
    assert len(dispatch._PLANS) == 6

    def tensors_in(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            return True
        if depth > 3:
            return False
        if isinstance(obj, dict):
            return any(tensors_in(v, depth + 1) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(tensors_in(v, depth + 1) for v in obj)
        cells = getattr(obj, "__closure__", None) or ()
        return any(tensors_in(c.cell_contents, depth + 1) for c in cells) or tensors_in(
            getattr(obj, "__dict__", {}), depth + 1)

    for signature, plan in dispatch._PLANS.items():
        assert not tensors_in(signature) and not tensors_in(plan)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 5, 16, 27])
def test_every_rule_config_runs_correctly_here(m):
    """Every config of the table, on its kernel where this device can run it, on a shape whose
    I and K are no multiple of any block (bf16 on the GPU, fp16 in the interpreter)."""
    dtype = torch.bfloat16 if CUDA else torch.float16
    x, gate, up, bg, bu = make_case(m, 1000, 600, dtype, bias=True)
    for rule in RULES:
        if rule.kernel != "pointer" or (not CUDA and rule.config.block_m * rule.config.block_n > 64 * 64):
            continue  # TMA/GEMV tiles need I % 16 == 0 (their tests run them); big tiles are slow interpreted
        out = torch.full((m, 600), float("nan"), dtype=dtype, device=DEVICE)
        dispatch.gated_gemm(x, packed_of(gate, up), "silu", packed_of(bg, bu), out=out, config=rule.config,
                            kernel="pointer")
        check(out, x, gate, up, bg, bu, "silu")


@pytest.mark.skipif(not CUDA, reason="the rules name GPUs; the interpreter takes the pointer kernel")
@pytest.mark.parametrize("m,k,i", [(1, 4096, 14336), (16, 1000, 16400), (64, 8192, 16400), (64, 1024, 16400),
                                   (300, 512, 1040)])
def test_auto_runs_what_choose_names_eager_and_captured(monkeypatch, m, k, i):
    """gated_gemm(kernel='auto') launches the kernel `choose` names, eager and inside CUDA-graph
    capture, and the replayed output matches float64."""
    x, gate, up, bg, bu = make_case(m, k, i, torch.bfloat16, bias=True)
    packed, bias = packed_of(gate, up), packed_of(bg, bu)
    ran = []

    def recording(name, real):
        def make_launcher(config, *args, **kwargs):
            launch = real(config, *args, **kwargs)
            return lambda *a, **kw: ran.append((name, config)) or launch(*a, **kw)
        return make_launcher

    for name, module in dispatch.MODULES.items():
        monkeypatch.setattr(module, "make_launcher", recording(name, module.make_launcher))
    monkeypatch.setattr(dispatch, "_PLANS", {})  # plans built from here on hold recording launchers
    name = torch.cuda.get_device_name(0)
    for captured in (False, True):
        _, rule, config = dispatch.choose(name, torch.bfloat16, m, k, i, captured)
        dispatch.gated_gemm(x, packed, "silu", bias)  # compiles outside any capture
        out = torch.full((m, i), float("nan"), dtype=x.dtype, device=DEVICE)
        ran.clear()
        if captured:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm the captured call's kernel outside the capture
                dispatch.gated_gemm(x, packed, "silu", bias, config=config, kernel=rule.kernel)
            torch.cuda.current_stream().wait_stream(side)
            ran.clear()
            with torch.cuda.graph(graph):
                dispatch.gated_gemm(x, packed, "silu", bias, out=out)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
        else:
            dispatch.gated_gemm(x, packed, "silu", bias, out=out)
        assert ran == [(rule.kernel, config)], (captured, ran)
        check(out, x, gate, up, bg, bu, "silu")
