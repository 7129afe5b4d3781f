"""One-model speculative deployment: the target program plus its drafter (EAGLE-3 or MTP), or
the target alone for n-gram lookup drafts (`method="ngram"`: spec-state resources, no capture).

The target graph gets two extra transforms' worth of behaviour: hidden-state capture (an extra
output) and spec-state resources on every recurrent cached op (per-token states of a verify step).
The drafter — under the name `eagle_drafter` whatever its kind, so target exclusions never match
it — is exported and transformed by the same pipeline into its own graph with its own paged KV
that shares the target's page tables. One cache plan covers both.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from specdeploy.cache.handlers import State
from specdeploy.cache.metadata import BatchMetadata
from specdeploy.cache.plan import plan_cache
from specdeploy.checkpoint import CheckpointError
from specdeploy.config import SpecConfig
from specdeploy.deploy.base import CacheLayout, StepOutput
from specdeploy.deploy.passes.capture_hidden import FINAL
from specdeploy.deploy.pipeline import TARGET_QUANT_EXCLUDE
from specdeploy.deploy.runner import GraphDeployed, allocate, transform_module


class DraftStep(nn.Module):
    """The drafter program that gets exported: (ids, positions, hidden[H]) → (logits, hidden).

    Shared embedding / LM head are registered here (same Parameter objects as the target's), so
    export sees them as parameters rather than constants.
    """

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.eagle_drafter = drafter
        shared = getattr(drafter, "_shared", None) or ()
        for name, mod in zip(("embed_tokens", "lm_head"), shared):
            self.add_module(f"shared_{name}", mod)
        emb = drafter.__dict__.get("_shared_embed")
        if emb is not None:
            self.add_module("shared_embed_tokens", emb)

    def forward(self, input_ids, position_ids, hidden):
        # NOTE: the embedding is the target's (its dtype); a drafter may run at another one
        embeds = self.eagle_drafter.embed(input_ids).to(hidden.dtype)
        out = self.eagle_drafter(hidden, embeds, position_ids)
        return out.logits, out.hidden


def _embedding(model: nn.Module) -> nn.Embedding:
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


def _num_layers(model: nn.Module) -> int:
    return len(model.model.layers)


def load_drafter(model: nn.Module, spec: SpecConfig):
    """Returns (drafter module, capture layers, d2t or None). With no `draft_model`, a head
    shipped for this target (see drafters_registry) is used when the target has none."""
    from specdeploy.drafters_registry import shipped_drafter

    draft_model = spec.draft_model
    if spec.method == "mtp":
        drafter = getattr(model, "mtp", None)
        if drafter is not None and draft_model is None:
            del model.mtp  # NOTE: keeps mtp.* out of the target graph (under eagle_drafter)
            return drafter, (FINAL,), None
        draft_model = draft_model or shipped_drafter(model, "mtp")
        if draft_model is None:
            raise CheckpointError("method='mtp': the target has no MTP head (no mtp.* weights) "
                                  "and no draft_model was given; train one with "
                                  "`specdeploy train-drafter --method mtp`")
        from specdeploy.models.drafters.mtp_head import load_mtp_head

        head = load_mtp_head(draft_model, model)
        return head, (FINAL,), head.d2t
    from specdeploy.models.drafters.eagle3 import load_eagle3

    draft_model = draft_model or shipped_drafter(model, "eagle3")
    if draft_model is None:
        raise ValueError("draft_model: method='eagle3' needs an EAGLE-3 drafter directory")
    drafter = load_eagle3(draft_model, target_cfg=model.cfg, embed_tokens=_embedding(model))
    n = _num_layers(model)
    # NOTE: checkpoints (vLLM / EAGLE / SpecForge) name the layer whose *input* is captured; our
    # capture ids name the layer whose *output* is (AutoDeploy's {1, L/2-1, L-4}): shift by one.
    aux = drafter.cfg.aux_layer_ids or (2, n // 2, n - 3)
    layers = spec.capture_layers or tuple(i - 1 for i in aux)
    layers = tuple(min(max(i, 0), n - 1) for i in layers)
    return drafter, layers, drafter.d2t


def _own_output_head(drafter: nn.Module, dtype: torch.dtype) -> None:
    """A drafter at another dtype than the target gets its own copy of a borrowed LM head (an
    MTP head drafting over the full vocab reads the target's); the borrowed embedding stays
    shared (a lookup reads one row; DraftStep casts it)."""
    shared = getattr(drafter, "_shared", None)
    if shared is None or getattr(drafter, "draft_head", None) is not None:
        return
    embed, head = shared
    drafter._shared = (embed, copy.deepcopy(head).to(dtype).requires_grad_(False))


class SpecDeployed:
    """Target + drafter programs over one cache plan (no drafter for method="ngram"). See
    engine/speculative.py for the step."""

    def __init__(self, target: GraphDeployed, draft: GraphDeployed | None,
                 drafter: nn.Module | None, spec: SpecConfig, d2t: torch.Tensor | None,
                 method: str):
        self.target, self.draft, self.drafter, self.spec = target, draft, drafter, spec
        self.num_draft_tokens = spec.num_draft_tokens  # the drafter's chain length
        self.d2t = d2t
        self.method = method
        self.draft_dtype = None if drafter is None else next(drafter.parameters()).dtype
        self.vocab_size = target.vocab_size
        self.max_seq_len = target.max_seq_len
        self.hf_config = target.hf_config
        self.layout = target.layout
        self.device = target.ctx.device
        self._spec_pairs = [
            (h.name, h.name.replace("_state", "_spec_state"))
            for h in target.ctx.resources if isinstance(h, State)
        ]

    def forward(self, meta: BatchMetadata) -> StepOutput:
        return self.target.forward(meta)

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        """Target features → the drafter's hidden input (EAGLE-3 fuses layers with `fc`)."""
        fc = getattr(self.drafter, "fc", None)
        if fc is not None and captured.shape[-1] == fc.in_features:
            return fc(captured.to(fc.weight.dtype))
        return captured.to(self.draft_dtype)

    def draft_forward(self, meta: BatchMetadata, hidden: torch.Tensor) -> StepOutput:
        """Drafter step; returns logits over the *target* vocabulary order only when d2t is None
        (use `to_target` on argmaxes otherwise) and the hidden rows at `meta.logits_idx`."""
        out = self.draft.forward(meta, hidden)
        return StepOutput(out.logits, out.hidden[meta.logits_idx.to(out.hidden.device)])

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocab probabilities [N, Vd] → target vocab [N, V] (zero outside Vd)."""
        if self.d2t is None:
            return draft_probs
        ids = torch.arange(draft_probs.shape[-1], device=draft_probs.device)
        out = draft_probs.new_zeros(draft_probs.shape[0], self.vocab_size)
        return out.index_copy_(1, self.to_target(ids), draft_probs)

    @torch.inference_mode()
    def commit(self, slots: torch.Tensor, accepted_idx: torch.Tensor) -> None:
        """Promote spec-state entry `accepted_idx[s]` (tokens kept - 1) into each state slot."""
        for main, spec in self._spec_pairs:
            state, per_token = getattr(self.target.gm, main), getattr(self.target.gm, spec)
            state[slots] = per_token[slots, accepted_idx]

    def report(self) -> str:
        if self.draft is None:
            return "\n".join(["target:", self.target.report(), "drafter: none (n-gram lookup)"])
        lines = ["target:", self.target.report(), "drafter (eagle_drafter):"]
        lines += [f"  {i.stage.name:<11} {i.name:<26} "
                  f"{'skipped' if i.skipped else str(i.num_matches) + ' matches'}"
                  for i in self.draft.infos]
        return "\n".join(lines)


def build_spec_deployed(model: nn.Module, spec: SpecConfig, *, dtype: torch.dtype,
                        max_batch_size: int, max_seq_len: int, page_size: int,
                        max_cache_gib: float | None, compile: bool = False,
                        quantize: str | None = None,
                        disabled: frozenset[str] = frozenset(),
                        kernels: str = "exact") -> SpecDeployed:
    from specdeploy.loading import resolve_dtype

    t0 = time.perf_counter()
    if spec.method == "ngram":
        return _build_lookup_only(model, spec, t0, page_size=page_size,
                                  max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                  max_cache_gib=max_cache_gib, dtype=dtype, compile=compile,
                                  quantize=quantize, disabled=frozenset(disabled),
                                  kernels=kernels)
    drafter, layers, d2t = load_drafter(model, spec)
    draft_dtype = resolve_dtype(spec.draft_dtype) if spec.draft_dtype else dtype
    drafter = drafter.to(draft_dtype)
    if draft_dtype != dtype:
        _own_output_head(drafter, draft_dtype)
    common = dict(page_size=page_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                  max_cache_gib=max_cache_gib, dtype=dtype, compile=compile, quantize=quantize,
                  disabled=frozenset(disabled), kernels=kernels)
    draft_common = {**common, "dtype": draft_dtype,
                    "quantize": spec.draft_quantize or quantize}
    if spec.draft_quantize:  # NOTE: the default exclusions keep drafters unquantized
        draft_common["quant_exclude"] = TARGET_QUANT_EXCLUDE
    gm_t, ctx_t, infos_t = transform_module(
        model, capture_layers=layers, spec_steps=spec.max_draft_tokens + 1, **common)
    hidden_size = model.cfg.hidden_size
    gm_d, ctx_d, infos_d = transform_module(
        DraftStep(drafter), hidden_size=hidden_size, resource_prefix="draft_", **draft_common)
    plan = plan_cache(ctx_t.resources + ctx_d.resources, page_size, max_batch_size, max_seq_len,
                      max_cache_gib, ctx_t.device)
    allocate(gm_t, ctx_t, plan)
    allocate(gm_d, ctx_d, plan)
    draft = GraphDeployed(gm_d, ctx_d, infos_d, plan, getattr(model, "hf_config", {}) or {},
                          model.cfg.vocab_size)
    target = _target_deployed(model, gm_t, ctx_t, infos_t, plan, t0)
    return SpecDeployed(target, draft, drafter, spec, d2t, spec.method)


def _build_lookup_only(model: nn.Module, spec: SpecConfig, t0: float, **common) -> SpecDeployed:
    """The target with spec-state resources and nothing captured: drafts come from lookup."""
    gm, ctx, infos = transform_module(model, spec_steps=spec.max_draft_tokens + 1, **common)
    plan = allocate(gm, ctx)
    return SpecDeployed(_target_deployed(model, gm, ctx, infos, plan, t0), None, None, spec,
                        None, spec.method)


def _target_deployed(model: nn.Module, gm, ctx, infos, plan, t0: float) -> GraphDeployed:
    target = GraphDeployed(gm, ctx, infos, plan, getattr(model, "hf_config", {}) or {},
                           model.cfg.vocab_size)
    target.layout = CacheLayout(plan.page_size, plan.num_pages, plan.num_slots,
                                dict(plan.bytes_by_handler))
    ctx.export_seconds = time.perf_counter() - t0
    return target
