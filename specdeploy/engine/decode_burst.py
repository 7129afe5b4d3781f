"""Decode bursts (vLLM's multi-step scheduling, `num_scheduler_steps`): a batch of decodes runs B
steps back to back as CUDA-graph replays, each step's input token fed on the device from the
previous step's sample (the engine's sampler: argmax, or the seeded / unseeded draws of sampled
requests in the same order), and the host synchronises once, at the end, for all B tokens.

Why: a batch-1 decode step of a small model on a GPU is ~0.9 ms of replayed graph, but the
engine's step was ~1.1 ms because the host's work (the step's metadata, the graph launch, the
sample's copy back) waits for the previous token and the GPU waits for the host. In a burst the
host prepares and launches step j + 1 while the GPU runs step j (bench/results/
gpu_h200_1204_final.json, `step_profile_triton`: engine step 1.13 ms vs replay 0.93 ms).

Lossless: the same graphs, the same batch-invariant rows and the same sampler (its per-row
tensors built once, each generator drawn once a step) as the step-by-step path, so greedy and
seeded requests get the same tokens. A sequence that stops inside a burst (EOS, a stop string,
max_tokens) keeps the tokens up to its stop, the rest are dropped (their cache writes sit past
its end and its pages are freed); its row still draws from the engine's shared generator until
the burst ends, so unseeded sampled requests get other (equally distributed) draws than step by
step would give them. The price: tokens stream in groups of B, and a request that arrives
during a burst waits for it to end (a burst starts only when nobody waits).

Taken only where every scheduled sequence decodes with nothing that reads its tokens step by
step (penalties, min_tokens, grammars, logprobs), the target has a graph runner that takes the
step, nobody waits, and each sequence's pages for the burst can be reserved now; else the
engine takes a normal step. A burst ends before a recurrent target's prefix-cache checkpoint
(the normal step that crosses it saves the states).
"""
from __future__ import annotations

import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.engine.sampler import row_tensors, sample
from specdeploy.engine.scheduler import ScheduledSeq


def burst_len(engine, batch: list[ScheduledSeq]) -> int:
    """Steps the batch can run as one burst (>= 2), or 0 (a normal step)."""
    n = engine.num_scheduler_steps
    runner = getattr(engine.deployed, "graph_runner", None)
    prefix = engine.prefix
    # NOTE: not where the graph reads embeddings (a vision-language target): a burst feeds
    # each step's tokens by id on the device
    if (n < 2 or runner is None or getattr(runner, "takes_hidden", False)
            or engine.threads is not None
            or engine.scheduler.waiting or engine.blocks.restores):
        return 0
    for s in batch:
        seq, p = s.seq, s.seq.params
        if not (s.num_tokens == 1 and s.samples and not p.penalized and seq.matcher is None
                and p.logprobs is None and seq.mm is None):
            return 0
        n = min(n, p.max_tokens - len(seq.output_ids), engine.max_seq_len - len(seq))
        if prefix is not None:  # a recurrent target's checkpoint is a normal step's work
            crossed = prefix.boundaries(seq.num_cached, n)
            if crossed:
                n = min(n, crossed[0] - seq.num_cached - 1)
    if n < 2:
        return 0
    if not engine.blocks.can_grow_all([(s.seq, s.seq.num_cached + n) for s in batch]):
        return 0
    return n


@torch.inference_mode()
def run_burst(engine, batch: list[ScheduledSeq], n: int) -> list[list[int]] | None:
    """The burst's tokens per sequence ([S][n]), or None when the runner would not take its
    first step (nothing has run; the engine takes a normal step)."""
    runner = engine.deployed.graph_runner
    seqs = [s.seq for s in batch]
    first = build_metadata([Segment([seq.all_ids[-1]], seq.num_cached, seq.pages, seq.slot,
                                    win_pages=seq.win_pages) for seq in seqs])
    if runner.bucket(first) is None:
        return None
    for seq in seqs:  # positions num_cached .. num_cached + n - 1
        engine.blocks.grow(seq, seq.num_cached + n)
    params, gens = [seq.params for seq in seqs], [seq.generator for seq in seqs]
    rows = None if all(p.greedy for p in params) else row_tensors(params, runner.target.device)
    ids, steps = None, []
    for j in range(n):
        meta = first if j == 0 else build_metadata(
            [Segment([0], seq.num_cached + j, seq.pages, seq.slot, win_pages=seq.win_pages)
             for seq in seqs])
        out = runner.run(meta, ids=ids)  # step j's input tokens: step j - 1's sample
        if out is None:  # a CPU graph's capture refused this shape (engine/cpu_graphs.py):
            if not steps:  # nothing ran, the engine takes a normal step
                return None
            break  # (the same shape as step 0: only a runner bug gets here)
        # the engine's sampler, draws in the same order as step by step
        ids = sample(out.logits, params, gens, engine.generator, rows)
        steps.append(ids)
    return torch.stack(steps, 1).tolist()  # the burst's one host synchronisation
