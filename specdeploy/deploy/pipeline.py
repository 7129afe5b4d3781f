"""The ordered transform pipeline: stage enum, transform registry, `deploy_model`, `describe`.

Contract (DESIGN.md invariant 5): a transform is `(gm, ctx) -> TransformInfo`, registered by name
under a stage; the pipeline runs stages in enum order and transforms in registration order within
a stage. Each reports how many nodes it matched; a transform that finds nothing it requires fails.
"""
from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn


class Stage(enum.IntEnum):
    POST_EXPORT = 0  # clean-up of what torch.export leaves
    PATTERN = 1  # pattern matching / hidden-state capture / logits gathering
    QUANTIZE = 2
    SHARD = 3
    CACHE = 4  # canonical ops → cached ops + resources
    COMPILE = 5


@dataclass
class TransformInfo:
    name: str
    stage: Stage
    num_matches: int
    skipped: bool = False
    detail: str = ""


# NOTE: MoE routers stay fp: int8 noise there flips expert choices (a discrete jump). Drafters
# are excluded by default too (DeployContext); SpecConfig.draft_quantize lifts that.
TARGET_QUANT_EXCLUDE = ("lm_head", "*.gate", "*.shared_expert_gate")


@dataclass
class DeployContext:
    """Everything a transform may read; `resources` collects what cached ops declared."""

    model: nn.Module | None  # the plain model; dropped (None) once the pipeline has run
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
    kernels: str = "exact"  # GGUF block linears: "exact" (fp32) or "fast" (integer dot)
    disabled: frozenset[str] = frozenset()
    resource_prefix: str = ""  # keeps a drafter's cache names apart from the target's
    resources: list = field(default_factory=list)  # cache.handlers.ResourceHandler
    inputs: dict[str, fx.Node] = field(default_factory=dict)
    compiled: Callable | None = None  # set by the compile stage


Transform = Callable[[fx.GraphModule, DeployContext], TransformInfo]
_REGISTRY: dict[str, tuple[Stage, Transform]] = {}

# Pass modules, imported for their registrations (order inside a stage = this order).
_PASS_MODULES = (
    "specdeploy.deploy.passes.cleanup",
    "specdeploy.deploy.passes.capture_hidden",
    "specdeploy.deploy.passes.gather_logits",
    "specdeploy.deploy.passes.quantize",
    "specdeploy.deploy.passes.insert_cache",
    "specdeploy.deploy.passes.ggml_linears",  # before fusion: it fuses its own groups
    "specdeploy.deploy.passes.fuse_linears",
    "specdeploy.deploy.passes.pack_linears",
    "specdeploy.deploy.passes.compile",
)


def register(name: str, stage: Stage):
    def deco(fn: Transform) -> Transform:
        if name in _REGISTRY:
            raise ValueError(f"transform {name!r} registered twice")
        _REGISTRY[name] = (stage, fn)
        return fn

    return deco


def transforms() -> list[tuple[str, Stage, Transform]]:
    for m in _PASS_MODULES:
        importlib.import_module(m)
    items = [(n, s, f) for n, (s, f) in _REGISTRY.items()]
    # NOTE: within a stage, _PASS_MODULES order (then registration order), whichever module a
    # caller happened to import first
    rank = {m: i for i, m in enumerate(_PASS_MODULES)}
    return sorted(items, key=lambda x: (x[1], rank.get(x[2].__module__, len(rank))))


def run_pipeline(gm: fx.GraphModule, ctx: DeployContext) -> list[TransformInfo]:
    items = transforms()
    unknown = set(ctx.disabled) - {name for name, _, _ in items}
    if unknown:  # a misspelt name would silently disable nothing
        raise ValueError(f"disabled: unknown transforms {sorted(unknown)}; known: "
                         f"{', '.join(name for name, _, _ in items)}")
    infos = []
    for name, stage, fn in items:
        if name in ctx.disabled:
            infos.append(TransformInfo(name, stage, 0, skipped=True, detail="disabled"))
            continue
        info = fn(gm, ctx)
        infos.append(info)
    return infos


def deploy_model(path=None, **kwargs):
    """Load, export and transform a checkpoint into a `GraphDeployed` (see deploy/runner.py)."""
    from specdeploy.deploy.runner import build_deployed

    return build_deployed(path, **kwargs)


def describe(path=None, **kwargs) -> str:
    """The ordered transform list with match counts, then the cache plan (for the CLI)."""
    deployed = deploy_model(path, **kwargs)
    return deployed.report()
