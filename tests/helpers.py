"""Shared test helpers: relative error against a float64 reference, tiny random-init models
(one per family in the registry), and a noisy patcher for the eval harness's tests.

Tiny models: 2 layers, hidden 64, real structure.

intermediate_size 72 is not a multiple of the layout's block of 16, so the last gate/up
block of every MLP is partial. initializer_range 0.2 (HF's default is 0.02) makes the MLPs
move the logits enough that a wrong MLP shows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from swiglu_patch.evals.patching import Patcher


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (Frobenius norm over all elements)."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

_COMMON = dict(
    hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_act="silu"),
    "mistral": dict(hidden_act="silu", sliding_window=32),
    "gemma": dict(hidden_act="gelu_pytorch_tanh", head_dim=16),
    "gemma2": dict(hidden_activation="gelu_pytorch_tanh", head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    "gemma3_text": dict(hidden_activation="gelu_pytorch_tanh", head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    "qwen2": dict(hidden_act="silu"),
    "qwen3": dict(hidden_act="silu", head_dim=16),
    "phi3": dict(hidden_act="silu"),
}


def compiled_targets(fn, *args) -> list[str]:
    """The call_function targets ("swiglu_patch.gated_mlp.default", ...) of the graph torch.compile
    captures (fullgraph) when it compiles fn(*args); the graph runs as captured."""
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=recording_backend, fullgraph=True)(*args)
    return targets


def tiny_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **(_COMMON | TINY_CONFIGS[model_type] | overrides))


def tiny_model(model_type: str, dtype=torch.float32, device="cpu", **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.to(device).eval()


# -- kernel checks against float64 ------------------------------------------------------------
# Pass rule (quack's): ours is within twice the error of PyTorch's own same-dtype computation
# (two GEMMs, then the epilogue's ops in that dtype, as HF eager does) plus a small per-dtype
# epsilon. The float64 reference writes each epilogue's formula out (kernels/epilogue.py's
# docstring), sharing no code with the product.

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def cpu_triton_refusal() -> str | None:
    """Why this process cannot run the Triton kernels on CPU tensors, or None. A test that builds CPU
    models with backend "triton" skips with it: on a GPU machine the interpreter is off (tests/training
    and tests/moe run the compiled kernels there), and an interpreter can be one that cannot run them
    (`interpreter_blocker`: Triton 3.6 under NumPy 2.4)."""
    from swiglu_patch.kernels.device import interpreter_blocker, interpreting

    if not interpreting():
        return ("builds CPU models: the Triton path on CPU needs TRITON_INTERPRET=1 (tests/training and tests/moe "
                "run the kernels on the GPU)")
    return interpreter_blocker()


def interpreter_subprocess_env(kernels: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs on CPU under Triton's interpreter (CUDA hidden, so on
    a GPU machine too), offline. With `kernels` (the subprocess runs the Triton kernels), skips the
    calling test where the installed Triton's interpreter cannot run them (`interpreter_blocker`)."""
    import os

    import pytest

    from swiglu_patch.kernels.device import interpreter_blocker

    blocker = interpreter_blocker() if kernels else None
    if blocker:
        pytest.skip(f"its subprocess runs the kernels in Triton's interpreter: {blocker}")
    return {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "CUDA_VISIBLE_DEVICES": "", **extra}


ACTS = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "gelu": F.gelu}
EPS = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def make_case(m, k, i, dtype, bias, device=DEVICE, scale=1.0):
    """Fresh random inputs; gate/up scaled so pre-activations are O(scale)."""
    x = (torch.randn(m, k, device=device) * scale).to(dtype)
    gate = (torch.randn(i, k, device=device) / k**0.5).to(dtype)
    up = (torch.randn(i, k, device=device) / k**0.5).to(dtype)
    bg = torch.randn(i, device=device).to(dtype) if bias else None
    bu = torch.randn(i, device=device).to(dtype) if bias else None
    return x, gate, up, bg, bu


def packed_of(gate, up):
    """The interleaved [2*I, K] (or [2*I]) tensor of gate and up; None for None."""
    from swiglu_patch.kernels.layout import interleave_gate_up

    return None if gate is None else interleave_gate_up(gate, up)


def _epilogue_fields(epilogue):
    if isinstance(epilogue, str):
        return epilogue, 1.0, 1.0, None, "gate"
    return epilogue.activation, epilogue.gate_scale, epilogue.out_scale, epilogue.limit, epilogue.clamp


def epilogue64(g, u, epilogue):
    """The gated epilogue on float64 pre-activations, written out."""
    act, gate_scale, out_scale, limit, clamp = _epilogue_fields(epilogue)
    g = g * gate_scale
    if limit is not None:
        u = torch.clamp(u, -limit, limit)
        if clamp == "gate":
            g = torch.clamp(g, max=limit)
    a = ACTS[act](g)
    if limit is not None and clamp == "activation":
        a = torch.clamp(a, max=limit)
    return a * u * out_scale


def reference64(x, gate, up, bg, bu, epilogue="silu"):
    g = x.double() @ gate.double().T + (bg.double() if bg is not None else 0)
    u = x.double() @ up.double().T + (bu.double() if bu is not None else 0)
    return epilogue64(g, u, epilogue)


def torch_same_dtype(x, gate, up, bg, bu, epilogue="silu"):
    from swiglu_patch.kernels.epilogue import GatedEpilogue

    return GatedEpilogue.of(epilogue).apply(F.linear(x, gate, bg), F.linear(x, up, bu))


def check(ours, x, gate, up, bg, bu, epilogue="silu"):
    ref = reference64(x, gate, up, bg, bu, epilogue)
    assert ours.shape == ref.shape and ours.dtype == x.dtype
    assert torch.isfinite(ours).all(), "non-finite output (unwritten element or overflow)"
    bound = 2 * rel_err(torch_same_dtype(x, gate, up, bg, bu, epilogue), ref) + EPS[x.dtype]
    assert rel_err(ours, ref) <= bound, f"error {rel_err(ours, ref):.3g} > bound {bound:.3g}"


# -- the eval harness's negative control ----------------------------------------------------

class NoisyPatcher(Patcher):
    """The real patch plus noise on `gate_up_interleaved`; `restore` undoes both."""

    name = "perturbed"

    def __init__(self, scale: float, seed: int = 0):
        super().__init__(backend="torch")
        self.scale, self.seed, self.saved, self.applied = scale, seed, [], 0

    def apply(self, model):
        text = super().apply(model)
        gen = torch.Generator().manual_seed(self.seed)
        for m in model.modules():
            w = getattr(m, "gate_up_interleaved", None)
            if isinstance(w, torch.Tensor):
                self.saved.append((w, w.detach().clone()))
                noise = torch.randn(w.shape, generator=gen).to(w.dtype)
                w.data.add_(noise * self.scale * w.float().std().to(w.dtype))
        if not self.saved:
            raise AssertionError("no gate_up_interleaved found: the patch did not apply")
        self.applied += 1
        return text + " + noise"

    def restore(self, model):
        for w, orig in self.saved:
            w.data.copy_(orig)
        self.saved = []
        super().restore(model)


# -- a tiny Llama with a byte-level tokenizer, for the eval harness -------------------------
# Built entirely offline: lm-eval's real evaluator runs end to end on it in seconds on a CPU.
# Its answers are noise (random weights); what it exercises is the plumbing, the pairing of
# eager and fused results and the statistics. The tokenizer is byte-level BPE with no
# merges: one token per UTF-8 byte (256) plus <s>, </s> and <pad>, with <s> prepended like
# Llama's, so every lm-eval prompt and continuation tokenizes.

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def build_byte_tokenizer():
    """A byte-level `PreTrainedTokenizerFast` (259 tokens) that needs no download.

    Returns:
        transformers.PreTrainedTokenizerFast with bos ``<s>`` (prepended on encode), eos
        ``</s>`` and pad ``<pad>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for name in (BOS, EOS, PAD):
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=2048
    )


def build_tiny_llama(seed: int = 0, vocab_size: int | None = None):
    """A 2-layer Llama (hidden 64, intermediate 128, 4 heads, 2 KV heads), float32, random init.

    Args:
        seed: torch seed for the weights.
        vocab_size: defaults to the byte tokenizer's 259.

    Returns:
        (model, tokenizer): a `LlamaForCausalLM` in eval mode on CPU and its tokenizer.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform next-token distributions; widen the logits so answers
    # are not all near-ties (a larger output scale, as a trained model has).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model, tokenizer


def save_tiny_llama(path, seed: int = 0):
    """Build the tiny Llama and save model and tokenizer to `path` (a local checkpoint).

    Args:
        path: directory to write (created), str or Path.
        seed: torch seed for the weights.

    Returns:
        The directory, loadable by `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained` with no network.
    """
    from pathlib import Path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny_llama(seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
