"""Peak live bytes of one forward + backward of `gated_mlp`, against a Liger-style MLP's, on CPU.

What `benchmarks/bench_train.py` reads on the GPU as ``max_memory_allocated`` above the inputs
(x, dY and the weights; y is held through the backward and every gradient counts),
`memory.live_tensors.LiveTensors` counts here, storage by storage, at op granularity: the
registered ops (``gated_mlp``, ``gated_mlp_dpreact``) count as their outputs, as the kernels
allocate (their inner PyTorch temporaries, which the kernels do not have, stay unseen).

Counts in elements (M tokens, K hidden, I intermediate), derived in docs/training.md, "Memory":

- ours, store: dP + dW + dx + dWd + y = 2MI + 3IK + 2MK, the least any order reaches while dP
  is one tensor and dW, dx are fresh ones; recompute: the same for M >= K, and for M < K
  max(3MI + 2IK, MI + 3IK) + 2MK (dP freed before dWd);
- ours, store with P in two tensors split at h's column s (`training.preact_split`, from
  SPLIT_MIN_TOKENS tokens): max(3MI + IK + MK at dWd, 2MI + 3IK + MK when dW is allocated,
  2M(I - s) + 3IK + 2MK when dx is, dP's first half freed): at or below Liger's for M >= K;
- Liger's `LigerSwiGLUMLP` (three nn.Linear, `LigerSiLUMulFunction` saving gate and up and writing
  their gradients over them): max(4MI + IK + MK at down_proj's backward, MI + 3IK + 3MK at up_proj's).

So ours in one P <= Liger's iff M >= 2IK / (2I - K), and at M = K ours is MK (dx) above it; in two, equal. On CUDA the
same counts are checked against the caching allocator's ``max_memory_allocated`` with the kernels
(and Liger's own module where it is installed).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import CUDA
from memory.live_tensors import LiveTensors

from swiglu_patch import training
from swiglu_patch.kernels.epilogue import GatedEpilogue
from swiglu_patch.training import gated_mlp_interleaved

K, I = 64, 224  # Llama-3-8B's I / K = 3.5; past M = 2IK / (2I - K) = 74.7 ours is the lower


@torch.library.custom_op("swiglu_patch_tests::liger_silu_mul", mutates_args=())
def liger_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Liger's swiglu_forward: c = silu(a) * b, a new [M, I] tensor."""
    return F.silu(a) * b


@liger_silu_mul.register_fake
def _(a, b):
    return torch.empty_like(a)


@torch.library.custom_op("swiglu_patch_tests::liger_silu_mul_backward", mutates_args=("a", "b"))
def liger_silu_mul_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """Liger's swiglu_backward: da and db written over a and b (no new tensor)."""
    s = torch.sigmoid(a)
    db = dc * a * s
    a.copy_(dc * s * (1 + a * (1 - s)) * b)
    b.copy_(db)


def _liger_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _liger_backward(ctx, dc):
    a, b = ctx.saved_tensors
    liger_silu_mul_backward(dc, a, b)
    return a, b


liger_silu_mul.register_autograd(_liger_backward, setup_context=_liger_setup)


def ours_count(m, k, i, mode):
    if mode == "recompute" and m < k:
        return max(3 * m * i + 2 * i * k, m * i + 3 * i * k) + 2 * m * k
    return 2 * m * i + 3 * i * k + 2 * m * k


def ours_split_count(m, k, i, s):
    return max(3 * m * i + i * k + m * k, 2 * m * i + 3 * i * k + m * k, 2 * m * (i - s) + 3 * i * k + 2 * m * k)


def liger_count(m, k, i):
    return max(4 * m * i + i * k + m * k, m * i + 3 * i * k + 3 * m * k)


def peak_elements(m, way, mode="store"):
    """Peak elements alive over one forward + backward, beyond x, dY and the weights (fp32)."""
    x = torch.randn(m, K, requires_grad=True)
    dy = torch.randn(m, K)
    if way == "ours":
        weights = [torch.randn(2 * I, K) / K**0.5, torch.randn(K, I) / I**0.5]
    else:
        weights = [torch.randn(I, K) / K**0.5, torch.randn(I, K) / K**0.5, torch.randn(K, I) / I**0.5]
    weights = [w.requires_grad_() for w in weights]

    def forward():
        if way == "ours":
            return gated_mlp_interleaved(x, weights[0], None, weights[1], None, GatedEpilogue("silu"), mode, "torch")
        wg, wu, wd = weights
        return F.linear(liger_silu_mul(F.linear(x, wg), F.linear(x, wu)), wd)

    with LiveTensors({t.untyped_storage().data_ptr() for t in (x, dy, *weights)}) as tracker:
        y = forward()
        y.backward(dy)  # y stays alive through the backward, as in bench_train
        del y
    assert all(t.grad is not None for t in (x, *weights))
    return tracker.peak // 4


@pytest.mark.parametrize("mode", ["store", "recompute"])
@pytest.mark.parametrize("m", [32, 64, 128])
def test_ours_peak_is_the_count(m, mode):
    assert peak_elements(m, "ours", mode) == ours_count(m, K, I, mode)


@pytest.mark.parametrize("m", [32, 64, 128, 200])
def test_store_in_two_halves_peaks_at_its_count(m, monkeypatch):
    """P split at s = I / 2 = 112: MK below one P's peak; at M >= K at or below Liger's (equal at M = K),
    and M(I - 2K) above it for M < K, where Liger's peak is up_proj's backward."""
    monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", 1)
    assert training.preact_split(torch.empty(m, K), I) == 112
    peak = peak_elements(m, "ours")
    assert peak == ours_split_count(m, K, I, 112)
    assert peak == ours_count(m, K, I, "store") - m * K or m > 2 * K  # past 2K the forward's dWd step sets it
    if m >= K:
        assert peak <= liger_count(m, K, I)
    else:
        assert peak - liger_count(m, K, I) == m * (I - 2 * K)


@pytest.mark.parametrize("m", [32, 64, 128])
def test_liger_style_peak_is_its_count(m):
    assert peak_elements(m, "liger") == liger_count(m, K, I)


def test_recompute_frees_dpreact_before_dwd_below_k():
    """M < K, recompute: dWd after dP is freed lowers the peak by I * min(K - M, M) under store's order."""
    assert peak_elements(32, "ours", "recompute") == peak_elements(32, "ours", "store") - I * 32


def test_ours_against_liger_style():
    """At M = K ours is dx (M*K) above the Liger-style peak; past 2IK / (2I - K) it is at or below."""
    assert peak_elements(64, "ours") - peak_elements(64, "liger") == 64 * K
    assert peak_elements(128, "ours") <= peak_elements(128, "liger")


def cuda_peak_mib(module, m, k):
    """(peak MiB above the inputs, as bench_train reads it) of module's forward + backward, bf16."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    module(x).backward(dy)  # warm-up: compiles, cuBLAS's workspace
    for t in (x, *module.parameters()):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = module(x)
    y.backward(dy)
    torch.cuda.synchronize()
    del y
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.skipif(not CUDA, reason="the caching allocator's peak needs CUDA (the CPU count is above)")
@pytest.mark.parametrize("way", ["store", "store, one P", "recompute", "liger"])
@pytest.mark.parametrize("m", [512, 1024, 2048])
def test_cuda_peak_is_the_count(way, m, monkeypatch):
    """Within 1 MiB over the count (Triton's and cuBLAS's small scratch); one [M, I] more is 3.5+ MiB.
    "store" splits P where the rule does (from SPLIT_MIN_TOKENS = 1024 tokens), "store, one P" never."""
    k, i = 1024, 3584
    if way == "store, one P":
        monkeypatch.setattr(training, "SPLIT_MIN_TOKENS", 10**9)
    if way == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            pytest.skip("liger-kernel is not installed")
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        from transformers import LlamaConfig

        module = LigerSwiGLUMLP(LlamaConfig(hidden_size=k, intermediate_size=i, hidden_act="silu"))
        module, count = module.to("cuda", torch.bfloat16), liger_count(m, k, i)
    else:

        class Ours(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(2 * i, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
                self.wd = torch.nn.Parameter(torch.randn(k, i, device="cuda", dtype=torch.bfloat16) / i**0.5)

            def forward(self, x):
                return gated_mlp_interleaved(x, self.w, None, self.wd, None, GatedEpilogue("silu"), way.split(",")[0])

        split_at = training.preact_split(torch.empty(m, k), i) if way == "store" else 0
        count = ours_split_count(m, k, i, split_at) if split_at else ours_count(m, k, i, way.split(",")[0])
        module = Ours()
    peak = cuda_peak_mib(module, m, k)
    assert count * 2 / 2**20 <= peak <= count * 2 / 2**20 + 1, (peak, count * 2 / 2**20)
