"""EAGLE-3 objective: low / middle / high target features fused by `fc`, training-time test.

The head starts from the target's top: `lm_head` = the target's head rows of the draft vocab,
`norm` = the target's final norm, the mid layer's hidden half = the target's last layer, `fc`
passing the high feature through. Only the embedding half and the fusion start random, so a
CPU-sized budget already gets useful acceptance.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from specdeploy.models.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specdeploy.training import target_info as info
from specdeploy.training.features import Features
from specdeploy.training.ttt import KVSteps, loss_row_logits, unrolled_loss


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                       always: list[int] | None = None) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target ids (plus `always`, e.g. EOS), sorted."""
    v = counts.shape[0]
    vd = min(draft_vocab_size, v)
    score = counts.double().clone()
    for i in always or []:
        if 0 <= i < v:
            score[i] = float("inf")
    ids = torch.topk(score, vd).indices  # ties: torch's order, fine for a frequency cut
    return ids.sort().values


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] offsets, t2d [V] bool) in the common format: target = draft + d2t[draft]."""
    d2t = draft_ids - torch.arange(draft_ids.shape[0])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def make_drafter(target: nn.Module, draft_ids: torch.Tensor, aux_layers: tuple[int, ...],
                 init_from_target: bool = True, seed: int = 0) -> Eagle3Drafter:
    t = target.cfg
    cfg = Eagle3Config(
        hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        vocab_size=t.vocab_size, draft_vocab_size=int(draft_ids.shape[0]),
        target_hidden_size=t.hidden_size, aux_layer_ids=tuple(aux_layers),
        **info.eagle3_geometry(target))
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, embed_tokens=info.embedding(target))
    drafter.init_buffers()
    d2t, t2d = vocab_maps(draft_ids, t.vocab_size)
    h = t.hidden_size
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if init_from_target:
            drafter.lm_head.weight.copy_(info.head_weight(target)[draft_ids])
            drafter.norm.weight.copy_(info.final_norm(target).weight)
            drafter.fc.weight[:, 2 * h:].add_(torch.eye(h))
        if init_from_target and info.is_llama(target):
            # NOTE: only a Llama target's last layer has the drafter's own shape to start from
            last, mid = target.model.layers[-1], drafter.midlayer
            mid.hidden_norm.weight.copy_(last.input_layernorm.weight)
            for n in ("q_proj", "k_proj", "v_proj"):
                getattr(mid.self_attn, n).weight[:, h:].copy_(
                    getattr(last.self_attn, n).weight)
            mid.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            mid.post_attention_layernorm.load_state_dict(
                last.post_attention_layernorm.state_dict())
            theirs, ours = last.mlp.state_dict(), mid.mlp.state_dict()
            if theirs.keys() == ours.keys() and all(  # (a Qwen3-MoE last layer: experts)
                    theirs[k].shape == ours[k].shape for k in ours):
                mid.mlp.load_state_dict(theirs)
    return drafter


class Eagle3Objective(nn.Module):
    """Trainable EAGLE-3 drafter + its TTT loss on target features."""

    method = "eagle3"

    def __init__(self, target: nn.Module, draft_ids: torch.Tensor, aux_layers: tuple[int, ...],
                 steps: int = 3, init_from_target: bool = True):
        super().__init__()
        self.drafter = make_drafter(target, draft_ids, aux_layers, init_from_target)
        self.steps = steps
        self.__dict__["_target"] = target  # frozen; not a submodule (not saved, not trained)
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)

    def step(self, hidden_in, embeds, position_ids, kv: KVSteps, rows=None):
        dr = self.drafter
        m, d = dr.midlayer, dr.cfg.head_dim
        b, t, _ = hidden_in.shape
        normed = m.hidden_norm(hidden_in)
        residual = normed if m.norm_before_residual else hidden_in
        x = torch.cat([m.input_layernorm(embeds), normed], -1)
        cos, sin = dr.rotary_emb(position_ids)
        a = m.self_attn
        q = torch.ops.specdeploy.rope(a.q_proj(x).view(b, t, -1, d), cos, sin)
        k = torch.ops.specdeploy.rope(a.k_proj(x).view(b, t, -1, d), cos, sin)
        o = kv.attend(q, k, a.v_proj(x).view(b, t, -1, d))
        h = residual + a.o_proj(o.reshape(b, t, -1))
        h = h + m.mlp(m.post_attention_layernorm(h))
        return h, dr.lm_head(dr.norm(h if rows is None else h[rows]))

    def loss(self, feats: Features) -> tuple[torch.Tensor, dict]:
        target = self._target
        with torch.no_grad():
            head = info.head_weight(target)[self.draft_ids]
            target_logits = loss_row_logits(feats, head)
        first = self.drafter.fc(feats.aux.float())
        return unrolled_loss(self.step, first, feats, info.embedding(target), target_logits,
                             self.steps, self.drafter.cfg.head_dim**-0.5)

    @torch.no_grad()
    def fit_linear(self, batches, ridge: float = 1e-2, sharpness: float = 2.0) -> None:
        """Closed-form warm start of step 0 (the later steps are left to SGD).

        Attention is made to look at its own position only (q = k = a fixed projection of the
        normed token embedding, sharp enough to swamp other positions; a repeated token carries
        the same value anyway) and the MLP branch is zeroed, so h = fc(aux) + o_proj(v(emb)):
        linear in (captured features, next-token embedding). `fc` and the rank-(kv heads x
        head_dim) product o_proj·v_proj come from one ridge regression onto the target's next
        final hidden divided by the final norm's weight (norm(h) then matches it)."""
        dr, target = self.drafter, self._target
        cfg, m = dr.cfg, dr.midlayer
        h, d, nkv, nq = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, \
            cfg.num_attention_heads
        w = dr.norm.weight.float()
        xtx = xty = 0.0  # float64 sums on the features' device, solved on the CPU
        for feats in batches:
            emb = info.embedding(target)(feats.ids[:, 1:]).float()
            x = torch.cat([feats.aux[:, :-1].float(), _unit_rms(emb)], -1)
            y = feats.final[:, 1:].float() / w
            keep = feats.mask[:, 1:]
            x, y = x[keep].double(), y[keep].double()
            xtx = xtx + x.T @ x
            xty = xty + x.T @ y
        xtx, xty = xtx.cpu(), xty.cpu()
        diag = xtx.diagonal().clone()  # NOTE: per-feature ridge: the aux layers differ in scale
        sol = torch.linalg.solve(xtx + torch.diag(ridge * diag + 1e-8), xty).T.float()
        a, b = sol[:, :-h], sol[:, -h:]
        u, sv, vh = torch.linalg.svd(b)
        r = nkv * d
        root = sv[:r].sqrt()
        v_emb, o_kv = root[:, None] * vh[:r], u[:, :r] * root  # [r, H], [H, r]
        g = torch.Generator().manual_seed(0)
        p = torch.linalg.qr(torch.randn(h, d, generator=g))[0].T * sharpness  # [d, H]
        dev = dr.fc.weight.device
        p, v_emb, o_kv, a = p.to(dev), v_emb.to(dev), o_kv.to(dev), a.to(dev)
        a_ = m.self_attn
        for lin in (a_.q_proj, a_.k_proj, a_.v_proj, a_.o_proj):
            lin.weight.zero_()
        rep = nq // nkv
        for j in range(nkv):
            a_.k_proj.weight[j * d:(j + 1) * d, :h] = p
            a_.v_proj.weight[j * d:(j + 1) * d, :h] = v_emb[j * d:(j + 1) * d]
            a_.o_proj.weight[:, j * rep * d:(j * rep + 1) * d] = o_kv[:, j * d:(j + 1) * d]
        for i in range(nq):
            a_.q_proj.weight[i * d:(i + 1) * d, :h] = p
        dr.fc.weight.copy_(a)
        m.input_layernorm.weight.fill_(1.0)
        m.hidden_norm.weight.fill_(1.0)
        m.mlp.down_proj.weight.zero_()

    def export(self, dtype: torch.dtype = torch.bfloat16) -> Eagle3Drafter:
        # NOTE: a borrowed (target) embedding is shared by the copy, never copied
        return copy.deepcopy(self.drafter).to(dtype)


def _unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
