"""The one table of real model dimensions the MLP benchmark runs, and the token counts.

Shape letters as everywhere in this repo: M = tokens, K = hidden_size, I =
intermediate_size, N = 2*I rows in the packed gate/up weight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLPShape:
    """The first half of one model's gated MLP: act(x @ Wg^T) * (x @ Wu^T).

    Attributes:
        name: short key used on the command line and in the results.
        models: the model(s) with these dimensions, for the tables.
        hidden: K, the model's hidden_size (x is [M, K]).
        intermediate: I, the MLP's intermediate_size (Wg and Wu are [I, K]).
        activation: the gate's activation as `swiglu_patch.gated_linear` names it.
    """

    name: str
    models: str
    hidden: int
    intermediate: int
    activation: str

    @property
    def label(self) -> str:
        return f"{self.models} (K={self.hidden}, I={self.intermediate}, {self.activation})"


# Dimensions from each model's config.json (hidden_size, intermediate_size, hidden_act /
# hidden_activation): Gemma 2 uses gelu_pytorch_tanh, the others silu.
SHAPES: tuple[MLPShape, ...] = (
    MLPShape("llama-3.2-1b", "Llama-3.2-1B", 2048, 8192, "silu"),
    MLPShape("llama-3-8b", "Llama-3-8B / Mistral-7B", 4096, 14336, "silu"),
    MLPShape("qwen2.5-7b", "Qwen2.5-7B", 3584, 18944, "silu"),
    MLPShape("gemma-2-9b", "Gemma-2-9B", 3584, 14336, "gelu_tanh"),
    MLPShape("gemma-2-27b", "Gemma-2-27B", 4608, 36864, "gelu_tanh"),
    MLPShape("llama-3-70b", "Llama-3-70B", 8192, 28672, "silu"),
)

# One GPU's shard of the gate/up weight under tensor parallelism over tp GPUs (the packed rows
# split by column blocks: I / tp per GPU, K whole). Not part of the benchmark table: `python -m
# benchmarks.tune --tp-shards` sweeps them (a decode call on a shard has fewer tiles than SMs).
TP_SHARD_SHAPES: tuple[MLPShape, ...] = (
    MLPShape("llama-3-8b-tp4", "Llama-3-8B, 1 of 4 GPUs", 4096, 14336 // 4, "silu"),
    MLPShape("qwen2.5-7b-tp4", "Qwen2.5-7B, 1 of 4 GPUs", 3584, 18944 // 4, "silu"),
    MLPShape("gemma-2-27b-tp8", "Gemma-2-27B, 1 of 8 GPUs", 4608, 36864 // 8, "gelu_tanh"),
    MLPShape("llama-3-70b-tp4", "Llama-3-70B, 1 of 4 GPUs", 8192, 28672 // 4, "silu"),
    MLPShape("llama-3-70b-tp8", "Llama-3-70B, 1 of 8 GPUs", 8192, 28672 // 8, "silu"),
)

# Tokens per call: batch x sequence flattened. 1..16 is decode, >= 512 is prefill.
TOKENS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# --dry-run: tiny shapes that run on CPU in milliseconds. I is not a multiple of the packing
# block (16) in one of them, so the partial last block is exercised too.
DRY_RUN_SHAPES: tuple[MLPShape, ...] = (
    MLPShape("tiny-silu", "tiny (dry run)", 64, 96, "silu"),
    MLPShape("tiny-gelu-tanh", "tiny (dry run)", 48, 40, "gelu_tanh"),
)
DRY_RUN_TOKENS: tuple[int, ...] = (1, 7, 33)


def select_shapes(names: list[str] | None, table: tuple[MLPShape, ...] = SHAPES) -> list[MLPShape]:
    """The shapes named in `names` (all of `table` if None), in the table's order.

    Raises:
        ValueError: a name that is not in the table, listing the known ones.
    """
    if not names:
        return list(table)
    known = {s.name: s for s in table}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [s for s in table if s.name in names]
