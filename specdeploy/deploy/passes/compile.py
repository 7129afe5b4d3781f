"""Final stage: optionally wrap the transformed GraphModule with `torch.compile`.

Off by default on the CPU: inductor's compile time (minutes for a 30-layer model on 2 cores)
outweighs its gain for short runs. `--compile` turns it on.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register


@register("compile_model", Stage.COMPILE)
def compile_model(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    if not ctx.compile:
        return TransformInfo("compile_model", Stage.COMPILE, 0, skipped=True,
                             detail="compile=False")
    ctx.compiled = torch.compile(gm, dynamic=True)
    return TransformInfo("compile_model", Stage.COMPILE, 1, detail="torch.compile(dynamic=True)")
