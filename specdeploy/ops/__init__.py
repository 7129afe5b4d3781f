"""Canonical ops (``torch.ops.specdeploy.*``): importing this package registers all of them.

Each module holds a pure-torch ``*_ref`` oracle, the custom op (fast kernel) and its fake kernel.
The contract is docs/interfaces.md. The ``*_core`` functions (explicit initial state in, final
state and optionally the state after every token out) are what the cached variants build on.
"""

from __future__ import annotations

from specdeploy.ops import (  # noqa: F401  (registers ops)
    attention,
    collectives,
    conv,
    fused_rows,
    gdn,
    moe,
    moe_bias,
    norm,
    norm_linear,
    quant_linear,
    rope,
    shard,
    ssm,
)
from specdeploy.ops.attention import attention_mask, attention_ref
from specdeploy.ops.conv import ConvOutput, causal_conv1d_core, causal_conv1d_ref
from specdeploy.ops.gdn import DeltaOutput, gated_delta_rule_core, gated_delta_rule_ref
from specdeploy.ops.moe import Routing, moe_experts_ref, route_sigmoid, route_softmax_topk
from specdeploy.ops.norm import gated_rms_norm_ref, rms_norm_ref
from specdeploy.ops.rope import RopeCosSin, rope_cos_sin, rope_ref
from specdeploy.ops.ssm import ScanOutput, ssm_dt, ssm_scan_core, ssm_scan_ref

__all__ = [
    "ConvOutput",
    "DeltaOutput",
    "Routing",
    "RopeCosSin",
    "ScanOutput",
    "attention_mask",
    "attention_ref",
    "causal_conv1d_core",
    "causal_conv1d_ref",
    "gated_delta_rule_core",
    "gated_delta_rule_ref",
    "gated_rms_norm_ref",
    "moe_experts_ref",
    "rms_norm_ref",
    "rope_cos_sin",
    "rope_ref",
    "route_sigmoid",
    "route_softmax_topk",
    "ssm_dt",
    "ssm_scan_core",
    "ssm_scan_ref",
]
