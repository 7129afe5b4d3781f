"""Hybrid models (Mamba2 / gated-delta state slots) under batching, slot reuse and preemption."""
from __future__ import annotations

import random
from collections import deque

import pytest

from specdeploy.deploy.build import build
from specdeploy.engine import Engine, SamplingParams


def _run(engine: Engine, prompts, sp):
    ids = [engine.add_request(p, sp) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe"])
def test_preemption_and_slot_reuse_keep_tokens(family, tmp_path):
    from specdeploy.models.registry import family_module

    path = family_module(family).make_tiny(tmp_path / family, seed=1)
    deployed = build(path, dtype="float32", max_batch_size=3, max_seq_len=64,
                            page_size=8)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(1, 24))] for _ in range(6)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [_run(Engine(deployed, max_batch_size=3), [p], sp)[0] for p in prompts]
    eng = Engine(deployed, max_batch_size=3, max_num_tokens=16)
    # Use only 6 pages (48 tokens) of the plan: three sequences cannot all grow, so some are
    # preempted, and freed slots are handed to new sequences whose state must start from zero.
    eng.blocks.free_pages = deque(range(6))
    out = _run(eng, prompts, sp)
    assert out == alone
    assert eng.stats.num_preemptions > 0
