"""`GraphDeployed`: the runtime object of one transformed program — feeds a step's metadata to the
graph (or its compiled program) and returns the logits and captured hidden rows.

Metadata arrives as host tensors (`BatchMetadata`, built by the engine). The graph's `*_host`
inputs get those (Python control flow in the cached ops reads them without a sync); every other
metadata input gets a device copy, all of them in one copy per step (`to_device`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import chain

import torch
from torch import fx

from specdeploy.cache.handlers import Checkpoint, SpecState, State
from specdeploy.cache.metadata import (
    SEG_NORMAL,
    BatchMetadata,
    HostLists,
    kv_slot_mapping,
    slot_mapping_list,
)
from specdeploy.cache.plan import CachePlan
from specdeploy.deploy.base import CacheLayout, StepOutput
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import placeholders
from specdeploy.deploy.pipeline import TransformInfo, format_infos


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """One copy for a step's int64 metadata: flattened into one buffer (pinned on CUDA), copied
    non-blocking, viewed back by name. Always a fresh buffer, so on the CPU too no device input
    aliases a host tensor."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    out, i = {}, 0
    for name, t in tensors.items():
        out[name] = flat[i:i + t.numel()].view(t.shape)
        i += t.numel()
    return out


def lists_to_device(parts: dict[str, tuple[list[int], tuple | None]], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """`to_device` of int64 tensors given as (flat list, shape or None for 1-D): one
    `torch.tensor` over all of them, split into views (on the CPU ~25 fewer torch calls a
    step than building, flattening and concatenating tensors). A fresh buffer, like
    `to_device`'s."""
    flat = torch.tensor(list(chain.from_iterable(x for x, _ in parts.values())),
                        dtype=torch.long)
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    pieces = flat.split([len(x) for x, _ in parts.values()])
    return {name: t if shape is None else t.view(shape)
            for (name, (_, shape)), t in zip(parts.items(), pieces)}


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
            plan.num_checkpoints, plan.checkpoint_every, plan.bytes_by_kind.get("checkpoint", 0),
            plan.num_win_pages, plan.window, plan.page_bytes, plan.win_page_bytes)
        spec_of = {h.shadows: h.name for h in resources if isinstance(h, SpecState)}
        # (state, its spec state or None, its checkpoint pool) buffer names
        self._ckpt = [(h.of, spec_of.get(h.of), h.name) for h in resources
                      if isinstance(h, Checkpoint)]
        # NOTE: not `program or gm`: a compiled GraphModule has no truth value (len() raises)
        self._fn = gm if program is None else program
        self._input_names = [p.name for p in placeholders(gm)]
        self.mrope = False  # the graph takes [3, 1, T] positions (vision-language targets)
        self.graph_runner = None  # engine/cuda_graphs.py CudaGraphRunner, when installed

    def device_inputs(self, meta: BatchMetadata) -> dict[str, torch.Tensor]:
        """The step's metadata the graph reads on the device, as host tensors (one copy later)."""
        dev_inputs = {
            "input_ids": meta.input_ids[None], "position_ids": self._positions(meta),
            "logits_idx": meta.logits_idx, "cu_seqlens": meta.cu_seqlens,
            "cache_lens": meta.cache_lens, "page_table": meta.page_table,
            "slot_idx": meta.slot_idx, "ckpt_slots": meta.ckpt_slots,
        }
        if "slot_mapping" in self._input_names:
            dev_inputs["slot_mapping"] = (
                kv_slot_mapping(meta, self.layout.page_size) if self.layout.num_pages
                else torch.full((meta.num_tokens,), -1, dtype=torch.long))  # (no KV: no slots)
        if "page_table_win" in self._input_names:  # the window group's (cache/window.py)
            dev_inputs["page_table_win"] = meta.page_table_win
            dev_inputs["slot_mapping_win"] = kv_slot_mapping(meta, self.layout.page_size,
                                                             win=True)
        return dev_inputs

    def _feed(self, meta: BatchMetadata, hidden: torch.Tensor | None = None,
              dev: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The graph's inputs in order; `dev`: device copies already made (engine/cuda_graphs)."""
        if dev is None and meta.page_table_win is None and "page_table_win" in self._input_names:
            raise ValueError("this deployment's sliding-window layers have pages of their own: "
                             "give each Segment its win_pages (cache/window.py; ids 1.."
                             f"{self.layout.num_win_pages}, 0 the null page)")
        if dev is None and meta.lists is not None and not self.mrope:
            dev = self._device_from_lists(meta, meta.lists)
        elif dev is None:
            dev = to_device(self.device_inputs(meta), self.device)
        feed = {**dev, "cu_seqlens_host": meta.cu_seqlens,
                "cache_lens_host": meta.cache_lens, "seg_kind_host": meta.seg_kind,
                "ckpt_tokens_host": meta.ckpt_tokens, "key_extent_host": meta.key_extent,
                "hidden": None if hidden is None else hidden[None].to(self.device)}
        return [feed[n] for n in self._input_names]

    def _device_from_lists(self, meta: BatchMetadata, h: HostLists) -> dict[str, torch.Tensor]:
        """The device inputs `to_device` would copy, from the host lists the engine built them
        from (no reading back, no per-field reshape)."""
        t, s = meta.num_tokens, meta.num_seqs
        parts = {"input_ids": (h.ids, (1, t)), "position_ids": (h.pos, (1, t)),
                 "logits_idx": (h.logits_idx, None), "cu_seqlens": (h.cu, None),
                 "cache_lens": (h.cache_lens, None), "page_table": (h.table, (s, h.max_pages)),
                 "slot_idx": (h.slots, None), "ckpt_slots": (h.ckpt_slots, None)}
        if "slot_mapping" in self._input_names:
            # NOTE: a model without attention has no KV pages (its table is padding): no slots
            parts["slot_mapping"] = (slot_mapping_list(h, self.layout.page_size)
                                     if self.layout.num_pages else [-1] * t, None)
        if "page_table_win" in self._input_names:
            parts["page_table_win"] = (h.win_table, (s, h.max_win_pages))
            parts["slot_mapping_win"] = (slot_mapping_list(h, self.layout.page_size, win=True),
                                         None)
        return lists_to_device(parts, self.device)

    def _positions(self, meta: BatchMetadata) -> torch.Tensor:
        if not self.mrope:
            return meta.position_ids[None]
        if meta.mrope_positions is None:  # text only: the three axes agree
            return meta.position_ids.expand(3, 1, -1)
        return meta.mrope_positions[:, None]

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata, hidden: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> StepOutput:
        """One step. `hidden` [T, H] feeds a drafter graph (the third exported input). With a
        `graph_runner` (engine/cuda_graphs.py) the steps it takes replay a CUDA graph. `ids`
        [T] (on the device): the input tokens in place of the metadata's (never read here)."""
        if self.graph_runner is not None:
            bare, saves = _checkpoints_after(meta)
            replayed = self.graph_runner.run(bare, hidden, ids=ids)
            if replayed is not None:
                if saves is not None:
                    self.save_states(*saves)
                return replayed
        if ids is not None:  # the eager step reads its tokens from the tensor
            meta = replace(meta, input_ids=ids.to(meta.input_ids.dtype), lists=None)
        out = self._fn(*self._feed(meta, hidden))
        if not isinstance(out, (tuple, list)):
            out = (out,)
        hidden = out[1][0] if len(out) > 1 else None
        return StepOutput(logits=out[0][0].float(), hidden=hidden)

    def forward_embeds(self, meta: BatchMetadata, embeds: torch.Tensor) -> StepOutput:
        """A vision-language target's step from its input embeddings [T, H] (deploy/vlm.py)."""
        return self.forward(meta, embeds)

    @torch.inference_mode()
    def restore_states(self, slots: torch.Tensor, ckpts: torch.Tensor) -> None:
        """Prefix hits: every recurrent state slot `slots[i]` <- checkpoint `ckpts[i]`."""
        for state, _, pool in self._ckpt:
            getattr(self.gm, state)[slots] = getattr(self.gm, pool)[ckpts]

    @torch.inference_mode()
    def save_states(self, slots: torch.Tensor, ckpts: torch.Tensor) -> None:
        """Checkpoint `ckpts[i]` <- recurrent state slot `slots[i]` (as the cached ops write
        one: cast to the pool's dtype)."""
        for state, _, pool in self._ckpt:
            src, dst = getattr(self.gm, state), getattr(self.gm, pool)
            dst[ckpts.to(dst.device)] = src[slots.to(src.device)].to(dst.dtype)

    @torch.inference_mode()
    def checkpoint_spec(self, ckpts: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor
                        ) -> None:
        """Checkpoint `ckpts[i]` <- the verify step's state after token `idx[i]` of `slots[i]`
        (called for committed tokens only, so a rejected draft never reaches the cache)."""
        for _, spec, pool in self._ckpt:
            getattr(self.gm, pool)[ckpts] = getattr(self.gm, spec)[slots, idx]

    def report(self) -> str:
        d = self.ctx.dist
        ranked = [] if d is None or d.world_size == 1 else [
            f"rank {d.rank} of {d.world_size} (tp={d.tp_size}, ep={d.ep_size}); the cache plan "
            f"below is this rank's"]
        return "\n".join(["transforms (in order):", *format_infos(self.infos), *ranked,
                          self.memory_line(), self.plan.summary()])

    def weight_bytes(self):
        """Bytes of the weights this program holds (deploy/memory.py)."""
        from specdeploy.deploy.memory import weight_bytes

        cache = set()
        for h in self.resources:
            cache |= {h.name, f"{h.name}_k", f"{h.name}_v"}
        return weight_bytes(self.gm, cache)

    def memory_line(self) -> str:
        from specdeploy.deploy.memory import process_memory

        w, mem = self.weight_bytes(), process_memory()
        line = (f"weights resident: {w.total / 2**20:.1f} MiB ({w.params / 2**20:.1f} MiB graph "
                f"tensors, {w.closures / 2**20:.1f} MiB held by transforms: GGUF blocks, "
                f"packed copies)")
        if mem:
            line += (f"; process resident {mem['rss'] / 2**20:.0f} MiB, peak "
                     f"{mem['peak_rss'] / 2**20:.0f} MiB")
        return line


def _checkpoints_after(meta: BatchMetadata):
    """(meta, None), or for a decode step (one NORMAL token a sequence, host lists) whose
    sequences cross a prefix-cache checkpoint boundary: (meta without the checkpoints, (state
    slots, checkpoint slots)). Such a step's checkpoint is the state after its only token,
    i.e. the sequence's state slot once the step ran, so a replayed graph (which records no
    checkpoint writes: engine/cuda_graphs.py) takes the step and the state is copied after.
    Without it every such step ran eagerly (recurrent models with prefix caching: one step
    in every `checkpoint_every` pages)."""
    h = meta.lists
    if (h is None or not h.ckpt_tokens or meta.num_tokens != meta.num_seqs
            or any(k != SEG_NORMAL for k in h.kinds)):
        return meta, None
    saves = (torch.tensor([h.slots[t] for t in h.ckpt_tokens]), torch.tensor(h.ckpt_slots))
    return replace(meta, ckpt_tokens=_no_ints(), ckpt_slots=_no_ints(),
                   lists=h._replace(ckpt_tokens=[], ckpt_slots=[])), saves


def _no_ints() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)
