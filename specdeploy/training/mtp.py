"""MTP objective: a DeepSeek-style next-next-token module on the target's final hidden state.

Step 0 sees (h_p final-normed, t_{p+1}) and predicts t_{p+2}; the deployed head then chains its own
normed hidden for K - 1 more steps, so training unrolls the same way (training-time test, one
shared layer). The LM head is the target's and stays frozen; the loss is a soft cross-entropy
over the training vocab (the most frequent target tokens, which keeps the CPU cost of the head
down) plus a small regression of the head's hidden onto the target's final hidden one position
later — the quantity the shared LM head reads, so it constrains the logits of every token.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from specdeploy.models.drafters.mtp_head import MTPHead, make_mtp_head
from specdeploy.training.features import Features
from specdeploy.training.ttt import KVSteps, loss_row_logits, unrolled_loss


class MTPObjective(nn.Module):
    method = "mtp"

    def __init__(self, target: nn.Module, train_ids: torch.Tensor, steps: int = 3,
                 init_from_target: bool = True, regress_weight: float = 0.1):
        super().__init__()
        self.head = make_mtp_head(target, init_from_target)
        self.steps, self.regress_weight = steps, regress_weight
        self.__dict__["_target"] = target
        self.register_buffer("train_ids", train_ids.clone(), persistent=False)

    def step(self, hidden_in, embeds, position_ids, kv: KVSteps, rows=None):
        mtp = self.head
        layer, d = mtp.layers[0], mtp.cfg.head_dim
        a = layer.self_attn
        b, t, _ = hidden_in.shape
        x = mtp.fuse(hidden_in, embeds)
        xn = layer.input_layernorm(x)
        cos, sin = mtp.rotary_emb(position_ids)
        q = torch.ops.specdeploy.rope(a.q_proj(xn).view(b, t, -1, d), cos, sin)
        k = torch.ops.specdeploy.rope(a.k_proj(xn).view(b, t, -1, d), cos, sin)
        o = kv.attend(q, k, a.v_proj(xn).view(b, t, -1, d))
        x = x + a.o_proj(o.reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = mtp.norm(x)
        return hidden, (hidden if rows is None else hidden[rows]) @ self._head_rows.T

    def loss(self, feats: Features) -> tuple[torch.Tensor, dict]:
        target = self._target
        with torch.no_grad():
            rows = target.lm_head.weight[self.train_ids]
            target_logits = loss_row_logits(feats, rows)
        self.__dict__["_head_rows"] = rows
        final = feats.final.float()
        return unrolled_loss(self.step, final, feats, target.model.embed_tokens, target_logits,
                             self.steps, self.head.cfg.head_dim**-0.5, regress=final,
                             regress_weight=self.regress_weight)

    @torch.no_grad()
    def fit_linear(self, batches, ridge: float = 1e-2) -> None:
        """Closed-form warm start. With the layer's residual branches zeroed the head is
        norm(fc(x)), x = cat(emb(t_{p+1}), h_p) (unit-RMS halves), so `fc` is a ridge regression
        onto the target's next final hidden divided by the final norm's weight. One pass of
        X^T X costs less than a single SGD step and already predicts t_{p+2} well; the same map
        applies at every chained step (the head's normed hidden stands in for h_p)."""
        mtp, target = self.head, self._target
        layer, h = mtp.layers[0], mtp.cfg.hidden_size
        w = mtp.norm.weight.float()
        xtx = xty = 0.0  # float64 sums on the features' device, solved on the CPU
        for feats in batches:
            final = feats.final.float()
            x = torch.cat([target.model.embed_tokens(feats.ids[:, 1:]).float(), final[:, :-1]], -1)
            x = torch.cat([_unit_rms(x[..., :h]), _unit_rms(x[..., h:])], -1)
            y = final[:, 1:] / w
            keep = feats.mask[:, 1:]
            x, y = x[keep].double(), y[keep].double()
            xtx = xtx + x.T @ x
            xty = xty + x.T @ y
        xtx, xty = xtx.cpu(), xty.cpu()
        lam = ridge * float(xtx.diagonal().mean())
        sol = torch.linalg.solve(xtx + lam * torch.eye(2 * h, dtype=xtx.dtype), xty)
        mtp.fc.weight.copy_(sol.T.to(mtp.fc.weight))
        mtp.pre_fc_norm_embedding.weight.fill_(1.0)
        mtp.pre_fc_norm_hidden.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()

    def export(self, dtype: torch.dtype = torch.bfloat16) -> MTPHead:
        h = copy.deepcopy(self.head)  # NOTE: borrowed target modules are shared, not copied
        h.set_draft_vocab(self.train_ids.cpu())  # deployed drafts stay in the trained vocab
        return h.to(dtype)


def _unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
