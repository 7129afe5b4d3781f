"""What the GGUF-block passes share (ggml_linears, ggml_moe_experts, row_linears, shard): the
graph's weights that have blocks, the kernel family `ctx.kernels` picks, and where the CPU
kernels do not run.
"""
from __future__ import annotations

import os

from specdeploy.deploy.context import DeployContext
from specdeploy.ops import ggml_int
from specdeploy.ops.ggml_linear import warn_unbuilt

KERNELS = ("exact", "fast")


def _weight_map(ctx: DeployContext) -> dict:
    named = getattr(ctx.model, "ggml_weights", None) or {}
    out = {}
    for name, p in ctx.model.named_parameters():
        if name in named:
            out[(p.data_ptr(), tuple(p.shape), p.stride())] = named[name]
    # a drafter's: weights it borrows from the target and its own Q8_0 ones (deploy/spec.py)
    for p, gw in getattr(ctx.model, "ggml_tensors", ()):
        out[(p.data_ptr(), tuple(p.shape), p.stride())] = gw
    return out


def _fast_isa(kernels: str, warn: bool = True) -> tuple[str | None, str]:
    """(ISA path of the integer-dot kernels or None for the exact one, what the report says).
    "fast" falls back to the exact kernel, with one warning, where no SIMD integer path runs
    (the portable scalar one is slower than fp32 there) unless SPECDEPLOY_GGML_ISA forces it."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "exact":
        return None, "exact fp32 kernel"
    why = ggml_int.kernel_unavailable()
    if why is None:
        isa = ggml_int.default_isa()
        if isa != "scalar" or os.environ.get("SPECDEPLOY_GGML_ISA") == "scalar":
            return isa, f"integer-dot kernel, {isa}"
        why = "no SIMD integer path on this CPU"
        if warn:  # (once: the passes after this one ask again quietly)
            warn_unbuilt("the fast integer-dot path", why)
    return None, f"exact fp32 kernel; fast unavailable: {why}"


def _not_here(ctx: DeployContext) -> str | None:
    if ctx.compile:
        return "compile=True"
    if ctx.device.type != "cpu":
        return f"CPU kernels; device is {ctx.device}"
    return None
