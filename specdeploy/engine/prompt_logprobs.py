"""The prompt's logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after
the first, the model's raw log-probability of it given the tokens before it, plus the top N.

A step widens the logit rows of each prefill chunk of such a request from its last token (or
none, mid-prompt) to every token of the chunk (`widen`), so the one forward gives them; after
it (`take`) those rows become the request's entries and the step's logits are cut back to the
rows the engine's sampling and verification expect, in the same order. Rows are the target's
raw logits (before any logits processing), log-softmaxed in fp32, as vLLM reports them.

Such a request never starts on prefix-cached pages (their positions would not be computed;
vLLM does the same); a preempted one recomputes its prompt without recording it twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.cache.metadata import SEG_NORMAL, Segment
from specdeploy.deploy.base import StepOutput
from specdeploy.engine.logits_process import logprob_pack, unpack_logprobs


@dataclass
class Widened:
    """A segment whose logit rows `widen` set to all of its tokens."""

    index: int  # in the step's segments
    start: int  # its first token's position
    rows: int  # its tokens (= its logit rows now)
    num_logits: int  # its rows before (restored by `take`)


def widen(batch, segs: list[Segment]) -> list[Widened] | None:
    """Give every prefill chunk of a request still owing prompt logprobs a logit row per token;
    None when no segment of the step needs it (the common case: nothing changes)."""
    plan = None
    for i, (s, seg) in enumerate(zip(batch, segs)):
        lps = s.seq.prompt_logprobs
        if lps is None or seg.kind != SEG_NORMAL:
            continue
        start, n = seg.cache_len, len(seg.token_ids)
        # rows start .. start + n - 1 predict positions start + 1 .. start + n; the entries so
        # far cover positions 0 .. len(lps) - 1 (position 0 has none: None)
        if start + n <= len(lps) - 1 or start + 1 >= len(s.seq.prompt_ids):
            continue
        plan = plan or []
        plan.append(Widened(i, start, n, seg.num_logits))
        seg.num_logits = n
    return plan


def take(plan: list[Widened], batch, segs: list[Segment], out: StepOutput) -> StepOutput:
    """Record the widened rows' prompt logprobs on their sequences, restore the segments' row
    counts, and return the step's output with the logits the engine expects."""
    starts, row = [], 0
    for seg in segs:
        starts.append(row)
        row += seg.num_logits
    logits, keep = out.logits, []
    by_index = {w.index: w for w in plan}
    for j, seg in enumerate(segs):
        w = by_index.get(j)
        if w is None:
            keep.extend(range(starts[j], starts[j] + seg.num_logits))
            continue
        _record(batch[j].seq, logits[starts[j]:starts[j] + w.rows], w.start)
        keep.extend(range(starts[j] + w.rows - w.num_logits, starts[j] + w.rows))
        seg.num_logits = w.num_logits
    idx = torch.tensor(keep, dtype=torch.long, device=logits.device)
    return StepOutput(logits.index_select(0, idx), out.hidden)


def _record(seq, rows: torch.Tensor, start: int) -> None:
    """Entries for the positions rows [R, V] predict (start + 1 on) that are prompt tokens and
    not recorded yet: {id: logprob} (the top N first, best first, then the prompt token if not
    among them) and the prompt token's rank (1: the most likely)."""
    prompt, lps = seq.prompt_ids, seq.prompt_logprobs
    first = len(lps) - 1 - start  # rows before it were recorded (a recompute after preemption)
    last = min(rows.shape[0], len(prompt) - 1 - start)  # rows predicting prompt tokens
    if last <= first:
        return
    n = seq.params.prompt_logprobs
    raw = rows[first:last].float()
    targets = torch.tensor(prompt[start + 1 + first:start + 1 + last], device=raw.device)
    packed = logprob_pack(raw[None], targets[None], n)[0]
    tok_lp = raw.log_softmax(-1).gather(-1, targets[:, None])
    ranks = (raw.log_softmax(-1) > tok_lp).sum(-1) + 1
    for r, (values, rank) in enumerate(zip(packed.tolist(), ranks.tolist())):
        lps.append(unpack_logprobs(values, n, n, int(targets[r])))
        seq.prompt_ranks.append(int(rank))
