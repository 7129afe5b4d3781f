"""`GraphDeployed`: the runtime object of one transformed program — feeds a step's metadata to the
graph (or its compiled program) and returns the logits and captured hidden rows."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from specdeploy.cache.handlers import Checkpoint, SpecState, State
from specdeploy.cache.metadata import BatchMetadata, kv_slot_mapping
from specdeploy.cache.plan import CachePlan
from specdeploy.deploy.base import CacheLayout, StepOutput
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import placeholders
from specdeploy.deploy.pipeline import TransformInfo, format_infos


class GraphDeployed:
    """Implements the `DeployedModel` protocol over a transformed GraphModule. `ctx` is the
    context it was built with, minus the plain model."""

    def __init__(self, gm: fx.GraphModule, ctx: DeployContext, infos: list[TransformInfo],
                 plan: CachePlan, hf_config: dict, vocab_size: int, resources: list = (),
                 program: Callable | None = None, export_seconds: float = 0.0,
                 prefix_caching: bool = False):
        self.gm = gm
        self.ctx = ctx
        self.infos = infos
        self.plan = plan
        self.resources = list(resources)
        self.hf_config = hf_config
        self.vocab_size = vocab_size
        self.max_seq_len = ctx.max_seq_len
        self.device = ctx.device
        self.export_seconds = export_seconds
        self.layout = CacheLayout(
            plan.page_size, plan.num_pages, plan.num_slots, dict(plan.bytes_by_handler),
            prefix_caching, any(isinstance(h, State) for h in resources),
            plan.num_checkpoints, plan.checkpoint_every, plan.bytes_by_kind.get("checkpoint", 0))
        spec_of = {h.shadows: h.name for h in resources if isinstance(h, SpecState)}
        # (state, its spec state or None, its checkpoint pool) buffer names
        self._ckpt = [(h.of, spec_of.get(h.of), h.name) for h in resources
                      if isinstance(h, Checkpoint)]
        # NOTE: not `program or gm`: a compiled GraphModule has no truth value (len() raises)
        self._fn = gm if program is None else program
        self._input_names = [p.name for p in placeholders(gm)]

    def _feed(self, meta: BatchMetadata, hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
        dev = self.device
        feed = {
            "hidden": None if hidden is None else hidden[None].to(dev),
            "input_ids": meta.input_ids[None].to(dev),
            "position_ids": meta.position_ids[None].to(dev),
            "logits_idx": meta.logits_idx.to(dev), "cu_seqlens": meta.cu_seqlens.to(dev),
            "cu_seqlens_host": meta.cu_seqlens, "cache_lens": meta.cache_lens.to(dev),
            "cache_lens_host": meta.cache_lens, "page_table": meta.page_table.to(dev),
            "slot_idx": meta.slot_idx.to(dev), "seg_kind_host": meta.seg_kind,
            "ckpt_tokens_host": meta.ckpt_tokens, "ckpt_slots": meta.ckpt_slots.to(dev),
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

    @torch.inference_mode()
    def restore_states(self, slots: torch.Tensor, ckpts: torch.Tensor) -> None:
        """Prefix hits: every recurrent state slot `slots[i]` <- checkpoint `ckpts[i]`."""
        for state, _, pool in self._ckpt:
            getattr(self.gm, state)[slots] = getattr(self.gm, pool)[ckpts]

    @torch.inference_mode()
    def checkpoint_spec(self, ckpts: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor
                        ) -> None:
        """Checkpoint `ckpts[i]` <- the verify step's state after token `idx[i]` of `slots[i]`
        (called for committed tokens only, so a rejected draft never reaches the cache)."""
        for _, spec, pool in self._ckpt:
            getattr(self.gm, pool)[ckpts] = getattr(self.gm, spec)[slots, idx]

    def report(self) -> str:
        return "\n".join(["transforms (in order):", *format_infos(self.infos),
                          self.plan.summary()])
