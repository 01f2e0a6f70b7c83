"""A tiny random-init Llama with a byte-level tokenizer, built entirely offline.

For smoke tests and CI of the accuracy harness: it runs lm-eval's real evaluator end to end
in seconds on a CPU, with no hub access. Its answers are noise (random weights); what it
exercises is the plumbing, the pairing of eager and fused results and the statistics.

The tokenizer is byte-level BPE with no merges: one token per UTF-8 byte (256 tokens) plus
``<s>``, ``</s>`` and ``<pad>``, and a post-processor that prepends ``<s>`` like Llama's. It
encodes any text, so every lm-eval prompt and continuation tokenizes.
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def save_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Build the tiny Llama and save model and tokenizer to `path` (a local checkpoint).

    Args:
        path: directory to write (created).
        seed: torch seed for the weights.

    Returns:
        The directory, loadable by `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained` with no network.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny_llama(seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
