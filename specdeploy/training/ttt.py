"""Training-time test (EAGLE-3): unroll the drafter for S steps on whole sequences at once.

Row p of step j stands for the draft made at position p + j when the target stopped at p + 1:
its input is the drafter's own step j-1 hidden of row p (step 0: the target's features at p) and
the token t_{p+j+1}; it predicts t_{p+j+2}, labelled with the target's distribution at p + j + 1.
Its attention sees exactly what the deployed drafter's paged KV holds then: the step-0 keys of
rows 0..p (written from real target features) plus row p's own keys of steps 1..j (the diagonal).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdeploy.training.features import Features

# step(hidden_in [B,T,H], embeds [B,T,H], position_ids [B,T], kv: KVSteps, rows=None)
#   -> (hidden_out [B,T,H], logits over the training vocab [B,T,Vs], or [N,Vs] at the True
#       entries of the bool mask `rows` [B,T]: the LM head is most of a step's cost, and about
#       half the rows of chat data are prompt rows that carry no loss)
StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class KVSteps:
    """Keys/values of the steps so far ([B,T,Hkv,D] each); `attend` adds the current step's."""

    def __init__(self, scale: float):
        self.scale, self.keys, self.values = scale, [], []
        # NOTE: for drafters with several attention layers (hybrid MTP groups): the unrolled
        # step index, and per-layer stores (`layer`) plus whatever a step keeps across steps
        self.step, self.stores = 0, {}

    def layer(self, key, scale: float) -> KVSteps:
        """The store of one attention layer of a multi-layer drafter (created empty)."""
        if key not in self.stores:
            self.stores[key] = KVSteps(scale)
        return self.stores[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B,T,Hq,D] → [B,T,Hq,D]: causal over step 0, diagonal over steps 1..j."""
        self.keys.append(k)
        self.values.append(v)
        b, t, hq, d = q.shape
        rep = hq // k.shape[2]

        def heads(x):  # [B,T,Hkv,D] -> [B,Hq,T,D]
            return x.repeat_interleave(rep, dim=2).transpose(1, 2)

        qh = q.transpose(1, 2) * self.scale
        k0, v0 = heads(self.keys[0]), heads(self.values[0])
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = [(qh @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(qh * heads(kj)).sum(-1, keepdim=True) for kj in self.keys[1:]]
        probs = torch.cat(scores, -1).softmax(-1)
        out = probs[..., :t] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + probs[..., t + j:t + j + 1] * heads(vj)
        return out.transpose(1, 2)


def shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, s:] padded back to length T with zeros (rows past the end are masked anyway)."""
    if s == 0:
        return x
    pad = x.new_zeros(x.shape[0], min(s, x.shape[1]), *x.shape[2:])
    return torch.cat([x[:, s:], pad], 1)


def loss_row_logits(feats: Features, head: torch.Tensor) -> torch.Tensor:
    """The target's logits over the training vocab [B,T,Vs] at the loss rows (the only rows
    `unrolled_loss` reads; zero elsewhere)."""
    b, t = feats.mask.shape
    out = torch.zeros(b, t, head.shape[0], device=head.device)
    out[feats.mask] = feats.final[feats.mask].float() @ head.float().T
    return out


def unrolled_loss(step: StepFn, first_hidden: torch.Tensor, feats: Features, embed: Callable,
                  target_logits: torch.Tensor, steps: int, scale: float, decay: float = 0.8,
                  regress: torch.Tensor | None = None, regress_weight: float = 0.0
                  ) -> tuple[torch.Tensor, dict]:
    """Soft cross-entropy against the target's distribution at every unrolled step (weights
    decay**j). `target_logits` [B,T,Vs]: the target's logits at each position over the training
    vocab. `regress` (MTP): the target's final hidden, which step j's hidden should match at
    p + j + 1. Returns (loss, stats: per-step top-1 agreement and the chained estimate)."""
    ids, mask = feats.ids, feats.mask
    b, t = ids.shape
    with torch.no_grad():
        emb = embed(ids).to(first_hidden.dtype)
        # NOTE: step j's label rows (p + j + 1 for valid p) are exactly the mask's rows.
        p_target = torch.zeros(b, t, target_logits.shape[-1], device=ids.device)
        p_target[mask] = target_logits[mask].float().softmax(-1)
        top_target = target_logits.argmax(-1)
    kv = KVSteps(scale)
    hidden, total, weights = first_hidden, 0.0, 0.0
    chain = torch.ones(b, t, dtype=torch.bool, device=ids.device)
    agree, chained = [], []
    for j in range(steps):
        pos = (torch.arange(t, device=ids.device) + j).expand(b, t)
        valid = shift(mask, j + 1)
        kv.step = j
        hidden, logits = step(hidden, shift(emb, j + 1), pos, kv, rows=valid)  # logits [N, Vs]
        n = valid.sum().clamp_min(1)
        ce = -(shift(p_target, j + 1)[valid] * F.log_softmax(logits.float(), -1)).sum(-1)
        loss_j = ce.sum() / n
        if regress is not None and regress_weight:
            err = F.smooth_l1_loss(hidden[valid].float(), shift(regress, j + 1)[valid].float(),
                                   reduction="none").mean(-1)
            loss_j = loss_j + regress_weight * err.sum() / n
        total = total + decay**j * loss_j
        weights += decay**j
        with torch.no_grad():
            hit = torch.zeros_like(valid)
            hit[valid] = logits.argmax(-1) == shift(top_target, j + 1)[valid]
            chain = chain & hit
            agree.append(float(hit.sum() / n))
            chained.append(float((chain & valid).sum() / n))
    return total / weights, {"agree": agree, "chained": chained,
                             "est_accept_len": 1.0 + sum(chained)}
