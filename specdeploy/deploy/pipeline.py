"""The transform pipeline: stages, the registry, `PIPELINE` (the run order) and `run_pipeline`.

Contract (DESIGN.md invariant 5). A transform is `fn(gm, ctx) -> Done | Skipped`, registered with
`@register(name, stage, skip_if=..., requires_match=...)`. It only rewrites: `run_pipeline` names
it, evaluates its skip condition, records skips with their reason, cleans up and lints the graph
once after it, refuses a required transform that matched nothing, and collects what it declared
(cache resources, a compiled program). `PIPELINE` is the one visible order; the registry must
hold exactly its names, with stages in enum order.
"""
from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import finalize


class Stage(enum.IntEnum):
    POST_EXPORT = 0  # clean-up of what torch.export leaves
    PATTERN = 1  # pattern matching: hidden-state capture, logits gathering
    # NOTE: sharding before quantization: int8 scales are then computed on each rank's slice
    SHARD = 2
    QUANTIZE = 3
    CACHE = 4  # canonical ops → cached ops + resources
    OPTIMIZE = 5  # fusions, weight packing, kernels on stored blocks
    COMPILE = 6  # how the graph is called: direct kernels or torch.compile


# (module under deploy/passes, transform name), in run order.
PIPELINE = (
    ("cleanup", "cleanup_export"),
    ("capture_hidden", "capture_hidden_states"),
    ("gather_logits", "gather_logits"),
    ("shard", "shard"),  # skips at world size 1 (export dropped the hints)
    ("prequantized", "prequantized_weights"),  # a checkpoint's own FP8 / NVFP4 weights
    ("fp8_kv", "fp8_kv_scales"),
    ("quantize", "quantize_int8_weights"),
    ("insert_cache", "insert_cached_attention"),
    ("insert_cache", "insert_cached_ssm"),
    ("insert_cache", "insert_cached_conv"),
    ("insert_cache", "insert_cached_gdn"),
    ("insert_cache", "window_kv_pages"),  # sliding-window layers: their own page group
    ("ggml_experts", "ggml_moe_experts"),  # before ggml_linears, which fills deferred weights
    ("ggml_linears", "ggml_linears"),  # before fusion: it fuses its own groups
    ("row_linears", "row_invariant_linears"),  # the fp32 ones beside the fast kernels
    ("fuse_linears", "fuse_parallel_linears"),
    ("pack_linears", "pack_linear_weights"),
    ("fuse_rows", "fuse_row_ops"),
    ("fuse_attention", "fuse_rope_attention"),
    ("fuse_norm_linear", "fuse_norm_linears"),  # after fuse_row_ops' add + norm, silu_mul
    ("row_linears", "row_invariant_elementwise"),  # what the fusions left of sigmoid / silu
    ("fold_constants", "fold_constants"),  # before the direct calls: it reads op schemas
    ("compile", "call_kernels_directly"),
    ("compile", "flatten_attrs"),
    ("fuse_mixers", "fuse_recurrent_mixers"),  # matches direct kernel calls too
    ("fuse_moe_blocks", "fuse_moe_blocks"),  # matches direct kernel calls
    ("fuse_layers", "fuse_decoder_layers"),  # after both: it matches direct kernel calls
    ("fuse_rows_late", "fuse_leftover_rows"),  # what the block fusions above left
    ("identity", "drop_identity_ops"),  # last rewrite: no pattern misses a node it expects
    ("compile", "call_aten_directly"),  # after it: every pass above matches aten targets
    ("compile", "compile_model"),
)


@dataclass(frozen=True)
class Done:
    """What a transform did. `resources`: handlers its cached ops declared (cache/ sizes them);
    `program`: a callable that replaces the graph at run time (the compile stage)."""

    num_matches: int
    detail: str = ""
    bytes_saved: int = 0
    resources: tuple = ()
    program: Callable | None = None


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class TransformInfo:
    name: str
    stage: Stage
    num_matches: int
    skipped: bool = False
    detail: str = ""
    bytes_saved: int = 0


@dataclass(frozen=True)
class Transform:
    name: str
    stage: Stage
    fn: Callable[[fx.GraphModule, DeployContext], Done | Skipped]
    skip_if: Callable[[DeployContext], str | None] | None = None
    requires_match: bool = False


@dataclass
class PipelineResult:
    infos: list[TransformInfo]
    resources: list = field(default_factory=list)
    program: Callable | None = None  # None: call the GraphModule itself


class TransformError(RuntimeError):
    """A transform that must match found nothing, or the registry disagrees with PIPELINE."""


_REGISTRY: dict[str, Transform] = {}


def register(name: str, stage: Stage, *, skip_if: Callable[[DeployContext], str | None] | None
             = None, requires_match: bool = False):
    """`skip_if(ctx)` returns the reason to skip (or None to run); `requires_match`: a run that
    matches nothing is an error (the graph is not what the transform was written for)."""
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"transform {name!r} registered twice")
        _REGISTRY[name] = Transform(name, stage, fn, skip_if, requires_match)
        return fn

    return deco


def transforms() -> list[Transform]:
    """The registered transforms in run order (imports the pass modules)."""
    for module, _ in PIPELINE:
        importlib.import_module(f"specdeploy.deploy.passes.{module}")
    names = [name for _, name in PIPELINE]
    if set(names) != set(_REGISTRY) or len(names) != len(set(names)):
        raise TransformError(f"PIPELINE {sorted(names)} != registered {sorted(_REGISTRY)}")
    items = [_REGISTRY[n] for n in names]
    for a, b in zip(items, items[1:]):
        if b.stage < a.stage:
            raise TransformError(f"PIPELINE: {b.name} ({b.stage.name}) after {a.name} "
                                 f"({a.stage.name})")
    return items


def run_transform(t: Transform | str, gm: fx.GraphModule, ctx: DeployContext
                  ) -> tuple[TransformInfo, Done]:
    """One transform (or its name) under the contract; a skip returns an empty `Done`."""
    if isinstance(t, str):
        transforms()
        t = _REGISTRY[t]
    reason = "disabled" if t.name in ctx.disabled else (t.skip_if and t.skip_if(ctx))
    done = Skipped(reason) if reason else t.fn(gm, ctx)
    if isinstance(done, Skipped):
        return TransformInfo(t.name, t.stage, 0, True, done.reason), Done(0)
    if t.requires_match and done.num_matches == 0:
        raise TransformError(f"{t.name}: matched nothing in the exported graph")
    finalize(gm)
    return TransformInfo(t.name, t.stage, done.num_matches, False, done.detail,
                         done.bytes_saved), done


def run_pipeline(gm: fx.GraphModule, ctx: DeployContext) -> PipelineResult:
    items = transforms()
    unknown = set(ctx.disabled) - {t.name for t in items}
    if unknown:  # a misspelt name would silently disable nothing
        raise ValueError(f"disabled: unknown transforms {sorted(unknown)}; known: "
                         f"{', '.join(t.name for t in items)}")
    result = PipelineResult([])
    for t in items:
        info, done = run_transform(t, gm, ctx)
        result.infos.append(info)
        # NOTE: a later transform may declare a handler again (window_kv_pages moves a layer's
        # paged KV to the window group): the last declaration of a name wins
        names = {h.name for h in done.resources}
        result.resources[:] = [h for h in result.resources if h.name not in names]
        result.resources.extend(done.resources)
        if done.program is not None:
            result.program = done.program
    return result


def format_infos(infos: list[TransformInfo], indent: str = "  ") -> list[str]:
    """One line per transform, in run order: stage, name, matches or the skip and its reason."""
    lines = []
    for i, info in enumerate(infos):
        state = "skipped" if info.skipped else f"{info.num_matches} matches"
        extra = f"  [{info.detail}]" if info.detail else ""
        lines.append(f"{indent}{i:2d}. {info.stage.name:<11} {info.name:<26} {state}{extra}")
    return lines
