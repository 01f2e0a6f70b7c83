"""Routing decisions of an MoE model, recorded per forward pass, and how often two runs differ.

Routing is discrete: a rounding difference upstream of a router can move a token to another
expert. `RoutingRecorder` hooks every router module of a model (a module whose class name ends
in "Router": transformers' ``Gemma4TextRouter``, ``Qwen3MoeTopKRouter``, ...) and keeps the top-k
expert ids it returns, in call order. Two runs of the same inputs make the same calls with the
same shapes, so their records pair call by call; `routing_flips` counts the decisions (one per
token and router call) whose chosen experts differ.
"""

from __future__ import annotations

import torch


def _top_k_ids(output) -> torch.Tensor:
    """The last integer tensor of a router's output tuple: transformers' routers return
    (scores or logits, top-k weights, top-k ids)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for item in reversed(items):
        if isinstance(item, torch.Tensor) and not item.is_floating_point():
            return item
    raise TypeError(f"RoutingRecorder: the router returned no integer tensor of expert ids, got {type(output).__name__}")


class RoutingRecorder:
    """Records the top-k expert ids every router of `model` chooses, while it is active.

    Use as a context manager; each `with` block starts a fresh record::

        with RoutingRecorder(model) as eager_routes:
            model(ids)
        eager_routes.calls   # [int16 [tokens, k] per router call, in call order]

    Args:
        model: a module holding router submodules (class name ending in "Router").

    Raises:
        ValueError: the model has no router module.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
        if not self.routers:
            raise ValueError(f"RoutingRecorder: {type(model).__name__} has no router module (a class named *Router)")
        self.calls: list[torch.Tensor] = []
        self._handles = []

    def _hook(self, module, args, output) -> None:
        ids = _top_k_ids(output)
        self.calls.append(ids.reshape(-1, ids.shape[-1]).to("cpu", torch.int16))

    def __enter__(self) -> RoutingRecorder:
        self.calls = []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def routing_flips(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """How many routing decisions differ between two recorded runs of the same inputs.

    Args:
        a, b: `RoutingRecorder.calls` of the two runs: per router call, int [tokens, k] expert
            ids, the first column the highest-scored expert.

    Returns:
        {decisions (tokens x router calls), set_changed (share of decisions whose set of k
        experts differs), top1_changed (share whose first expert differs), slots_changed
        (share of the k x decisions expert slots not in the other run's set)}.

    Raises:
        ValueError: the runs made different calls (not the same inputs, or another model).
    """
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError(f"routing_flips: the runs made {len(a)} and {len(b)} router calls of different shapes; "
                         "record the same inputs on the same model")
    if not a:
        raise ValueError("routing_flips: no router calls recorded")
    x, y = torch.cat(a).long(), torch.cat(b).long()
    xs, ys = x.sort(-1).values, y.sort(-1).values
    k = x.shape[1]
    shared = (x[:, :, None] == y[:, None, :]).any(-1).sum(-1)  # [decisions]: experts of x also in y
    return {
        "decisions": x.shape[0],
        "set_changed": (xs != ys).any(-1).double().mean().item(),
        "top1_changed": (x[:, 0] != y[:, 0]).double().mean().item(),
        "slots_changed": (k - shared).double().sum().item() / (k * x.shape[0]),
    }
