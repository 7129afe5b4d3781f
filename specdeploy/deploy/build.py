"""`build`: the one way to turn a checkpoint into a deployment (LLM, CLI, server, benches, tests).

    checkpoint ─► load plain model ─► [drafter program, deploy/spec.py]
               ─► export + run_pipeline (target, then drafter: the same `_transform`)
               ─► one cache plan for both ─► allocate ─► GraphDeployed | SpecDeployed

`backend="eager"` returns the uncached reference runner instead (deploy/eager.py).
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch
from torch import fx, nn

from specdeploy.cache.allocate import allocate
from specdeploy.cache.plan import default_page_size, plan_cache
from specdeploy.checkpoint import CheckpointError
from specdeploy.deploy.build_policy import (
    defer_blocks,
    draft_quantize_auto,
    kv_dtype,
    per_rank_loading,
)
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.deferred import materialize_deferred
from specdeploy.deploy.eager import EagerDeployed, eager_layout
from specdeploy.deploy.export import export_model
from specdeploy.deploy.graph import placeholders
from specdeploy.deploy.options import BuildOptions
from specdeploy.deploy.pipeline import PipelineResult, run_pipeline
from specdeploy.deploy.runner import GraphDeployed
from specdeploy.deploy.spec import SpecDeployed, prepare_drafter, resource_prefix, suffix_corpus

Deployed = GraphDeployed | SpecDeployed | EagerDeployed


def build(model_path: str | os.PathLike | None = None, options: BuildOptions | None = None, *,
          model: nn.Module | None = None, **overrides) -> Deployed:
    """Load (unless `model`, a plain model, is given), export, transform and allocate.
    `model_path=None` is the embedded default model. Options come as a `BuildOptions`, as
    keyword overrides of it, or both."""
    opts = dataclasses.replace(options or BuildOptions(), **overrides)
    if opts.spec is not None and opts.spec.method == "auto":
        if model is not None:
            raise ValueError("spec: method='auto' is chosen from the checkpoint; build from a "
                             "path, or give the method")
        from specdeploy.spec_auto import resolve_auto

        opts = dataclasses.replace(opts, spec=resolve_auto(opts.spec, model_path,
                                                           opts.device.type))
    if opts.backend == "eager":
        return _eager(model_path, opts)
    from specdeploy.checkpoint.prequant import prequant_kv_dtype
    from specdeploy.loading import load_model, resolve_dtype

    t0 = time.perf_counter()
    spec = opts.spec
    lazy = per_rank_loading(opts, model, model_path)
    if model is None:
        own_mtp = (spec is not None and spec.method == "mtp" and spec.draft_model is None
                   and _declares_mtp(model_path))
        model = load_model(model_path, dtype=resolve_dtype(opts.dtype, device=opts.device),
                           with_mtp=own_mtp, progress=opts.progress, lazy=lazy,
                           defer_blocks=defer_blocks(opts))
        if own_mtp:
            _own_mtp_draft_vocab(model, model_path, lazy)
    dtype = resolve_dtype(opts.dtype, device=opts.device)
    if spec is not None and spec.draft_quantize == "auto":
        spec = dataclasses.replace(spec, draft_quantize=draft_quantize_auto(opts, dtype,
                                                                       model_path))
    if lazy is not None and spec is not None and spec.draft_dtype and \
            resolve_dtype(spec.draft_dtype) != dtype:
        lazy.materialize_module(model)  # the drafter casts (copies) target weights it borrows
    loaded = _weight_bytes(model) if lazy is None else 0
    model = model.to(opts.device)
    from specdeploy.deploy.vlm import has_vision

    hf_config = getattr(model, "hf_config", None) or {}
    if opts.mmproj is not None:  # a text GGUF + llama.cpp's mmproj: the VLM's config
        from specdeploy.deploy.vlm import gguf_vlm_config

        hf_config = model.hf_config = gguf_vlm_config(hf_config, model_path, opts.mmproj)
    vision = opts.vision is not False and has_vision(hf_config)
    prefix_caching = opts.enable_prefix_caching
    if opts.vision and not vision:
        raise ValueError("vision: this checkpoint has no vision tower")
    # NOTE: under tensor parallelism rank 0 alone runs the tower and the embedding (eagerly,
    # whole) and sends each step's input embeddings with the step (distributed/runtime.py);
    # every rank's graph takes embeddings
    tower_here = vision and (opts.dist is None or opts.dist.rank == 0)
    embed = model.model.embed_tokens if tower_here else None
    if embed is not None and lazy is not None:
        lazy.materialize_module(embed)
    rank_gib = _rank_budget(opts)  # under TP: the GiB the ranks agreed on (utilization spent)
    util = opts.gpu_memory_utilization if rank_gib == opts.max_cache_gib else None
    common = dict(page_size=opts.page_size, max_batch_size=opts.max_batch_size,
                  max_seq_len=opts.max_seq_len, max_cache_gib=rank_gib,
                  compile=opts.compile, disabled=opts.disabled, device=opts.device,
                  kernels=opts.kernels, dist=opts.dist, lazy=lazy)
    drafter = None if spec is None else prepare_drafter(model, spec, dtype, opts.quantize,
                                                        opts.device)
    corpus = None if spec is None else suffix_corpus(model, spec)
    target_ctx = DeployContext(
        model, dtype=dtype, quantize=opts.quantize,
        kv_cache_dtype=prequant_kv_dtype(model) or kv_dtype(opts, dtype, model),
        capture_layers=drafter.capture_layers if drafter else (),
        spec_steps=spec.max_draft_tokens + 1 if spec else 0,
        prefix_caching=prefix_caching,
        **({} if opts.quant_exclude is None else {"quant_exclude": opts.quant_exclude}),
        **common)
    programs = [(model, target_ctx, None)]
    # Gemma 3: 1-D positions, bidirectional image blocks (deploy/vlm.py Gemma3VisionDeployed)
    gemma = vision and _is_gemma3(hf_config)
    if gemma:
        model.image_blocks = True
    if vision:  # the graph takes embeddings (image features merged in by deploy/vlm.py)
        from specdeploy.deploy.vlm import TextFromEmbeds

        width = getattr(model, "embeds_width", model.cfg.hidden_size)  # (DeepStack: wider)
        programs = [(TextFromEmbeds(model), target_ctx, width)]
    # one drafter program per MTP group, each with its own KV (all in the one cache plan)
    for g, step in enumerate(drafter.steps if drafter is not None else ()):
        draft_ctx = DeployContext(
            step, dtype=drafter.dtype, quantize=drafter.quantize,
            resource_prefix=resource_prefix(g), **common,
            **({} if drafter.quant_exclude is None else {"quant_exclude": drafter.quant_exclude}))
        programs.append((step, draft_ctx, model.cfg.hidden_size))
    mrope = vision and not gemma
    transformed = [(_transform(m, ctx, hidden, mrope), ctx) for m, ctx, hidden in programs]
    for (gm, _), _ in transformed:  # NOTE: no deferred zero is ever computed with
        materialize_deferred(gm, model)
    resources = [h for (_, res), _ in transformed for h in res.resources]
    # NOTE: no transform reads ctx.page_size; the page size is chosen from what the cached ops
    # declared (their scan chunks), then recorded in each program's context
    page_size = opts.page_size or default_page_size(resources)
    plan = plan_cache(resources, page_size, opts.max_batch_size, opts.max_seq_len,
                      common["max_cache_gib"], target_ctx.device,
                      checkpoint_every=opts.checkpoint_every, gpu_memory_utilization=util)
    vocab = model.cfg.vocab_size
    deployed = []
    for (gm, res), ctx in transformed:
        allocate(gm, res.resources, plan, ctx.device, plain=not ctx.compile)
        # NOTE: the graph owns the weights now; holding the plain model would pin the fp copies
        # of weights that quantization replaced.
        ctx = dataclasses.replace(ctx, model=None, lazy=None, page_size=page_size)
        deployed.append(GraphDeployed(gm, ctx, res.infos, plan,
                                      hf_config, vocab, res.resources, res.program,
                                      time.perf_counter() - t0, prefix_caching))
        deployed[-1].mrope = mrope
    _return_freed_memory()
    out = deployed[0] if spec is None else SpecDeployed(
        deployed[0], deployed[1:], drafter.drafter if drafter else None, spec)
    if spec is not None:
        out.suffix_corpus = corpus
    # what this process held in weights while loading (per rank under TP: distributed/)
    out.load_stats = lazy.stats() if lazy is not None else {
        "load_peak_bytes": loaded, "load_resident_bytes": loaded, "load_read_bytes": loaded}
    return _with_vision(out, model_path, embed, dtype, hf_config, opts) if tower_here else out


def _weight_bytes(model: nn.Module) -> int:
    seen = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _return_freed_memory() -> None:
    """Hand the heap the build freed (export, loading buffers) back to the OS (glibc only):
    otherwise it stays resident though nothing uses it (~50 MB for the default model)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: nothing to do


def _rank_budget(opts: BuildOptions) -> float | None:
    """Ranks must plan the same pages (rank 0's page tables address every rank's cache): without
    an explicit budget they agree on the smallest free memory among them."""
    d = opts.dist
    if opts.max_cache_gib is not None or d is None or d.world_size == 1:
        return opts.max_cache_gib
    import torch.distributed as dist

    if not dist.is_initialized():
        return opts.max_cache_gib  # one rank built alone (tests, inspection): its own budget
    from specdeploy.cache.plan import GIB, cache_budget
    from specdeploy.distributed.groups import agree_min

    util = opts.gpu_memory_utilization  # NOTE: TP ranks run on the CPU without it (as before)
    return agree_min(cache_budget(opts.device if util else torch.device("cpu"), None, util)[0]
                     ) / GIB


def describe(model_path=None, options: BuildOptions | None = None, **overrides) -> str:
    """The ordered transform list with match counts and skip reasons, then the cache plan."""
    return build(model_path, options, **overrides).report()


def name_inputs(gm: fx.GraphModule) -> None:
    """Exported placeholders are named after forward's parameters; make that explicit."""
    for p, want in zip(placeholders(gm), ("input_ids", "position_ids", "hidden")):
        if p.name != want:
            p.name = want
            p.target = want
    gm.recompile()


def _transform(module: nn.Module, ctx: DeployContext, hidden_size: int | None,
               mrope: bool = False) -> tuple[fx.GraphModule, PipelineResult]:
    """Export + the pipeline: the one path every program (target or drafter) takes."""
    max_tokens = max(2, ctx.max_seq_len * ctx.max_batch_size)
    gm = export_model(module, max_tokens=max_tokens, hidden_size=hidden_size, dtype=ctx.dtype,
                      mrope=mrope, keep_hints=ctx.dist is not None and ctx.dist.world_size > 1)
    name_inputs(gm)
    return gm, run_pipeline(gm, ctx)


def _with_vision(inner, model_path, embed: nn.Module, dtype: torch.dtype, hf_config: dict,
                 opts: BuildOptions):
    """The eager vision tower around the deployed language model (deploy/vlm.py): from the
    checkpoint directory, or from `opts.mmproj` (a GGUF target's)."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.deploy.vlm import VisionLanguageDeployed, load_vision, tower_dtype
    from specdeploy.vision.image import ImageProcessor
    from specdeploy.vision.video import RELEASED, VideoProcessor

    if model_path is None:
        raise ValueError("vision: a vision-language deployment needs its checkpoint directory")
    if _is_gemma3(hf_config):
        return _with_gemma3_vision(inner, model_path, embed, dtype, hf_config, opts)
    reader = open_checkpoint(opts.mmproj if opts.mmproj is not None else model_path)
    visual = load_vision(reader, tower_dtype(reader, opts.mm_encoder_dtype, dtype,
                                             inner.device)).to(inner.device)
    processor = (ImageProcessor.from_config(reader.config["preprocessor"])
                 if opts.mmproj is not None else ImageProcessor.from_dir(model_path))
    video = (VideoProcessor.like(processor, RELEASED) if opts.mmproj is not None
             else VideoProcessor.from_dir(model_path, processor))
    processor = processor.with_kwargs(opts.mm_processor_kwargs)
    video = video.with_kwargs(opts.mm_processor_kwargs)
    out = VisionLanguageDeployed(inner, visual, embed, hf_config, processor.max_pixels)
    out.processor, out.video_processor = processor, video
    out.mm_limits = dict(opts.limit_mm_per_prompt or {})
    return out


def _is_gemma3(hf_config: dict) -> bool:
    return "Gemma3ForConditionalGeneration" in (hf_config.get("architectures") or ())


def _with_gemma3_vision(inner, model_path, embed: nn.Module, dtype: torch.dtype,
                        hf_config: dict, opts: BuildOptions):
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.deploy.vlm import Gemma3VisionDeployed, ScaledEmbedding, tower_dtype
    from specdeploy.models.gemma3_vision import load_vision
    from specdeploy.vision.gemma3 import Gemma3ImageProcessor

    reader = open_checkpoint(opts.mmproj if opts.mmproj is not None else model_path)
    visual = load_vision(reader, tower_dtype(reader, opts.mm_encoder_dtype, dtype,
                                             inner.device)).to(inner.device)
    processor = (Gemma3ImageProcessor.from_config(reader.config["preprocessor"])
                 if opts.mmproj is not None else Gemma3ImageProcessor.from_dir(model_path))
    processor = processor.with_kwargs(opts.mm_processor_kwargs)
    scaled = ScaledEmbedding(embed, _embed_scale(hf_config))
    out = Gemma3VisionDeployed(inner, visual, scaled, hf_config, processor.max_pixels)
    out.processor, out.video_processor = processor, None
    limits = dict(opts.limit_mm_per_prompt or {})
    if limits.get("video"):
        raise ValueError("limit_mm_per_prompt: Gemma 3 takes no videos")
    out.mm_limits = limits
    return out


def _embed_scale(hf_config: dict) -> dict:
    h = (hf_config.get("text_config") or hf_config)["hidden_size"]
    root = torch.tensor(h ** 0.5, dtype=torch.float32)
    return {dt: root.to(dt).item() for dt in (torch.float32, torch.bfloat16, torch.float16)}


def _declares_mtp(path) -> bool:
    """Whether the checkpoint's config declares MTP layers (then missing mtp.* weights are an
    error naming them); otherwise a head shipped for the target may serve (drafters_registry)."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.spec_auto import declares_mtp

    return declares_mtp(open_checkpoint(default_model_path() if path is None else path).config)


def _eager(model_path, opts: BuildOptions) -> EagerDeployed:
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path
    from specdeploy.loading import load_model_from_reader

    reader = open_checkpoint(default_model_path() if model_path is None else model_path)
    model = load_model_from_reader(reader, opts.dtype, progress=opts.progress)
    cfg = reader.config.get("text_config", reader.config)
    vocab = int(cfg.get("vocab_size") or model.get_output_embeddings().out_features)
    from specdeploy.cache.plan import budget_gib

    layout = eager_layout(cfg, opts.max_batch_size, opts.max_seq_len, opts.page_size or 16,
                          budget_gib(opts.device, opts.max_cache_gib, opts.gpu_memory_utilization),
                          next(model.parameters()).element_size())
    return EagerDeployed(model, vocab, opts.max_seq_len, reader.config, layout)


DRAFT_VOCAB_FILE = "mtp_draft_vocab.json"


def _own_mtp_draft_vocab(model: nn.Module, model_path, lazy=None) -> None:
    """A checkpoint directory may ship `mtp_draft_vocab.json` ({"ids": [...]}, target ids): its
    own MTP head then drafts over those tokens only (models/drafters `set_draft_vocab`)."""
    import json
    from pathlib import Path

    f = Path(model_path) / DRAFT_VOCAB_FILE
    if not f.is_file() or getattr(model, "mtp", None) is None:
        return
    try:
        ids = torch.tensor(json.loads(f.read_text())["ids"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: expected {{\"ids\": [token ids]}} ({e})") from None
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= model.lm_head.weight.shape[0]:
        raise CheckpointError(f"{f}: ids must be a non-empty list of token ids in "
                              f"[0, {model.lm_head.weight.shape[0]})")
    if lazy is not None:  # its rows are copied now, before the shard transform runs
        lazy.materialize_module(model.lm_head)
    from specdeploy.deploy.deferred import filled
    from specdeploy.deploy.spec import lm_head_weights
    from specdeploy.ops.ggml_tiled import TILE

    with filled(model, lm_head_weights(model)):  # a deferred head: its values for the copy
        model.mtp.set_draft_vocab(ids, multiple=TILE)

