"""The report of `bench_moe_train` (results.md from results.json), and the names it shares with the script.

- `GRADS`: the gradients measured, in the table's column order;
- `KERNEL_PRODUCTS`: each of our experts kernels (its name and nth launch in a training step) and
  the product it computes per expert, for the per-kernel comparison against cuBLAS;
- `render_markdown`: the ways' table, the sweep's table (with each backward kernel's time beside
  the rule's where recorded), each kernel against cuBLAS where profiled, and the targets.
"""

from __future__ import annotations

from types import SimpleNamespace

GRADS = ("x", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")

# Our kernels (name, nth launch in a step) and the product each computes per expert, as (m, k, n, A transposed):
# [m, k] @ [k, n] on S_e = T k / E rows (uniform routing, every expert equal).
KERNEL_PRODUCTS = {
    "gated": (("_experts_gated_gemm_kernel", 0), lambda s, r: (r, s.k, 2 * s.i, False)),
    "down": (("_experts_down_gemm_kernel", 0), lambda s, r: (r, s.i, s.k, False)),
    "dH": (("_experts_dh_kernel", 0), lambda s, r: (r, s.k, s.i, False)),
    "dWd": (("_experts_wgrad_kernel", 0), lambda s, r: (s.k, r, s.i, True)),
    "dWgu": (("_experts_wgrad_kernel", 1), lambda s, r: (2 * s.i, r, s.k, True)),
    "dX": (("_experts_dx_kernel", 0), lambda s, r: (r, 2 * s.i, s.k, False)),
}


# Kernels that compute the same product under another name: the warp-specialized gated, down, dH, weight-gradient
# and dX kernels (Hopper's rules).
SAME_PRODUCT = {"_experts_gated_ws_kernel": "_experts_gated_gemm_kernel", "_experts_down_ws_kernel": "_experts_down_gemm_kernel",
                "_experts_dh_ws_kernel": "_experts_dh_kernel", "_experts_wgrad_ws_kernel": "_experts_wgrad_kernel",
                "_experts_dx_ws_kernel": "_experts_dx_kernel"}


def _kernel_us(kernels: list, name: str, nth: int) -> float | None:
    """The nth launch of kernel `name` (or of one in `SAME_PRODUCT` for it) in a `profile_of` list (None: not there)."""
    found = [us for k, us in kernels if SAME_PRODUCT.get(k, k) == name]
    return found[nth] if len(found) > nth else None


def _wgrad_ws(config: dict) -> str:
    """" ws 256x128": the warp-specialized weight-gradient kernel's tile where the config runs it (before
    `wgrad_ws_tile` existed, it ran wgrad_block_a x wgrad_block_b); "" where it does not."""
    if not config.get("wgrad_warp_specialized"):
        return ""
    tile = config.get("wgrad_ws_tile") or (config["wgrad_block_a"], config["wgrad_block_b"])
    return f" ws {tile[0]}x{tile[1]}"


def _stages(config: dict, key: str) -> str:
    return "" if config.get(key) is None else f" s{config[key]}"


def _ws(config: dict, kernel: str) -> str:
    """" ws", " ws 256 s3": the warp-specialized dH or dX kernel's tile along its columns and stages where the
    config runs it ("dh": `dh_ws_block_n`, `dh_ws_stages` where given; "dx": `dx_ws_block_n`, `dx_ws_stages`);
    "" where it does not."""
    if not config.get(f"{kernel}_warp_specialized"):
        return ""
    width = config.get(f"{kernel}_ws_block_n")
    return " ws" + ("" if width is None else f" {width}") + _stages(config, f"{kernel}_ws_stages")


BACKWARD_KERNELS = (("_experts_dh_kernel", "dH"), ("_experts_wgrad_kernel", "dWd"), ("_experts_wgrad_kernel", "dWgu"),
                    ("_experts_dx_kernel", "dX"))


def _kernel_cells(kernels: list | None, rule_kernels: list | None) -> str:
    """"; dH 1321 (rule 1443) us, ..." from two `profile_of` lists (the weight-gradient kernel's first launch is
    dW_down, its second dW_gate_up); "" where the rule's is not recorded."""
    if not kernels or not rule_kernels:
        return ""

    def times(ks):
        seen, out = {}, {}
        for name, us in ks:
            name = SAME_PRODUCT.get(name, name)
            n = seen[name] = seen.get(name, -1) + 1
            out[(name, n)] = us
        return out
    ours, rule = times(kernels), times(rule_kernels)
    keys = [(k, sum(1 for kk, _ in BACKWARD_KERNELS[:n] if kk == k)) for n, (k, _) in enumerate(BACKWARD_KERNELS)]
    return "; " + ", ".join(f"{label} {ours[key]:.0f} (rule {rule[key]:.0f})" for key, (_, label)
                            in zip(keys, BACKWARD_KERNELS) if key in ours and key in rule) + " us"


def fmt(value, spec: str) -> str:
    """value formatted by spec, "-" for None."""
    return "-" if value is None else format(value, spec)


def render_markdown(data: dict) -> str:
    env = data["environment"]
    gpu, versions = env.get("gpu") or {}, env.get("versions") or {}
    lines = ["# MoE experts block, training (forward + backward)", "",
             f"GPU: {gpu.get('name')}; torch {versions.get('torch')}, triton {versions.get('triton')}, transformers "
             f"{versions.get('transformers')}, liger-kernel {versions.get('liger-kernel')}; {data['dtype']}; commit "
             f"{(env.get('git') or {}).get('commit')}.", f"Timer: {data.get('timer')}.", "",
             "TFLOP/s counts 18*T*k*K*I. saved: MiB allocated after the forward, less the output. peak: MiB above "
             "the start during forward + backward. err: the largest relative error of any gradient against float64.",
             "", "| shape | T | way | fwd+bwd ms | TFLOP/s | saved MiB | peak MiB | err | " + " | ".join(
                 f"err d{g}" for g in GRADS[:4]) + " |", "|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * 4]
    for r in data["rows"]:
        for name, v in r["ways"].items():
            if "error" in v:
                lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {v['error']} |" + " |" * 11)
                continue
            errs = v.get("errors", {})
            lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {fmt(v.get('ms'), '.2f')} | "
                         f"{fmt(v.get('tflops'), '.0f')} | {fmt(v.get('saved_mib'), '.0f')} | "
                         f"{fmt(v.get('peak_mib'), '.0f')} | {fmt(v.get('max_error'), '.1e')} | "
                         + " | ".join(fmt(errs.get(g), ".1e") for g in GRADS[:4]) + " |")
    sweeps = [r for r in data["rows"] if r.get("sweep")]
    if sweeps:
        lines += ["", "## Our backward alone (recompute mode) per config, each timed beside the rule's", "",
                  "| shape | T | config | ms | rule's ms | config / rule | max rel. diff vs rule | tiles |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        for r in sweeps:
            for name, v in r["sweep"]["configs"].items():
                if "error" in v:
                    lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {v['error']} | | | | |")
                    continue
                ratio = None if v["ms"] is None or not v["rule_ms"] else v["ms"] / v["rule_ms"]
                c = v["config"]
                tiles = (f"{c['block_m']}: dH {c['block_n']}x{c['block_k']}{_stages(c, 'dh_num_stages')}"
                         f"{_ws(c, 'dh')}, "
                         f"dX {c['dx_block_n']}x{c['dx_block_k']}{_ws(c, 'dx')}, dW {c['wgrad_block_a']}x{c['wgrad_block_b']}"
                         f"{_stages(c, 'wgrad_num_stages')}{' r' + str(c['wgrad_rows']) if c.get('wgrad_rows') else ''}"
                         f"{_wgrad_ws(c)}, "
                         f"w{c['num_warps']} s{c['num_stages']}"
                         + (f", {c['smem_budget_kib']} KiB" if "smem_budget_kib" in c else "")
                         + _kernel_cells(v.get("kernels_us"), v.get("rule_kernels_us")))
                lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {fmt(v['ms'], '.2f')} | "
                             f"{fmt(v['rule_ms'], '.2f')} | {fmt(ratio, '.3f')} | {v['max_rel_diff_vs_rule']:.1e} | "
                             f"{tiles} |")
            if r["sweep"].get("skipped"):
                lines.append(f"| {r['shape']} | {r['tokens']} | not started (budget): "
                             f"{', '.join(r['sweep']['skipped'])} | | | | | |")
    ceilings = [r for r in data["rows"] if r.get("cublas_us") and r.get("profile_us", {}).get("ours_store")]
    if ceilings:
        lines += ["", "## Each of our kernels against cuBLAS (store mode's step)", "",
                  "cuBLAS: torch.bmm of the same product with every expert given T k / E contiguous rows (no gather, "
                  "no epilogue). TFLOP/s counts the product's FLOPs.", "",
                  "| shape | T | kernel | ours us | TFLOP/s | cuBLAS us | TFLOP/s | ours / cuBLAS |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in ceilings:
            shape = SimpleNamespace(**data["shapes"][r["shape"]])
            for name, ((kernel, nth), product) in KERNEL_PRODUCTS.items():
                ours, cublas = _kernel_us(r["profile_us"]["ours_store"], kernel, nth), r["cublas_us"].get(name)
                m, k, n, _ = product(shape, r["tokens"] * shape.top_k // shape.experts)
                flop = 2.0 * m * k * n * shape.experts
                if ours is None or cublas is None:
                    continue
                lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {ours:.0f} | {flop / ours / 1e6:.0f} | "
                             f"{cublas:.0f} | {flop / cublas / 1e6:.0f} | {ours / cublas:.2f} |")
    if data.get("not_started"):
        lines += ["", f"Rows not started (--budget-s {data.get('budget_s')}): {', '.join(data['not_started'])}."]
    lines += ["", "## Targets", "", "| shape | T | target | met |", "|---|---:|---|---|"]
    for r in data["rows"]:
        for name, met in r.get("targets", {}).items():  # a row cut by the command's time limit has none
            lines.append(f"| {r['shape']} | {r['tokens']} | {name} | {'-' if met is None else 'yes' if met else 'NO'} |")
    return "\n".join(lines) + "\n"
