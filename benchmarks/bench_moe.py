"""One MoE experts block: the fused experts kernels against transformers' own paths and Liger.

    python -m benchmarks.bench_moe --out OUT [--shapes qwen3-30b-a3b ...] [--tokens 1 32 4096]
    python -m benchmarks.bench_moe --dry-run --out /tmp/moe           # CPU, tiny shape, fp32
    python -m benchmarks.bench_moe --render OUT/results.json           # markdown only

An experts module of a real model's shape, as transformers builds it (Qwen3-MoE's class for the
chunked [gate; up] SiLU shapes, gpt-oss's for gpt-oss-20b: transposed, interleaved, biased,
clamped), random bf16 weights from one seed, routed by the top-k of a softmax over random
logits ("uniform") or over Zipf-skewed logits ("zipf": expert e drawn with weight 1/(e+1)).
Ways, each on the same module, weights and routing:

- ours: `swiglu_patch.kernels.experts.experts_forward` on the module's own weights;
- grouped_mm, batched_mm, eager: transformers' implementations (`config._experts_implementation`);
  batched_mm is skipped where its per-pair weight copy exceeds --batched-gib, eager past --eager-max;
- liger: Liger-Kernel's `LigerFusedMoEFunction` (SiLU, chunked layout only), when installed.

Before timing, every way's output is checked against float64 (`experts_reference` on the
float64 weights) on the first --check-rows tokens' worth of the same call. Timing:
`harness.timing.GraphTimer` (CUDA-graph replays where a way can be captured, else CUDA events
around eager calls; the mode is recorded). Host time: one call from an idle device
(`harness.host_time.host_from_idle`). Loop: eager calls back to back, wall time per call with
the device synchronized once per --loop-calls calls, the ways in turns (`harness.host_time.in_turns`):
what an eager decode step waits for, host or GPU, whichever is longer. Floor: max(2 T k K 3I / matmul peak, bytes of the
experts hit / HBM bandwidth), the matmul peak measured in the same run, the bandwidth the GPU's datasheet
figure (`HBM_SPEC_TBPS`; measured as a read where the GPU is not listed).

Writes OUT/results.json (GPU, versions, commit: `swiglu_patch.provenance`) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from swiglu_patch.inputs import positive_int
from swiglu_patch.provenance import environment

from .harness.cli import Parser, guarded, render_or_run, require_device

PROG = "python -m benchmarks.bench_moe"
SCHEMA = 1
WAYS = ("ours", "grouped_mm", "batched_mm", "eager", "liger")
HBM_SPEC_TBPS = (("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("H200", 4.8))  # NVIDIA datasheets, first match


@dataclass(frozen=True)
class MoEShape:
    name: str
    k: int  # hidden size
    i: int  # expert intermediate size
    experts: int
    top_k: int
    gpt_oss: bool = False


MOE_SHAPES = (
    MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8),
    MoEShape("qwen3.5-35b-a3b", 2048, 512, 256, 8),
    MoEShape("olmoe-1b-7b", 2048, 1024, 64, 8),
    MoEShape("gpt-oss-20b", 2880, 2880, 32, 4, gpt_oss=True),
    MoEShape("mixtral-8x7b", 4096, 14336, 8, 2),
    MoEShape("glm-4.5-air", 4096, 1408, 128, 8),
)
TINY = MoEShape("tiny", 64, 48, 8, 2)


def sweep_configs() -> dict:
    """Candidate (kernel, config) of ours that --sweep times beside the rule's choice; "triton", "ws" and "ws_s4":
    the prefill tiles (128x(2*128)x64) with the gated GEMM by the one-program-per-tile kernel, by the
    warp-specialized one (`experts_gated_ws.py`, 3 stages, also with P stored: `--preact`) and
    by it at 4 stages; "down_ws", "down_ws_128" and "down_triton": the prefill tiles with the gated GEMM
    warp-specialized for calls storing no P, and the down GEMM by `experts_down_ws.py` on 128x256 tiles at 3 stages,
    on 128x128 tiles at 4, and by the one-program-per-tile kernel (the Hopper rule from T = 4096 without it); "ws_preact":
    that rule with the gated GEMM of calls storing P warp-specialized too (`--preact`); "grouped": the grouped kernel
    at its rule's tiles for T; "gemv" and "gemv_*": the GEMV path (`experts_gemv.py`) at the rule's tiles and others
    ("gemv_t2": the two-token rule's; "gemv_16x256_d4x256": its first rule's), for decode; "gemv_transposed" and
    "gemv_transposed_*": the transposed layout's GEMV path (`experts_gemv_transposed.py`) at its rule's tiles and others."""
    from dataclasses import replace

    from swiglu_patch.kernels.configs import ExpertsConfig as C
    from swiglu_patch.kernels.rules import EXPERTS_GEMV_CONFIG as GEMV
    from swiglu_patch.kernels.rules import EXPERTS_GEMV_T2_CONFIG as GEMV_T2
    from swiglu_patch.kernels.rules import EXPERTS_GEMV_TRANSPOSED_CONFIG as GEMV_TRANSPOSED

    prefill = C(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3)
    return {
        "triton": ("experts_grouped", prefill),
        "ws": ("experts_grouped", replace(prefill, warp_specialized=True, warp_specialized_preact=True)),
        "ws_s4": ("experts_grouped", replace(prefill, warp_specialized=True, warp_specialized_preact=True,
                                             ws_stages=4)),
        "down_ws": ("experts_grouped", replace(prefill, warp_specialized=True, down_warp_specialized=True)),
        "down_ws_128": ("experts_grouped", replace(prefill, warp_specialized=True, down_warp_specialized=True,
                                                   down_ws_block_n=128, down_ws_stages=4)),
        "down_triton": ("experts_grouped", replace(prefill, warp_specialized=True)),
        "ws_preact": ("experts_grouped", replace(prefill, warp_specialized=True, warp_specialized_preact=True,
                                                 down_warp_specialized=True)),
        "g16_32x256s3": ("experts_grouped", C(16, 32, 256, 32, 256, group_m=8, num_warps=4, num_stages=3)),
        "g16_64x128s4": ("experts_grouped", C(16, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=4)),
        "g16_32x256s4d64": ("experts_grouped", C(16, 32, 256, 64, 128, group_m=8, num_warps=4, num_stages=4)),
        "g32_64x128s4": ("experts_grouped", C(32, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=4)),
        "g64_64x128w4": ("experts_grouped", C(64, 64, 128, 64, 128, group_m=8, num_warps=4, num_stages=3)),
        "g64_128x64w4s4": ("experts_grouped", C(64, 128, 64, 128, 64, group_m=8, num_warps=4, num_stages=4)),
        "g64_128x64w4s2": ("experts_grouped", C(64, 128, 64, 128, 64, group_m=8, num_warps=4, num_stages=2)),
        "g64_128x64w4s5": ("experts_grouped", C(64, 128, 64, 128, 64, group_m=8, num_warps=4, num_stages=5)),
        "g64_128x64w8s4": ("experts_grouped", C(64, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=4)),
        "g64_64x128w4s4": ("experts_grouped", C(64, 64, 128, 128, 64, group_m=8, num_warps=4, num_stages=4)),
        "g64_128x64w4s4_d256x64": ("experts_grouped", C(64, 128, 64, 256, 64, group_m=8, num_warps=4, num_stages=4)),
        "g64_128x64w4s4_d128x128": ("experts_grouped", C(64, 128, 64, 128, 128, group_m=8, num_warps=4,
                                                          num_stages=4)),
        "g64_128x64w8": ("experts_grouped", C(64, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3)),
        "g128_128x64w8": ("experts_grouped", C(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=3)),
        "g128_128x64w8s4": ("experts_grouped", C(128, 128, 64, 128, 64, group_m=8, num_warps=8, num_stages=4)),
        "g128_128x128w8": ("experts_grouped", C(128, 128, 64, 128, 128, group_m=16, num_warps=8, num_stages=3)),
        "g128_256x64w8": ("experts_grouped", C(128, 128, 64, 256, 64, group_m=8, num_warps=8, num_stages=3)),
        "grouped": ("experts_grouped", None),
        "gemv": ("experts_gemv", GEMV),
        "gemv_t2": ("experts_gemv", GEMV_T2),
        "gemv_16x256_d4x256": ("experts_gemv", C(1, 16, 256, 4, 256, num_warps=4, num_stages=1)),
        "gemv_d8x256": ("experts_gemv", replace(GEMV, down_block_n=8, down_block_k=256)),
        "gemv_16x128w2_d8x128w2": ("experts_gemv", replace(GEMV, block_n=16, num_warps=2, down_block_n=8,
                                                           down_num_warps=2)),
        "gemv_transposed": ("experts_gemv_transposed", GEMV_TRANSPOSED),
        "gemv_transposed_64x64w4_d256x4s180w8": ("experts_gemv_transposed", replace(
            GEMV_TRANSPOSED, block_n=64, block_k=64, num_warps=4, down_block_k=4, down_split_i=180, down_num_warps=8)),
    }
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="output folder (required to measure; --render: default the JSON's)")
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in MOE_SHAPES], default=[s.name for s in MOE_SHAPES])
    p.add_argument("--tokens", nargs="+", type=positive_int, default=list(DEFAULT_TOKENS))
    p.add_argument("--routing", nargs="+", choices=("uniform", "zipf"), default=["uniform"])
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--eager-max", type=int, default=64, help="largest T timed on the eager loop")
    p.add_argument("--batched-gib", type=float, default=8.0, help="largest per-pair weight copy batched_mm may make")
    p.add_argument("--liger-max", type=int, default=16384, help="largest T timed on Liger (it autotunes per T)")
    p.add_argument("--check-rows", type=int, default=64, help="tokens checked against float64 per row")
    p.add_argument("--rep-ms", type=float, default=30.0, help="GPU ms of timed calls per way and row")
    p.add_argument("--host-calls", type=int, default=40, help="host-time calls per way at T <= 32 (0: none)")
    p.add_argument("--loop-calls", type=int, default=50,
                   help="back-to-back eager calls per way and round at T <= 32 (0: no loop timing)")
    p.add_argument("--sweep", action="store_true", help="also time candidate configs of ours per row")
    p.add_argument("--sweep-configs", nargs="+", choices=list(sweep_configs()),
                   help="the candidates --sweep times (default: all)")
    p.add_argument("--preact", action="store_true",
                   help="ours (and the sweep) run training's store-mode forward, which also writes P [T k, 2I]; "
                        "the other ways are unchanged")
    p.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shape, fp32, Triton interpreter, no timing")
    p.add_argument("--render", type=Path, help="rebuild results.md from this results.json and exit")
    args = p.parse_args(argv)
    if not args.render and args.out is None:
        p.error("--out is required (or --render a results.json)")
    return args


def build_experts(shape: MoEShape, device, dtype, seed: int) -> torch.nn.Module:
    """The transformers experts module of `shape`, random weights of unit-variance outputs."""
    gen = torch.Generator().manual_seed(seed)
    if shape.gpt_oss:
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        config = GptOssConfig(hidden_size=shape.k, intermediate_size=shape.i, num_local_experts=shape.experts,
                              num_experts_per_tok=shape.top_k)
        module = GptOssExperts(config)
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(hidden_size=shape.k, moe_intermediate_size=shape.i, num_experts=shape.experts,
                                num_experts_per_tok=shape.top_k, hidden_act="silu")
        module = Qwen3MoeExperts(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = shape.k if "gate_up" in name and "bias" not in name else shape.i
            scale = 0.1 if "bias" in name else fan_in ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module.to(device=device, dtype=dtype).requires_grad_(False)


def routing(shape: MoEShape, tokens: int, kind: str, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [T, k] int64, top_k_weights [T, k] fp32): top-k of a softmax over random logits."""
    gen = torch.Generator().manual_seed(seed + tokens)
    logits = torch.randn(tokens, shape.experts, generator=gen)
    if kind == "zipf":
        logits = logits + torch.log(1.0 / torch.arange(1, shape.experts + 1)) * 2.0
    weights, index = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
    return index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def layout_of(module):
    from swiglu_patch.experts import experts_spec

    return experts_spec(module)


def ours_fn(module, x, idx, w, kernel: str = "auto", config=None, preact: bool = False):
    """Our experts block as a call returning its output; with preact, store mode's forward (P written too)."""
    from swiglu_patch.kernels.experts import experts_forward
    from swiglu_patch.kernels.experts_backward import experts_forward_with_preact

    spec = layout_of(module)
    args = (x, idx, w, module.gate_up_proj, module.down_proj, spec.epilogue, spec.layout,
            getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None))
    if preact:
        return lambda: experts_forward_with_preact(*args, kernel=kernel, config=config)[0]
    return lambda: experts_forward(*args, kernel=kernel, config=config)


def hf_fn(module, name: str, x, idx, w):
    def call():
        module.config._experts_implementation = name
        return module(x, idx, w)
    return call


def liger_fn(module, x, idx, w):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    idx32 = idx.to(torch.int32)
    return lambda: LigerFusedMoEFunction.apply(x, module.gate_up_proj, module.down_proj, idx32, w.to(x.dtype))


def reference_f64(module, x, idx, w) -> torch.Tensor:
    from swiglu_patch.kernels.experts_reference import experts_reference

    spec = layout_of(module)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    return experts_reference(x.double(), idx, w.double(), f64(module.gate_up_proj), f64(module.down_proj),
                             spec.epilogue, spec.layout, f64(getattr(module, "gate_up_proj_bias", None)),
                             f64(getattr(module, "down_proj_bias", None)))


def floor_us(shape: MoEShape, tokens: int, idx: torch.Tensor, matmul_flops: float, hbm_bytes_per_s: float,
             elem: int) -> float:
    hit = int(torch.unique(idx).numel())
    weight_bytes = hit * 3 * shape.i * shape.k * elem
    flops = 2 * tokens * shape.top_k * shape.k * 3 * shape.i
    return 1e6 * max(flops / matmul_flops, weight_bytes / hbm_bytes_per_s)


def hbm_bandwidth(device) -> tuple[float, str]:
    """(bytes/s, where it comes from): the datasheet figure of the GPU's name in `HBM_SPEC_TBPS`, else a
    read of 2 GiB (a sum) timed with CUDA events, which reaches less than a datasheet figure."""
    name = torch.cuda.get_device_name(device)
    for part, tbps in HBM_SPEC_TBPS:
        if part in name:
            return tbps * 1e12, f"{name}: datasheet"
    buf = torch.ones(1 << 29, device=device, dtype=torch.float32)
    for _ in range(3):
        buf.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        buf.sum()
    end.record()
    torch.cuda.synchronize()
    return buf.numel() * buf.element_size() * 10 / (start.elapsed_time(end) * 1e-3), f"{name}: measured read"


def measure_matmul_peak(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (start.elapsed_time(end) * 1e-3)


def run(args: argparse.Namespace) -> dict:
    from .harness.host_time import host_from_idle, in_turns, synchronizer, us_stats
    from .harness.timing import GraphTimer

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    shapes = [TINY] if dry else [s for s in MOE_SHAPES if s.name in args.shapes]
    tokens_list = [1, 5, 37] if dry else args.tokens
    ways = [w for w in args.ways if w != "liger" or _has_liger()]
    timer = None if dry else GraphTimer(rep_ms=args.rep_ms, rounds=3)
    peak = 1.0 if dry else measure_matmul_peak(device)
    hbm, hbm_source = (1.0, "dry run") if dry else hbm_bandwidth(device)
    rows = []
    for shape in shapes:
        module = build_experts(shape, device, dtype, args.seed)
        for kind in args.routing:
            for tokens in tokens_list:
                idx, w = routing(shape, tokens, kind, device, args.seed)
                x = torch.randn(tokens, shape.k, generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
                fns = {"ours": ours_fn(module, x, idx, w, preact=args.preact)}
                for way in ("grouped_mm", "batched_mm", "eager"):
                    if way not in ways or (way == "eager" and tokens > args.eager_max):
                        continue
                    copy_gib = tokens * shape.top_k * 3 * shape.i * shape.k * x.element_size() / 2**30
                    if way == "batched_mm" and copy_gib > args.batched_gib:
                        continue
                    fns[way] = hf_fn(module, way, x, idx, w)
                if "liger" in ways and not shape.gpt_oss and tokens <= args.liger_max:
                    fns["liger"] = liger_fn(module, x, idx, w)
                if args.sweep:
                    for name, (kernel, config) in sweep_configs().items():
                        if ((args.sweep_configs is None or name in args.sweep_configs)
                                and _takes(kernel, module, x)):  # the GEMVs read one weight layout each
                            fns[f"ours[{name}]"] = ours_fn(module, x, idx, w, kernel, config, args.preact)
                row = {"shape": shape.name, "routing": kind, "tokens": tokens, "errors": {}, "us": {}, "modes": {}}
                check = min(tokens, args.check_rows)
                ref = reference_f64(module, x[:check], idx[:check], w[:check])
                for name, fn in fns.items():
                    out = fn()
                    row["errors"][name] = _rel(out[:check].double(), ref)
                    del out
                if not dry:
                    with torch.inference_mode():
                        times = timer.many(fns)
                    row["us"] = {k: v * 1e6 for k, v in times.items()}
                    row["modes"] = dict(timer.modes)
                    row["floor_us"] = floor_us(shape, tokens, idx, peak, hbm, x.element_size())
                    if tokens <= 32 and args.host_calls:
                        host = host_from_idle({k: fns[k] for k in fns if k != "eager"}, args.host_calls, 4,
                                              synchronizer(device))
                        row["host_us"] = {k: us_stats(v)["median_us"] for k, v in host.items()}
                    if tokens <= 32 and args.loop_calls:
                        row["loop_us"] = _loop_us({k: fns[k] for k in fns if k != "eager"}, args.loop_calls,
                                                  synchronizer(device), in_turns)
                rows.append(row)
                print(_line(row), flush=True)
                del fns, x
        module.config._experts_implementation = "grouped_mm"
        del module
        if not dry:
            torch.cuda.empty_cache()
    return {"kind": "moe", "schema": SCHEMA, "environment": environment(device, args.commit), "dtype": str(dtype),
            "preact": args.preact,
            "matmul_peak_tflops": peak / 1e12, "hbm_tbps": hbm / 1e12, "hbm_source": hbm_source,
            "timer": None if dry else timer.describe(),
            "shapes": {s.name: vars(s) for s in shapes}, "rows": rows}


def _takes(kernel: str, module, x) -> bool:
    """Whether the experts kernel can run the module's weights (its file's `can_run`)."""
    from swiglu_patch.kernels.dispatch import MODULES

    return MODULES[kernel].can_run(x, module.gate_up_proj, module.down_proj, layout_of(module).layout)


def _has_liger() -> bool:
    try:
        import liger_kernel.ops.fused_moe  # noqa: F401
    except ImportError:
        return False
    return True


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _loop_us(fns: dict, calls: int, sync, in_turns) -> dict[str, float]:
    """Median over 5 rounds in turns of the wall µs per call of `calls` eager calls back to back."""
    loops = {k: (lambda f=f: [f() for _ in range(calls)]) for k, f in fns.items()}
    for loop in loops.values():
        loop()  # warm: the first calls of a way in eager mode may build plans
    rounds = in_turns(loops, 5, sync)
    return {k: sorted(v)[len(v) // 2] / calls * 1e6 for k, v in rounds.items()}


def _line(row: dict) -> str:
    us = " ".join(f"{k}={v:.1f}" for k, v in row["us"].items())
    err = " ".join(f"{k}={v:.1e}" for k, v in row["errors"].items())
    host = " ".join(f"{k}={v:.0f}" for k, v in row.get("host_us", {}).items())
    loop = " ".join(f"{k}={v:.0f}" for k, v in row.get("loop_us", {}).items())
    return (f"{row['shape']} {row['routing']} T={row['tokens']}: us {us} | floor {row.get('floor_us', 0):.1f} | "
            f"err {err} | host {host} | loop {loop}")


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_markdown(data: dict) -> str:
    env = data["environment"]
    gpu, versions = env.get("gpu") or {}, env.get("versions") or {}
    lines = ["# MoE experts block", "",
             f"GPU: {gpu.get('name')}; torch {versions.get('torch')}, triton {versions.get('triton')}, transformers "
             f"{versions.get('transformers')}, liger-kernel {versions.get('liger-kernel')}; {data['dtype']}; commit "
             f"{(env.get('git') or {}).get('commit')}.",
             f"Timer: {data.get('timer')}. Matmul peak measured in the run: {data['matmul_peak_tflops']:.0f} TFLOP/s. "
             f"Floor's HBM bandwidth: {data.get('hbm_tbps', 3.35):.2f} TB/s "
             f"({data.get('hbm_source', 'the H100 SXM datasheet, then on every GPU')}).", "",
             "Microseconds per experts block (median). best other: the fastest of transformers' ways and Liger. "
             "err: relative error against float64. host: microseconds of host time per call from an idle GPU."
             + (" ours: training's store-mode forward (P [T k, 2I] written too; `--preact`)." if data.get("preact")
                else ""), "",
             "| shape | routing | T | floor | ours | grouped_mm | batched_mm | eager | liger | ours / floor | "
             "best other / ours | err ours | err grouped_mm | host ours | host batched_mm |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        us, host, err = r["us"], r.get("host_us", {}), r["errors"]
        ours, floor = us.get("ours"), r.get("floor_us")
        others = [v for k, v in us.items() if k in WAYS and k != "ours" and v is not None]
        ratio_floor = f"{ours / floor:.2f}" if ours and floor else "-"
        ratio_best = f"{min(others) / ours:.2f}" if ours and others else "-"
        lines.append(f"| {r['shape']} | {r['routing']} | {r['tokens']} | {_cell(floor)} | "
                     + " | ".join(_cell(us.get(k)) for k in WAYS)
                     + f" | {ratio_floor} | {ratio_best} | {err.get('ours', math.nan):.1e} | "
                     f"{err.get('grouped_mm', math.nan):.1e} | {_cell(host.get('ours'))} | {_cell(host.get('batched_mm'))} |")
    swept = [(r, k[5:-1], v) for r in data["rows"] for k, v in r["us"].items() if k.startswith("ours[")]
    if swept:
        lines += ["", "## The sweep: candidate configs of ours (`sweep_configs`), each timed beside the rule's", "",
                  "| shape | routing | T | candidate | us | the rule's us | candidate / rule | err |",
                  "|---|---|---:|---|---:|---:|---:|---:|"]
        for r, name, us in swept:
            rule = r["us"].get("ours")
            ratio = f"{us / rule:.3f}" if us and rule else "-"
            lines.append(f"| {r['shape']} | {r['routing']} | {r['tokens']} | {name} | {_cell(us)} | {_cell(rule)} | "
                         f"{ratio} | {r['errors'].get(f'ours[{name}]', math.nan):.1e} |")
    looped = [r for r in data["rows"] if r.get("loop_us")]
    if looped:
        names = list(dict.fromkeys(k for r in looped for k in r["loop_us"]))
        lines += ["", "## Eager calls back to back (µs per call; `--loop-calls` calls, synchronized once, median "
                  "of 5 rounds in turns)", "", "| shape | routing | T | " + " | ".join(names) + " |",
                  "|---|---|---:|" + "---:|" * len(names)]
        for r in looped:
            lines.append(f"| {r['shape']} | {r['routing']} | {r['tokens']} | "
                         + " | ".join(_cell(r["loop_us"].get(k)) for k in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.render:
        require_device(PROG, args.dry_run)
    return render_or_run(args, "moe", SCHEMA, run, render_markdown)


if __name__ == "__main__":
    sys.exit(guarded(PROG, main, sys.argv[1:]))
