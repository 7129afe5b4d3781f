"""The plain engine's draw of one token per sequence (engine/engine.py `_verify`): processed
logits (penalties, grammar, logit bias), the draw, and the logprobs asked for, in one host copy;
a failure is one sequence's."""
from __future__ import annotations

import torch

from specdeploy.engine.logits_process import logprob_pack, process, unpack_logprobs
from specdeploy.engine.request import Sequence
from specdeploy.engine.sampler import argmax_rows, sample


def sample_isolated(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids,
                    generator: torch.Generator | None) -> list[int | Exception]:
    """Sample all rows at once; if that fails, row by row, so a failure is one sequence's
    (the exception in its place) and the others keep their tokens. Seeded rows draw the
    same either way (one generator per row)."""
    try:
        return sample_rows(logits, seqs, eos_token_ids, generator)
    except Exception:
        out: list[int | Exception] = []
        for i, s in enumerate(seqs):
            try:
                out.append(sample_rows(logits[i:i + 1], [s], eos_token_ids, generator)[0])
            except Exception as e:
                out.append(e)
        return out


def sample_rows(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids,
                generator: torch.Generator | None) -> list[int]:
    """Process (engine/logits_process.py), sample, and the logprobs of the rows that ask
    (`seq.new_logprobs`); ids and logprobs reach the host in one copy."""
    if all(s.params.greedy and not s.params.penalized and s.matcher is None
           and s.params.logprobs is None for s in seqs):
        return argmax_rows(logits).tolist()  # nothing to process: the argmax is the draw
    proc = process(logits[:, None], seqs, [[]] * len(seqs), eos_token_ids)
    ids = sample(proc.logits[:, 0], [s.params for s in seqs], [s.generator for s in seqs],
                 generator)
    asks = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not asks:
        return ids.tolist()
    n = max(seqs[i].params.logprobs for i in asks)
    idx = torch.tensor(asks, device=ids.device)
    pack = logprob_pack(proc.raw[idx], ids[idx][:, None], n)
    host = torch.cat((ids.double(), pack.flatten())).tolist()
    out = [int(t) for t in host[:len(seqs)]]
    w = 1 + 2 * n if n else 1
    for r, i in enumerate(asks):
        row = host[len(seqs) + r * w:len(seqs) + (r + 1) * w]
        seqs[i].new_logprobs = [unpack_logprobs(row, n, seqs[i].params.logprobs, out[i])]
    return out
