"""The drafter side of a one-model speculative deployment, and its runtime `SpecDeployed`.

`prepare_drafter` loads the drafter (EAGLE-3, a trained MTP head, or the checkpoint's own MTP
module) and wraps it as `DraftStep`, the program that deploy/build.py exports and transforms
through the same path as the target, under the name `eagle_drafter` whatever its kind (so target
exclusions never match it), with its own paged KV sharing the target's page tables: one program
per MTP group of a checkpoint with several (`Drafter.num_groups`; draft step j runs group
`Drafter.group_of(j)`), each with its own KV (`draft_kv_*`, then `draft1_kv_*`, ...). The target
gets hidden-state capture and spec-state resources on every recurrent cached op. For
`method="ngram"` there is no drafter: drafts come from lookup.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from specdeploy.cache.handlers import SpecState
from specdeploy.cache.metadata import BatchMetadata
from specdeploy.checkpoint import CheckpointError
from specdeploy.config import SpecConfig
from specdeploy.deploy.base import StepOutput
from specdeploy.deploy.context import TARGET_QUANT_EXCLUDE
from specdeploy.deploy.passes.capture_hidden import FINAL
from specdeploy.deploy.pipeline import format_infos
from specdeploy.deploy.runner import GraphDeployed
from specdeploy.models.drafters import Drafter
from specdeploy.models.drafters.eagle3 import default_aux_layers
from specdeploy.ops import state_rows

log = logging.getLogger("specdeploy")


class DraftStep(nn.Module):
    """The drafter program that gets exported: (ids, positions, hidden[H]) → (logits, hidden),
    through the drafter's group `group` (the export traces only that group's layers).

    The drafter's borrowed target modules (embedding, LM head) are registered here as
    `shared_*` (the same Parameter objects as the target's), so export sees them as parameters.
    """

    def __init__(self, drafter: Drafter, group: int = 0):
        super().__init__()
        self.eagle_drafter = drafter
        # NOTE: step `group` runs group `group` under every policy (they agree below G)
        self.group = group
        for name, mod in drafter.borrowed.items():
            self.add_module(f"shared_{name}", mod)

    def forward(self, input_ids, position_ids, hidden):
        # NOTE: the embedding is the target's (its dtype); a drafter may run at another one
        embeds = self.eagle_drafter.embed(input_ids).to(hidden.dtype)
        out = self.eagle_drafter(hidden, embeds, position_ids, step=self.group)
        return out.logits, out.hidden


def _embedding(model: nn.Module) -> nn.Embedding:
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


def load_drafter(model: nn.Module, spec: SpecConfig) -> tuple[Drafter, tuple[int, ...]]:
    """Returns (drafter, capture layers). With no `draft_model`, a head shipped for this target
    (see drafters_registry) is used when the target has none."""
    from specdeploy.drafters_registry import shipped_drafter

    draft_model = spec.draft_model
    if spec.method == "mtp":
        drafter = getattr(model, "mtp", None)
        if drafter is not None and draft_model is None:
            del model.mtp  # NOTE: keeps mtp.* out of the target graph (under eagle_drafter)
            return drafter, (FINAL,)
        draft_model = draft_model or shipped_drafter(model, "mtp")
        if draft_model is None:
            raise CheckpointError("method='mtp': the target has no MTP head (no mtp.* weights) "
                                  "and no draft_model was given; train one with "
                                  "`specdeploy train-drafter --method mtp`")
        from specdeploy.models.drafters.checkpoint_mtp import is_checkpoint_mtp, load_checkpoint_mtp

        if is_checkpoint_mtp(draft_model):  # a hybrid family's own module (mtp.* layout)
            return load_checkpoint_mtp(draft_model, model), (FINAL,)
        from specdeploy.models.drafters.mtp_head import load_mtp_head

        return load_mtp_head(draft_model, model), (FINAL,)
    from specdeploy.models.drafters.eagle3 import load_eagle3

    draft_model = draft_model or shipped_drafter(model, "eagle3")
    if draft_model is None:
        raise ValueError("draft_model: method='eagle3' needs an EAGLE-3 drafter directory")
    drafter = load_eagle3(draft_model, target_cfg=model.cfg, embed_tokens=_embedding(model))
    n = len(model.model.layers)
    # NOTE: checkpoints (vLLM / EAGLE / SpecForge) name the layer whose *input* is captured; our
    # capture ids name the layer whose *output* is (AutoDeploy's {1, L/2-1, L-4}): shift by one.
    aux = drafter.cfg.aux_layer_ids or default_aux_layers(n)
    layers = spec.capture_layers or tuple(i - 1 for i in aux)
    return drafter, tuple(min(max(i, 0), n - 1) for i in layers)


@dataclass
class DrafterProgram:
    """What build.py needs to export and transform the drafter next to the target."""

    drafter: Drafter
    steps: tuple[DraftStep, ...]  # one program per MTP group (EAGLE-3, trained heads: one)
    capture_layers: tuple[int, ...]
    dtype: torch.dtype
    quantize: str | None
    quant_exclude: tuple[str, ...] | None  # None: the context's default (drafter excluded)

    @property
    def step(self) -> DraftStep:
        return self.steps[0]


def resource_prefix(group: int) -> str:
    """Cache names of drafter group `group`: `draft_*` (group 0, as before groups), `draft1_*`."""
    return "draft_" if group == 0 else f"draft{group}_"


def suffix_corpus(model: nn.Module, spec: SpecConfig):
    """The corpus index of `spec.suffix_store` for this target (engine/suffix_store.py), or
    None: no store, or "shipped" where none is shipped for this target (the store then holds
    finished requests' replies only)."""
    from specdeploy.config import SHIPPED_STORE
    from specdeploy.drafters_registry import shipped_drafter
    from specdeploy.engine.suffix_store import SuffixStore

    path = spec.suffix_store
    if path is None:
        return None
    if path == SHIPPED_STORE:
        path = shipped_drafter(model, "suffix")
        if path is None:
            log.info("suffix store: none shipped for this target; it starts empty and learns "
                     "from finished requests")
            return None
    return SuffixStore.load(path, model.cfg.vocab_size).static


def prepare_drafter(model: nn.Module, spec: SpecConfig, dtype: torch.dtype,
                    quantize: str | None, device: torch.device | None = None
                    ) -> DrafterProgram | None:
    """The drafter program of `spec` for this target (None for n-gram lookup)."""
    if spec.method in ("ngram", "suffix"):  # no drafter model
        return None
    from specdeploy.deploy.deferred import fill, filled, share_deferred
    from specdeploy.loading import resolve_dtype

    # NOTE: the target's parameter names, taken before load_drafter takes its MTP module out
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):  # (tied: every name)
        names.setdefault(id(p), []).append(n)
    # a target loaded deferred (build_policy.defer_blocks): a drafter drafting over a draft
    # vocabulary copies its rows of the LM head while loading (values needed, then given back)
    with filled(model, lm_head_weights(model)):
        drafter, layers = load_drafter(model, spec)
    draft_dtype = resolve_dtype(spec.draft_dtype) if spec.draft_dtype else dtype
    if draft_dtype != dtype:  # cast copies (below): from the values, not placeholders
        fill(model, _held(drafter))
    drafter = drafter.to(device=device, dtype=draft_dtype)
    if draft_dtype != dtype and "lm_head" in drafter.borrowed:
        # A drafter at another dtype gets its own copy of the LM head it reads; the borrowed
        # embedding stays shared (a lookup reads one row; DraftStep casts it).
        head = copy.deepcopy(drafter.borrowed["lm_head"]).to(draft_dtype).requires_grad_(False)
        drafter.borrow(lm_head=head)
    steps = tuple(DraftStep(drafter, g) for g in range(drafter.num_groups))
    for step in steps:
        share_deferred(step, model)
    if draft_dtype == torch.float32:
        on_blocks = _drafter_blocks(model, drafter, spec.draft_quantize == "q8_0", names)
        for step in steps:  # read by deploy/passes/ggml_linears.py
            step.ggml_tensors, step.ggml_weights = on_blocks, {}
        if spec.draft_quantize == "q8_0":
            _tiled_projection(drafter, on_blocks)
    if spec.draft_quantize == "q8_0":  # the blocks kernels run it (above), not int8 linears
        return DrafterProgram(drafter, steps, layers, draft_dtype, quantize, None)
    # NOTE: the default exclusions keep drafters unquantized; draft_quantize lifts them
    return DrafterProgram(drafter, steps, layers, draft_dtype,
                          spec.draft_quantize or quantize,
                          TARGET_QUANT_EXCLUDE if spec.draft_quantize else None)


def lm_head_weights(model: nn.Module) -> list[torch.Tensor]:
    """The target's LM-head weight (the embedding's where they are tied)."""
    return [p for n, p in model.named_parameters(remove_duplicate=False)
            if n in ("lm_head.weight", "head.weight")]


def _held(drafter: Drafter) -> list[torch.Tensor]:
    """The drafter's parameters and those of the target modules it borrows."""
    return [*drafter.parameters(), *(p for m in drafter.borrowed.values() for p in m.parameters())]


def _drafter_blocks(model: nn.Module, drafter: Drafter, q8_0: bool, names: dict) -> list:
    """(fp32 tensor, its GGUF blocks) pairs for the block kernels of the drafter's graph:
    the target's block-quantized weights the drafter holds (its embedding, a tied LM head, the
    checkpoint's own MTP layers: the same values, so the same drafter; `names`: id -> the
    target's parameter names), and with `q8_0` the drafter's other linears, quantized to Q8_0
    here and their fp32 weights set to the dequantized values (every path then runs the same
    quantized drafter; drafts never change what is accepted). A draft forward on a CPU is
    bound by reading its weights: the default model's MTP head reads the 49,152-row head."""
    from specdeploy.deploy.deferred import fill
    from specdeploy.ops.ggml_linear import HALF_KINDS, dequantize, quantize_q8_0

    pairs, paired = [], set()
    target_blocks = getattr(model, "ggml_weights", None) or {}
    own = {id(p) for p in drafter.parameters()}
    for p in _held(drafter):
        gw = next((target_blocks[n] for n in names.get(id(p), ()) if n in target_blocks), None)
        # NOTE: with q8_0 the drafter's own 16-bit matrices (a bf16 checkpoint's MTP layers)
        # take Q8_0 below: half their bytes again, as they did when loaded as fp32
        if gw is not None and p.dtype == torch.float32 and tuple(p.shape) == gw.shape \
                and id(p) not in paired and not (q8_0 and id(p) in own and p.dim() == 2
                                                 and gw.kind in HALF_KINDS):
            pairs.append((p, gw))
            paired.add(id(p))
    if q8_0:
        with torch.no_grad():
            for mod in drafter.modules():
                w = getattr(mod, "weight", None)
                if (isinstance(mod, nn.Linear) and w is not None and w.dtype == torch.float32
                        and w.dim() == 2 and w.shape[1] % 32 == 0 and id(w) not in paired):
                    fill(model, [w])  # (a deferred 16-bit weight: its values first)
                    gw = quantize_q8_0(w)
                    w.copy_(dequantize(gw))
                    pairs.append((w, gw))
    return pairs


def _tiled_projection(drafter: Drafter, pairs: list) -> None:
    """EAGLE-3's `fc` (the captured features' projection, run eagerly before every drafter
    catch-up) on the tiled Q8_0 kernel, as the drafter graph's linears: a torch fp32 linear of
    its 1728 x 576 on the default model took 0.3-1 ms a call on 2 cores (a new row count each
    catch-up). `drafter.fc_kernel`; nothing where the kernels are unavailable."""
    from specdeploy.ops import ggml_tiled
    from specdeploy.ops.ggml_int import default_isa

    fc = drafter._modules.get("fc")
    if not isinstance(fc, nn.Linear) or ggml_tiled.kernel_unavailable() is not None:
        return
    gw = next((g for w, g in pairs if w is fc.weight), None)
    if gw is None or fc.out_features % ggml_tiled.TILE:
        return
    drafter.fc_kernel = ggml_tiled.tiled_linear_fn(ggml_tiled.repack(gw), fc.bias, default_isa())


class SpecDeployed:
    """Target + drafter programs over one cache plan (no drafter for method="ngram"). `drafts`
    holds one program per drafter group (`draft` is group 0's). See engine/speculative.py for
    the step."""

    def __init__(self, target: GraphDeployed, drafts: list[GraphDeployed],
                 drafter: Drafter | None, spec: SpecConfig):
        self.target, self.drafts, self.drafter, self.spec = target, list(drafts), drafter, spec
        self.draft = self.drafts[0] if self.drafts else None
        self.num_groups = len(self.drafts)
        self.num_draft_tokens = spec.num_draft_tokens  # the drafter's chain length
        self.method = spec.method
        self.d2t = None if drafter is None else drafter.d2t
        self.vocab_size = target.vocab_size
        self.max_seq_len = target.max_seq_len
        self.hf_config = target.hf_config
        self.layout = target.layout
        self.device = target.device
        self.suffix_corpus = None  # the suffix store's loaded corpus (engine/suffix_store.py)
        self._spec_pairs = [(h.shadows, h.name) for h in target.resources
                            if isinstance(h, SpecState)]
        self._promote: state_rows.StatePromoter | None = None  # (`commit`, on first use)
        self._d2t_ids: torch.Tensor | None = None  # (`to_target`, on first use)
        # NOTE: the base projection is a cast to the drafter's dtype, which `Drafter.dtype` finds
        # by walking its parameters (~10 us a step); it is fixed once the drafter is deployed
        self._cast_to = (drafter.dtype if drafter is not None
                         and type(drafter).project is Drafter.project else None)

    def forward(self, meta: BatchMetadata) -> StepOutput:
        return self.target.forward(meta)

    def forward_embeds(self, meta: BatchMetadata, embeds: torch.Tensor) -> StepOutput:
        """A vision-language target's step from its input embeddings (deploy/vlm.py)."""
        return self.target.forward(meta, embeds)

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        """Target features → the drafter's hidden input (EAGLE-3 fuses layers with `fc`)."""
        if self._cast_to is not None:  # (the base projection: a cast to the drafter's dtype)
            return captured.to(self._cast_to)
        return self.drafter.project(captured)

    def group_of(self, step: int) -> int:
        """The drafter group (program) that drafts step `step` (0: the catch-up's)."""
        return self.drafter.group_of(step)

    def draft_forward(self, meta: BatchMetadata, hidden: torch.Tensor, group: int = 0,
                      ids: torch.Tensor | None = None) -> StepOutput:
        """Drafter step through group `group`; returns logits over the *target* vocabulary
        order only when d2t is None (use `to_target` on argmaxes otherwise) and the hidden rows
        at `meta.logits_idx`. `ids` [S] (one token a sequence): the input tokens on the device,
        in place of the metadata's."""
        out = self.drafts[group].forward(meta, hidden, ids=ids)
        h = meta.lists  # (the host lists: no metadata tensor made for a replayed chain step)
        if h is not None and len(h.logits_idx) == meta.num_tokens:  # every row: them all
            return StepOutput(out.logits, out.hidden[:meta.num_tokens])
        idx = meta.logits_idx if h is None else torch.tensor(h.logits_idx)
        return StepOutput(out.logits, out.hidden[idx.to(out.hidden.device)])

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        table = self._d2t_ids
        if table is None or table.device != draft_ids.device:  # draft id -> target id, once
            d2t = self.d2t.to(draft_ids.device, torch.long)  # (int64 ids, as argmax gives)
            table = self._d2t_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        return table[draft_ids]

    def target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocab probabilities [N, Vd] → target vocab [N, V] (zero outside Vd)."""
        if self.d2t is None:
            return draft_probs
        ids = torch.arange(draft_probs.shape[-1], device=draft_probs.device)
        out = draft_probs.new_zeros(draft_probs.shape[0], self.vocab_size)
        return out.index_copy_(1, self.to_target(ids), draft_probs)

    @property
    def has_spec_states(self) -> bool:
        """Whether the target keeps per-token recurrent states to promote (`commit`)."""
        return bool(self._spec_pairs)

    def commit(self, slots: torch.Tensor | list[int], accepted_idx: torch.Tensor | list[int]
               ) -> None:
        """Promote spec-state entry `accepted_idx[s]` (tokens kept - 1) into each state slot
        (tensors, or host lists). On the CPU one C call copies them all
        (state_rows.StatePromoter, set up on first use); elsewhere advanced indexing per state."""
        p = self._promote
        if p is None:
            gm = self.target.gm
            p = self._promote = state_rows.StatePromoter(
                [(getattr(gm, main), getattr(gm, spec)) for main, spec in self._spec_pairs])
        lists = isinstance(slots, list)
        if p.usable and (lists or slots.device.type == "cpu"):
            p(slots if lists else slots.tolist(),
              accepted_idx if lists else accepted_idx.tolist())
            return
        if not p.pairs:
            return
        dev = p.pairs[0][0].device
        s = torch.tensor(slots, device=dev) if lists else slots.to(dev)
        i = torch.tensor(accepted_idx, device=dev) if lists else accepted_idx.to(dev)
        for state, per_token in p.pairs:
            state[s] = per_token[s, i]

    def restore_states(self, slots: torch.Tensor, ckpts: torch.Tensor) -> None:
        self.target.restore_states(slots, ckpts)

    def checkpoint_spec(self, ckpts: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor
                        ) -> None:
        self.target.checkpoint_spec(ckpts, slots, idx)

    def report(self) -> str:
        lines = ["target:", self.target.report()]
        c = self.suffix_corpus
        if self.spec.uses_store:
            what = ("no corpus (finished requests' replies only)" if c is None else
                    f"{c.num_tokens} tokens loaded ({c.nbytes / 2**20:.1f} MiB), plus finished "
                    "requests' replies")
            lines.append(f"suffix store: {what}")
        if self.draft is None:
            return "\n".join(lines + ["drafter: none (lookup)"])
        for g, draft in enumerate(self.drafts):
            group = f", MTP group {g} of {self.num_groups}" if self.num_groups > 1 else ""
            lines += [f"drafter (eagle_drafter{group}):", *format_infos(draft.infos)]
        return "\n".join(lines)
