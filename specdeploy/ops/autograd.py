"""Backward for the canonical ops by recomputation through their pure-torch kernels.

Drafter training backpropagates through attention / norm / rope (and, for MTP heads on hybrid
targets, through any op), while the ops stay opaque nodes for export. Every kernel here is plain
torch, so the backward re-runs it under autograd: no hand-written gradients to keep in sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_recompute_autograd(op, impl: Callable) -> None:
    """Give custom op ``op`` a backward that differentiates ``impl`` (same args, same outputs)."""

    def setup_context(ctx, inputs, output):
        tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.tensor_pos = tensor_pos
        ctx.args = [None if i in tensor_pos else a for i, a in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos))

    def backward(ctx, *grads):
        args = list(ctx.args)
        wanted = []
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            if ctx.needs_input_grad[i] and t.is_floating_point():
                t = t.detach().requires_grad_(True)
                wanted.append(i)
            args[i] = t
        if not wanted:
            return tuple(None for _ in args)
        with torch.enable_grad():
            outs = impl(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        inputs = [args[i] for i in wanted]
        got = torch.autograd.grad(
            [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
        )
        result: list[torch.Tensor | None] = [None] * len(args)
        for i, g in zip(wanted, got):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
