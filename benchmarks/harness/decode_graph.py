"""Greedy decode with a static KV cache and the decode step captured once in a CUDA graph.

What a serving engine's decode graph (or torch.compile's reduce-overhead mode) runs: the host
launches one graph per token instead of every kernel of every layer, so the step costs GPU time,
not Python. `bench_e2e` times it for eager and patched models; this file only builds and runs it.

One `GraphDecoder` per (model, batch, prompt length, new tokens):
- the cache is transformers' `StaticCache` (its layers keep their write position in a device
  tensor, `cumulative_length`, that each step advances in place, so a replay writes the next slot);
- the step's inputs are static buffers: `tok` [B, 1] int64 (the last token), `pos` [B, 1] int64 (its
  position, for RoPE) and a 4D bool attention mask [B, 1, 1, L] (True: attend), L = prompt + new,
  which transformers passes to SDPA as it is; the step itself picks the next token (argmax) and
  advances `tok`, `pos` and the mask, all on the device;
- `run()` resets the cache, runs the prompt as one ordinary forward (not captured: its shapes are
  the prompt's), then replays the step new - 1 times; it returns the [B, new] tokens and the
  steps' time.

With `capture=False` (CPU, the dry run) the step runs as plain calls: same tokens, no graph.
"""

from __future__ import annotations

import time

import torch


class GraphDecoder:
    """Greedy decoding of `new` tokens after [B, P] prompts `ids`, the step as one CUDA graph."""

    def __init__(self, model, ids: torch.Tensor, new: int, capture: bool = True):
        from transformers import StaticCache

        if new < 1:
            raise ValueError(f"GraphDecoder: new must be >= 1, got {new}")
        self.model, self.ids, self.new = model, ids, new
        b, p = ids.shape
        device = ids.device
        self.length = p + new
        self.cache = StaticCache(config=model.config, max_cache_len=self.length)
        causal = torch.ones(p, self.length, dtype=torch.bool, device=device).tril()  # key j <= query i
        self.prefill_mask = causal[None, None].expand(b, 1, p, self.length)
        self.prefill_pos = torch.arange(p, device=device)[None].expand(b, p)
        self.tok = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(b, 1, 1, self.length, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(b, new, dtype=torch.long, device=device)
        self.graph = None
        if capture:
            self._capture()

    def _prefill(self) -> None:
        """Empty the cache, run the prompt, set the step's buffers for the first new token."""
        p = self.ids.shape[1]
        self.cache.reset()
        logits = self.model(self.ids, attention_mask=self.prefill_mask, position_ids=self.prefill_pos,
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.fill_(p)
        self.mask.zero_()
        self.mask[..., : p + 1] = True  # the prompt and the new token itself

    def _step(self) -> None:
        """One token: forward of `tok` at `pos`, argmax into `tok`, advance `pos` and the mask."""
        logits = self.model(self.tok, attention_mask=self.mask, position_ids=self.pos, past_key_values=self.cache,
                            use_cache=True).logits
        self.tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)
        b = self.pos.shape[0]
        self.mask.scatter_(3, self.pos.clamp(max=self.length - 1).view(b, 1, 1, 1), True)

    def _capture(self) -> None:
        """Warm the step up on a side stream (compiles, allocates), then capture it."""
        self._prefill()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self._prefill()  # the warm-up wrote two slots: start over
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def run(self) -> tuple[torch.Tensor, float]:
        """Prompt, then new - 1 steps. Returns the [B, new] greedy tokens (device tensor) and the
        seconds the steps took: CUDA events around them (the GPU's time, host waits included),
        or the wall clock on CPU."""
        self._prefill()
        self.tokens[:, 0:1].copy_(self.tok)
        cuda = self.tok.is_cuda
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(1, self.new):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            self.tokens[:, i:i + 1].copy_(self.tok)
        if cuda:
            end.record()
            end.synchronize()
            return self.tokens, start.elapsed_time(end) / 1e3
        return self.tokens, time.perf_counter() - t0
