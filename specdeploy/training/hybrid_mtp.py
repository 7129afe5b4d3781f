"""MTP objective for hybrid targets: the family's own MTP module (NemotronH `mtp.layers.*`
groups, Qwen3.5 `mtp.*` decoder layers), fresh or the checkpoint's, trained on target features.

The module is exactly what deployment loads (models/drafters/nemotron_h_mtp.py, qwen3_5_mtp.py),
written back in the checkpoint's `mtp.*` layout (models/drafters/checkpoint_mtp.py). Training is
the unrolled training-time test of training/ttt.py, with the same soft cross-entropy over the
training vocab and hidden regression as the generic head (training/mtp.py). With G groups,
unrolled step j runs group min(j, G-1) (group j predicts at step j; the last one carries on;
see `step` for Qwen3.5's j mod G past the last group).

Attention during the unrolled steps: each attention layer has its own KV (`KVSteps.layer`). A
group's keys at the committed rows are its keys on the target's features (step-0 inputs) —
deployment's catch-up runs the drafter over committed tokens from the target's hidden states;
a group first used at step j > 0 gets those keys from a pass over the step-0 inputs. At later
steps a row also sees the keys this group wrote for it at its earlier steps (the diagonal).
With one group (every fresh head, and the released checkpoints) this is the generic head's rule.

A fresh module starts from the target's top: each MTP layer copies the target's last layer of
its kind (attention, MoE, ...), the final norm is the target's, and the fusion passes the
hidden half through.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from specdeploy.models.drafters.checkpoint_mtp import (
    build_mtp,
    family_of,
    module_groups,
    save_checkpoint_mtp,
)
from specdeploy.ops import rope_cos_sin
from specdeploy.training import target_info as info
from specdeploy.training.features import Features
from specdeploy.training.ttt import KVSteps, loss_row_logits, unrolled_loss

_ops = torch.ops.specdeploy


def _attend(store: KVSteps, q, k, v) -> torch.Tensor:
    return store.attend(q, k, v).flatten(2)


def _nemotron_group(mtp: nn.Module, g: int, hidden, embeds, kv: KVSteps, position_ids):
    """One NemotronH MTP group (nemotron_h_mtp.MTP.forward) with its attention on `kv`."""
    n = mtp.group_len
    group = mtp.layers[g * n:(g + 1) * n]
    first = group[0]
    x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], -1))
    for i, layer in enumerate(group):
        kind = type(layer.mixer).__name__
        if kind == "Attention":
            a, (b, t, _) = layer.mixer, x.shape
            xn, d = layer.norm(x), a.head_dim
            q, k, v = (p(xn).view(b, t, -1, d) for p in (a.q_proj, a.k_proj, a.v_proj))
            x = x + a.o_proj(_attend(kv.layer((g, i), d**-0.5), q, k, v))
        elif kind == "Mamba2Mixer":
            raise NotImplementedError("NemotronH MTP training: a Mamba2 layer in an MTP group "
                                      "(its state would have to follow the draft steps)")
        else:
            x = layer(x)
    return group[-1].final_layernorm(x)


def _qwen_group(mtp: nn.Module, g: int, hidden, embeds, kv: KVSteps, position_ids):
    """One Qwen3.5 MTP layer (qwen3_5_mtp.MTP.forward) with its gated attention on `kv`."""
    cfg, layer = mtp.cfg, mtp.layers[g]
    cos, sin = rope_cos_sin(position_ids, mtp.inv_freq, cfg.mrope_section, cfg.mrope_interleaved)
    x = mtp.fc(torch.cat((mtp.pre_fc_norm_embedding(embeds), mtp.pre_fc_norm_hidden(hidden)), -1))
    a, (b, t, _) = layer.self_attn, x.shape
    xn, d = layer.input_layernorm(x), a.head_dim
    q, gate = a.q_proj(xn).view(b, t, -1, 2 * d).chunk(2, dim=-1)
    q = _ops.rope(a.q_norm(q), cos, sin)
    k = _ops.rope(a.k_norm(a.k_proj(xn).view(b, t, -1, d)), cos, sin)
    v = a.v_proj(xn).view(b, t, -1, d)
    o = _attend(kv.layer((g, 0), d**-0.5), q, k, v) * torch.sigmoid(gate.reshape(b, t, -1))
    x = x + a.o_proj(o)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return mtp.norm(x)


@torch.no_grad()
def init_from_target(mtp: nn.Module, target: nn.Module, seed: int = 0) -> nn.Module:
    """Fresh weights: small noise, the target's last layer of each MTP layer's kind, its final
    norm, and a fusion that passes the hidden half through."""
    g = torch.Generator().manual_seed(seed)
    for name, p in mtp.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(0.02 * torch.randn(p.shape, generator=g))
    layers = list(target.model.layers)

    def kind(layer):
        return getattr(layer, "layer_type", None) or type(layer.mixer).__name__

    for layer in mtp.layers:
        same = [t for t in layers if kind(t) == kind(layer)]
        if same:
            # NOTE: an MTP layer holds the block's keys plus its group's fusion / final norm
            missing = layer.load_state_dict(same[-1].state_dict(), strict=False).missing_keys
            assert all(k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "final_layernorm")
                       for k in missing), missing
    fusions = [mtp.fc] if hasattr(mtp, "fc") else [x.eh_proj for x in mtp.layers
                                                      if hasattr(x, "eh_proj")]
    h = target.cfg.hidden_size
    for fc in fusions:
        fc.weight[:, h:].copy_(torch.eye(h))
    norms = [mtp.norm] if hasattr(mtp, "norm") else [x.final_layernorm for x in mtp.layers
                                                      if hasattr(x, "final_layernorm")]
    for norm in norms:
        norm.weight.copy_(info.final_norm(target).weight)
    return mtp


class HybridMTPObjective(nn.Module):
    """Trainable family MTP module (`self.module`) + its unrolled loss on target features.
    `module`: the checkpoint's own (fine-tuning); None: a fresh one-group module."""

    method = "mtp"

    def __init__(self, target: nn.Module, train_ids: torch.Tensor, steps: int = 3,
                 module: nn.Module | None = None, regress_weight: float = 0.1, seed: int = 0):
        super().__init__()
        fam = family_of(target)
        if fam is None:
            raise ValueError(f"hybrid MTP: {type(target).__name__} is not a NemotronH or "
                             "Qwen3.5 target")
        if module is None:
            module = init_from_target(build_mtp(target, 1).float(), target, seed)
        self.module = module.float().requires_grad_(True)
        self.groups = module_groups(module)
        self.group_fn = _nemotron_group if fam.__name__.endswith("nemotron_h") else _qwen_group
        self.steps, self.regress_weight = steps, regress_weight
        self.__dict__["_target"] = target  # frozen; not a submodule (not saved, not trained)
        self.register_buffer("train_ids", train_ids.clone(), persistent=False)

    def step(self, hidden_in, embeds, position_ids, kv: KVSteps, rows=None):
        # NOTE: min(j, G-1), NemotronH's deployed rule. Qwen3.5 deploys j mod G (vLLM's
        # convention), feeding a re-used group the draft rows it skipped; training only unrolls
        # each group's own diagonal, so past step G-1 it keeps training the last group. The two
        # agree for j < G and whenever G = 1 (the released Qwen3.5 checkpoints).
        g = min(kv.step, self.groups - 1)
        if kv.step == 0:
            kv.stores["context"] = (hidden_in, embeds, position_ids)
        seen = kv.stores.setdefault("groups_seen", set())
        if g not in seen and kv.step > 0:
            # NOTE: a group first used now needs its keys at the committed rows (see above)
            h0, e0, p0 = kv.stores["context"]
            self.group_fn(self.module, g, h0, e0, kv, p0)
        seen.add(g)
        hidden = self.group_fn(self.module, g, hidden_in, embeds, kv, position_ids)
        return hidden, (hidden if rows is None else hidden[rows]) @ self._head_rows.T

    def loss(self, feats: Features) -> tuple[torch.Tensor, dict]:
        target = self._target
        with torch.no_grad():
            rows = info.head_weight(target)[self.train_ids].float()
            target_logits = loss_row_logits(feats, rows)
        self.__dict__["_head_rows"] = rows
        final = feats.final.float()
        return unrolled_loss(self.step, final, feats, info.embedding(target), target_logits,
                             self.steps, 1.0, regress=final, regress_weight=self.regress_weight)

    def export(self, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
        # NOTE: the borrowed target modules are shared by the copy, never copied
        return copy.deepcopy(self.module).to(dtype)

    def save(self, out, dtype: torch.dtype = torch.bfloat16) -> None:
        save_checkpoint_mtp(self.export(dtype).cpu(), self._target, out, dtype)
