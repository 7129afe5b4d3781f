"""Weight-only quantization stage (placeholder registration; filled in by the quantize work)."""
from __future__ import annotations

from torch import fx

from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register


@register("quantize_int8_weights", Stage.QUANTIZE)
def quantize_int8_weights(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    if ctx.quantize is None:
        return TransformInfo("quantize_int8_weights", Stage.QUANTIZE, 0, skipped=True,
                             detail="quantize=None")
    raise NotImplementedError("quantize_int8_weights")
