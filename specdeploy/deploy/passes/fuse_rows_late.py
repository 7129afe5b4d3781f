"""`fuse_leftover_rows`: the small torch op chains that the block fusions before it left, one
row kernel call each (CPU, fp32, not compiled).

- `square(relu(x))`, NemotronH's ReLU² on a shared expert or a dense MLP that
  `fuse_moe_blocks` did not take (16-bit or fp32 weights on the exact kernels; a NemotronH
  safetensors checkpoint, hybrid-demo), becomes `relu2_rows(x)` (row_kernels.c `elementwise`
  op 4: torch's relu then one multiply, the same bits).
- `add_rms_norm(a, add(b, c))`, a MoE layer's routed + shared outputs summed and then added to
  the residual before the next norm, becomes `add3_rms_norm_rows(a, b, c, ...)`: a + (b + c) in
  torch's order, then the norm as `add_rms_norm` computes it (the same bits).

Why: each torch op of a replayed step (engine/cpu_graphs.py) is a dispatch, an allocation and
a copy, 15-35 us apiece on hybrid-demo's replayed steps (cache-cold, 2 cores, 2026-12-07; its
relu, square and add were ~0.15 ms of a 1.55 ms decode step), and each one splits the replay's
runs of C calls. Runs after fuse_moe_blocks and fuse_decoder_layers, which match these ops
themselves, and before call_aten_directly (it matches aten targets).
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.passes.chain_fusion import _skip
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import row_kernels
from specdeploy.ops.fused_rows import _add_rms_norm_kernel

_aten = torch.ops.aten
_ADD_NORM = (torch.ops.specdeploy.add_rms_norm.default, _add_rms_norm_kernel)


def relu2_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.square(torch.relu(x)) in one C call where the kernel takes `x` (fp32 on the CPU)."""
    out = row_kernels.elementwise("relu2", x)
    return torch.square(torch.relu(x)) if out is None else out


def add3_rms_norm_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(a, b + c)` in one C call where the kernel takes the three (one shape);
    else that chain itself (a broadcasting add, another dtype)."""
    out = row_kernels.add3_rms_norm(a, b, c, weight, eps)
    return _add_rms_norm_kernel(a, b + c, weight, eps) if out is None else out


def _plain(node, target, nargs: int) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and not node.kwargs and len(node.args) == nargs)


def _fuse_relu2(gm: fx.GraphModule) -> int:
    n = 0
    for node in list(gm.graph.nodes):
        if not _plain(node, _aten.square.default, 1):
            continue
        relu = node.args[0]
        if not _plain(relu, _aten.relu.default, 1) or set(relu.users) != {node}:
            continue
        node.target, node.args = relu2_rows, relu.args
        gm.graph.erase_node(relu)
        n += 1
    return n


def _fuse_add3(gm: fx.GraphModule) -> int:
    n = 0
    for node in list(gm.graph.nodes):
        if (node.op != "call_function" or node.target not in _ADD_NORM or node.kwargs
                or len(node.args) != 4):
            continue
        a, b, weight, eps = node.args
        for res, add in ((a, b), (b, a)):  # (a + t == t + a: either side may be the sum)
            if (_plain(add, _aten.add.Tensor, 2) and set(add.users) == {node}
                    and all(isinstance(v, fx.Node) for v in add.args) and isinstance(res, fx.Node)
                    and res is not add):
                node.target, node.args = add3_rms_norm_rows, (res, *add.args, weight, eps)
                gm.graph.erase_node(add)
                n += 1
                break
    return n


@register("fuse_leftover_rows", Stage.COMPILE, skip_if=_skip)
def fuse_leftover_rows(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    if row_kernels._library() is None:
        return Skipped("row kernels unavailable")
    relu2, add3 = _fuse_relu2(gm), _fuse_add3(gm)
    if relu2 + add3:
        gm.graph.lint()
        gm.recompile()
    return Done(relu2 + add3, f"{relu2} relu^2, {add3} add + add + rms_norm")
