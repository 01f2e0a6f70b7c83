"""A patcher for the eval tests: the real patch, then Gaussian noise on every packed gate/up
weight (scale x the weight's std), so a harness that compares eager with fused must see it."""

from __future__ import annotations

import torch

from swiglu_patch.evals.patching import Patcher


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
