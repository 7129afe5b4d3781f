"""`DeployContext`: the read-only inputs every transform may consult (sizes, dtype, options).

A transform never writes results here: what it did (matches, detail, bytes saved, resources its
cached ops declared, a compiled program) is its return value, collected by `run_pipeline`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdeploy.checkpoint.lazy import LazyWeights
from specdeploy.distributed.config import DistConfig

# NOTE: MoE routers stay fp: int8 noise there flips expert choices (a discrete jump). Drafters
# are excluded by default too; SpecConfig.draft_quantize lifts that.
TARGET_QUANT_EXCLUDE = ("lm_head", "*.gate", "*.shared_expert_gate")


@dataclass(frozen=True)
class DeployContext:
    model: nn.Module | None  # the plain model the graph was exported from (weights' provenance)
    page_size: int = 16
    max_batch_size: int = 16
    max_seq_len: int = 2048
    max_cache_gib: float | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    spec_steps: int = 0  # K + 1 when speculative decoding is on (spec-state depth), else 0
    capture_layers: tuple[int, ...] = ()
    quantize: str | None = None  # e.g. "int8" (weight-only)
    quant_exclude: tuple[str, ...] = TARGET_QUANT_EXCLUDE + ("eagle_drafter.*",)
    compile: bool = False
    disabled: frozenset[str] = frozenset()
    resource_prefix: str = ""  # keeps a drafter's cache names apart from the target's
    kernels: str = "exact"  # GGUF-block linears: "exact" fp32 or "fast" integer-dot (ggml_linears)
    kv_cache_dtype: torch.dtype | None = None  # None: `dtype`; float8 for an FP8 KV checkpoint
    dist: DistConfig | None = None  # the rank this program is sharded for (None: world size 1)
    prefix_caching: bool = False  # recurrent cached ops also declare checkpoint pools
    # per-rank loading: the weights' loaders, read by the shard transform (checkpoint/lazy.py)
    lazy: LazyWeights | None = None
    # a pre-quantized checkpoint's weights the shard transform sliced: identity of the rank's
    # fp slice -> (its quantized slice, FP8 input scale), read by prequantized_weights
    prequant_slices: dict = field(default_factory=dict)
