"""A speculative step's verification of its rows: greedy on argmaxes (one host sync), else
through the logits processors (grammar masks, min_tokens, penalties: row j sees the drafts
before it) and engine/verify.py's greedy or rejection sampling, with the target's logprobs of
the emitted tokens copied in the same host transfer."""
from __future__ import annotations

import torch

from specdeploy.engine.logits_process import logprob_pack, process, unpack_logprobs
from specdeploy.engine.request import Sequence
from specdeploy.engine.sampler import argmax_rows
from specdeploy.engine.verify import Drafts, verify, verify_greedy, verify_greedy_lists


def verify_rows(logits: torch.Tensor, rows: tuple[tuple[int, ...], ...], k1: int,
                seqs: list[Sequence], vocab_size: int, eos_token_ids, generator
                ) -> tuple[list[int], list[int]]:
    """(accepted counts, next tokens) of `seqs`: `logits` [N, V] of the step, `rows[s]` the logit
    rows of sequence s (padded to `k1` with its last where the torch paths need [S, K+1]);
    `generator` the engine's (rejection sampling of unseeded sequences)."""
    plain = all(not s.params.penalized and s.matcher is None and s.params.logprobs is None
                for s in seqs)
    if plain and all(s.params.greedy for s in seqs):
        # NOTE: on any device: the argmaxes are computed there and only [N] ints come back,
        # where the torch path's index and draft tensors cost host-to-device copies and
        # launches (a GPU step of a small model is host-bound)
        argmax = argmax_rows(logits).tolist()  # the step's one host synchronisation
        return verify_greedy_lists(argmax, rows, [s.spec.drafts for s in seqs], k1)
    index = torch.tensor([r + r[-1:] * (k1 - len(r)) for r in rows], device=logits.device)
    drafts = Drafts.of([s.spec.drafts for s in seqs], [s.spec.draft_probs for s in seqs],
                       vocab_size)
    # grammar masks, min_tokens and penalties: row j sees the drafts before it
    proc = process(logits[index], seqs, [s.spec.drafts for s in seqs], eos_token_ids)
    if all(s.params.greedy for s in seqs):
        num, nxt = verify_greedy(proc.logits.argmax(-1), drafts)
    else:
        num, nxt = verify(proc.logits, drafts, [s.params for s in seqs],
                          [s.generator for s in seqs], generator)
    head = torch.stack((num, nxt))
    asks = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not asks:
        return head.tolist()
    return _with_logprobs(proc.raw, drafts, head, seqs, asks)

def _with_logprobs(raw: torch.Tensor, drafts: Drafts, head: torch.Tensor,
                   seqs: list[Sequence], asks: list[int]) -> list[list[int]]:
    """The target's (raw) logprobs at each emitted token: row j's at draft j while j is
    accepted, then the next token's; copied with (num, next) in one host transfer."""
    s, k1, _ = raw.shape
    dev = raw.device
    ids = torch.full((s, k1), -1, dtype=torch.long)
    ids[:, :min(k1, drafts.ids.shape[1])] = drafts.ids[:, :k1]
    num, nxt = head[0], head[1]
    j = torch.arange(k1, device=dev)[None]
    tokens = torch.where(j < num[:, None], ids.to(dev), nxt[:, None])
    n = max(seqs[i].params.logprobs for i in asks)
    idx = torch.tensor(asks, device=dev)
    pack = logprob_pack(raw[idx], tokens[idx], n)  # [A, K+1, 1 + 2n]
    host = torch.cat((head.double().flatten(), pack.flatten())).tolist()
    num_h, nxt_h = [int(x) for x in host[:s]], [int(x) for x in host[s:2 * s]]
    w = pack.shape[-1]
    for r, i in enumerate(asks):
        seq, base = seqs[i], 2 * s + r * k1 * w
        toks = seq.spec.drafts[:num_h[i]] + [nxt_h[i]]
        seq.new_logprobs = [
            unpack_logprobs(host[base + t * w:base + (t + 1) * w], n, seq.params.logprobs,
                            tok) for t, tok in enumerate(toks)]
    return [num_h, nxt_h]
