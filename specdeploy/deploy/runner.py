"""`GraphDeployed`: a checkpoint exported, transformed, caches allocated; one step per call."""
from __future__ import annotations

import time

import torch
from torch import fx

from specdeploy.cache.handlers import PagedKV
from specdeploy.cache.metadata import BatchMetadata, kv_slot_mapping
from specdeploy.cache.plan import CachePlan, plan_cache
from specdeploy.deploy.base import CacheLayout, StepOutput
from specdeploy.deploy.export import export_model
from specdeploy.deploy.graph import placeholders
from specdeploy.deploy.pipeline import DeployContext, TransformInfo, run_pipeline


class GraphDeployed:
    """Implements the `DeployedModel` protocol over a transformed GraphModule."""

    def __init__(self, gm: fx.GraphModule, ctx: DeployContext, infos: list[TransformInfo],
                 plan: CachePlan, hf_config: dict, vocab_size: int):
        self.gm = gm
        self.ctx = ctx
        self.infos = infos
        self.plan = plan
        self.hf_config = hf_config
        self.vocab_size = vocab_size
        self.max_seq_len = ctx.max_seq_len
        self.layout = CacheLayout(plan.page_size, plan.num_pages, plan.num_slots,
                                  dict(plan.bytes_by_handler))
        # NOTE: not `compiled or gm`: a compiled GraphModule has no truth value (len() raises)
        self._fn = gm if ctx.compiled is None else ctx.compiled
        self._input_names = [p.name for p in placeholders(gm)]

    def _feed(self, meta: BatchMetadata, hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
        dev = self.ctx.device
        feed = {
            "hidden": None if hidden is None else hidden[None].to(dev),
            "input_ids": meta.input_ids[None].to(dev),
            "position_ids": meta.position_ids[None].to(dev),
            "logits_idx": meta.logits_idx.to(dev), "cu_seqlens": meta.cu_seqlens.to(dev),
            "cu_seqlens_host": meta.cu_seqlens, "cache_lens": meta.cache_lens.to(dev),
            "cache_lens_host": meta.cache_lens, "page_table": meta.page_table.to(dev),
            "slot_idx": meta.slot_idx.to(dev), "seg_kind_host": meta.seg_kind,
        }
        if "slot_mapping" in self._input_names:
            feed["slot_mapping"] = kv_slot_mapping(meta, self.layout.page_size).to(dev)
        return [feed[n] for n in self._input_names]

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata, hidden: torch.Tensor | None = None) -> StepOutput:
        """One step. `hidden` [T, H] feeds a drafter graph (the third exported input)."""
        out = self._fn(*self._feed(meta, hidden))
        if not isinstance(out, (tuple, list)):
            out = (out,)
        hidden = out[1][0] if len(out) > 1 else None
        return StepOutput(logits=out[0][0].float(), hidden=hidden)

    def report(self) -> str:
        lines = ["transforms (in order):"]
        for i, info in enumerate(self.infos):
            state = "skipped" if info.skipped else f"{info.num_matches} matches"
            extra = f"  [{info.detail}]" if info.detail else ""
            lines.append(f"  {i:2d}. {info.stage.name:<11} {info.name:<26} {state}{extra}")
        lines.append(self.plan.summary())
        return "\n".join(lines)


def _input_name_fix(gm: fx.GraphModule) -> None:
    """Exported placeholders are named after forward's parameters; make that explicit."""
    for p, want in zip(placeholders(gm), ("input_ids", "position_ids", "hidden")):
        if p.name != want:
            p.name = want
            p.target = want
    gm.recompile()


def allocate(gm: fx.GraphModule, ctx: DeployContext, plan: CachePlan | None = None) -> CachePlan:
    """Plan (unless given) and register the real cache tensors as the graph's buffers."""
    if plan is None:
        plan = plan_cache(ctx.resources, ctx.page_size, ctx.max_batch_size, ctx.max_seq_len,
                          ctx.max_cache_gib, ctx.device)
    for h in ctx.resources:
        if isinstance(h, PagedKV):
            k, v = h.allocate(plan.num_pages, plan.page_size, ctx.device)
            gm.register_buffer(f"{h.name}_k", k, persistent=False)
            gm.register_buffer(f"{h.name}_v", v, persistent=False)
        else:
            gm.register_buffer(h.name, h.allocate(plan.num_slots, ctx.device), persistent=False)
    return plan


def transform_module(model: torch.nn.Module, hidden_size: int | None = None, **ctx_kwargs):
    """Export + transform (no allocation yet): returns (gm, ctx, infos)."""
    ctx = DeployContext(model=model, **ctx_kwargs)
    max_tokens = max(2, ctx.max_seq_len * ctx.max_batch_size)
    gm = export_model(model, max_tokens=max_tokens, hidden_size=hidden_size, dtype=ctx.dtype)
    _input_name_fix(gm)
    infos = run_pipeline(gm, ctx)
    # NOTE: the graph owns the weights now; holding the plain model would pin the fp copies of
    # weights that quantization replaced.
    ctx.model = None
    return gm, ctx, infos


def deploy_module(model: torch.nn.Module, hf_config: dict, vocab_size: int, **ctx_kwargs):
    """Export + transform + allocate an already-loaded plain model."""
    t0 = time.perf_counter()
    gm, ctx, infos = transform_module(model, **ctx_kwargs)
    plan = allocate(gm, ctx)
    ctx.export_seconds = time.perf_counter() - t0
    return GraphDeployed(gm, ctx, infos, plan, hf_config, vocab_size)


def _declares_mtp(path) -> bool:
    """Whether the checkpoint's config declares MTP layers (then missing mtp.* weights are an
    error naming them); otherwise a head shipped for the target may serve (drafters_registry)."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path

    cfg = open_checkpoint(default_model_path() if path is None else path).config
    cfg = cfg.get("text_config", cfg)
    return any(int(cfg.get(k) or 0) > 0
               for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))


def build_deployed(path=None, *, dtype="auto", max_batch_size: int = 16, max_seq_len: int = 2048,
                   page_size: int = 16, max_cache_gib: float | None = None, spec=None,
                   compile: bool = False, quantize: str | None = None, kernels: str = "exact",
                   quant_exclude: tuple[str, ...] | None = None, model=None,
                   disabled: frozenset[str] = frozenset()):
    """Load (unless `model` is given), export, transform and allocate. `quantize="int8"` makes
    linear weights int8 (weight-only); `quant_exclude` replaces the default exclusion patterns
    (see deploy/passes/quantize.py); `disabled` names transforms to skip (A/B runs); `kernels`
    picks the GGUF block kernels ("exact" fp32 or "fast" integer dot, deploy/passes/ggml_linears).
    """
    from specdeploy.loading import load_model, resolve_dtype

    if spec is not None:
        from specdeploy.deploy.spec import build_spec_deployed

        if quant_exclude is not None:
            raise ValueError("quant_exclude: not supported with spec yet (defaults apply)")

        if model is None:
            own_mtp = spec.method == "mtp" and spec.draft_model is None and _declares_mtp(path)
            model = load_model(path, dtype=dtype, with_mtp=own_mtp)
        return build_spec_deployed(
            model, spec, dtype=resolve_dtype(dtype), max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, page_size=page_size, max_cache_gib=max_cache_gib,
            compile=compile, quantize=quantize, disabled=disabled, kernels=kernels)
    if model is None:
        model = load_model(path, dtype=dtype)
    hf_config = getattr(model, "hf_config", None) or {}
    vocab = model.cfg.vocab_size
    return deploy_module(
        model, hf_config, vocab, page_size=page_size, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len, max_cache_gib=max_cache_gib, dtype=resolve_dtype(dtype),
        compile=compile, quantize=quantize, disabled=frozenset(disabled), kernels=kernels,
        **({} if quant_exclude is None else {"quant_exclude": tuple(quant_exclude)}),
    )
