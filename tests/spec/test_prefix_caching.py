"""Prefix caching end to end on llama, nemotron_h (Mamba2 + conv) and qwen3_5_moe (gated delta +
conv), with and without speculation (EAGLE-3 / MTP), with chunked prefill, under eviction.

Oracles: greedy output of the same prompt on a reset cache through the non-speculative engine
(a cold run: nothing is hit), and for recurrent checkpoints a fresh prefill of exactly the tokens
before the boundary (its states are tested against the `*_ref` recurrences in tests/deploy).
"""
from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.cache.prefix import ROOT, page_key
from specdeploy.engine import Engine, SamplingParams
from specdeploy.engine.speculative import SpecEngine
from tests.spec.tiny_targets import PAGE_SIZE

N = 8  # generated tokens
K = 2
GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 100) for _ in range(n)]


def _cold(target, prompt, params=GREEDY):
    llm = target.llm()
    llm.reset_prefix_cache()
    out = llm.generate([prompt], params)[0].token_ids
    llm.reset_prefix_cache()
    return out


def _hits(llm) -> int:
    return llm.stats()["prefix_cache_hits"]


def _plan(llm):
    return getattr(llm.deployed, "target", llm.deployed).plan


@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_default_pages_are_scan_chunks_with_a_checkpoint_each(target, k):
    """Defaults: pages of 16 tokens on llama, of the scan chunk on hybrids (16 / 64 here), and a
    recurrent checkpoint at every page boundary (the budget allows one per page)."""
    plan = _plan(target.llm(k))
    assert plan.page_size == PAGE_SIZE[target.arch]
    if target.arch == "llama":
        assert plan.num_checkpoints == 0 and "checkpoint" not in plan.bytes_by_kind
        return
    assert plan.checkpoint_every == 1 and plan.num_checkpoints == plan.num_pages
    assert "every page boundary is a scan-chunk boundary" in plan.summary()
    assert target.llm(k).engine.prefix.checkpoint_every == 1


def _crossing(target):
    """(page size, a prompt of a page and 5 tokens, two pages of greedy decode, its cold
    continuation): the prompt's boundary and two decoded ones are crossed."""
    if target.arch == "llama":
        pytest.skip("no recurrent state")
    ps = PAGE_SIZE[target.arch]
    prompt = _tokens(ps + 5, 4)
    params = SamplingParams(max_tokens=2 * ps, ignore_eos=True)
    return ps, prompt, params, _cold(target, prompt, params)


@pytest.mark.parametrize("pages", [(2, 3), (2, 0)], ids=["mid_page", "on_boundary"])
@pytest.mark.parametrize("chunk", [512, 13], ids=["whole", "chunked"])
@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_shared_prefix_hits_and_matches_cold_run(target, pages, chunk, k):
    PS = PAGE_SIZE[target.arch]
    shared = pages[0] * PS + pages[1]
    prefix = _tokens(shared, 1)
    first, second = prefix + _tokens(9, 2), prefix + _tokens(6, 3)
    want = _cold(target, second)
    llm = target.llm(k)
    llm.reset_prefix_cache()
    sched = llm.engine.scheduler
    sched.max_num_tokens = chunk
    try:
        llm.generate([first], GREEDY)
        before = _hits(llm)
        got = llm.generate([second], GREEDY)[0].token_ids
        hits = _hits(llm) - before
    finally:
        sched.max_num_tokens = 512
        llm.reset_prefix_cache()
    assert got == want
    # every full page of the shared prefix, with speculation as without (recurrent targets
    # too: a checkpoint at every page boundary)
    assert hits == shared // PS * PS


def _checkpoints(llm, ids):
    """{boundary: {state name: checkpointed tensor}} of the cached pages of `ids`."""
    eng = llm.engine
    PS = eng.blocks.page_size
    gm = getattr(llm.deployed, "target", llm.deployed).gm
    pools = {n[: -len("_ckpt")]: b for n, b in gm.named_buffers() if n.endswith("_ckpt")}
    out, key = {}, ROOT
    for i in range(len(ids) // PS):
        key = page_key(key, ids[i * PS:(i + 1) * PS])
        page = eng.prefix.page_of.get(key)
        if page is None:
            break
        slot = eng.prefix.ckpt_of.get(page)
        if slot is not None:
            out[(i + 1) * PS] = {n: pool[slot].clone() for n, pool in pools.items()}
    return out


def _fresh_states(target, ids):
    """States after exactly `ids`, prefilled fresh into slot 0 of the plain deployment."""
    ref = target.llm().deployed
    PS = ref.layout.page_size
    ref.forward(build_metadata([Segment(ids, 0, list(range(-(-len(ids) // PS))), 0)]))
    target.llm().reset_prefix_cache()  # its pages were written behind its engine's back
    return {n[: -len("_state")]: b[0].clone() for n, b in ref.gm.named_buffers()
            if n.endswith("_state") and "spec" not in n}


@pytest.mark.parametrize("chunk", [512, 13], ids=["whole", "chunked"])
@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_checkpoints_equal_fresh_prefill_states(target, chunk, k):
    """Checkpoints (SSM, conv, gated delta) from prefill, whole (page boundaries are scan-chunk
    ends: the states come free) or in chunks of 13 (boundaries inside a scan chunk), decode
    tokens and, with speculation, verify steps whose drafts are one right then wrong:
    boundaries inside accepted runs are checkpointed from the spec states, rejected drafts
    never are. Each equals the state of a fresh prefill up to its boundary (fp32)."""
    PS, prompt, params, cont = _crossing(target)
    llm = target.llm(k)
    llm.reset_prefix_cache()
    if k:
        def propose(seq, n):
            right = (cont[len(seq.output_ids):] + [3] * n)[:n]
            return [t if i == 0 else (t + 1) % 100 for i, t in enumerate(right)]

        llm.engine.fix_drafts(propose)
    llm.engine.scheduler.max_num_tokens = chunk
    try:
        out = llm.generate([prompt], params)[0].token_ids
        ckpts = _checkpoints(llm, prompt + out)
    finally:
        llm.engine.scheduler.max_num_tokens = 512
        llm.reset_prefix_cache()
    assert out == cont
    assert sorted(ckpts) == [PS, 2 * PS, 3 * PS]  # the prompt's; decode / verify steps
    if k:
        assert llm.engine.spec_stats.accepted_tokens > 0
    ids = prompt + out
    for b, got in ckpts.items():
        want = _fresh_states(target, ids[:b])
        assert got.keys() == want.keys() and got
        for name in want:
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-5,
                                       atol=1e-5, msg=f"{name} at {b}")


@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_rejected_drafts_never_reach_the_cache(target, k):
    """A second request hits pages (and checkpoints) written while the first one's drafts were
    mostly rejected; its output equals a cold run's."""
    PS = PAGE_SIZE[target.arch]
    params = SamplingParams(max_tokens=PS + 8, ignore_eos=True)
    # the tiny VLM's 128-token vocabulary holds its image / video placeholders, which a prompt
    # without images may not carry (the engine refuses it): a prompt whose continuation has none
    vision = {getattr(target.llm().deployed, f"{m}_token_id", -1) for m in ("image", "video")}
    for seed in range(5, 25):
        prompt = _tokens(PS + 5, seed)
        cont = _cold(target, prompt, params)
        if not vision & set(cont[:PS]):
            break
    assert not vision & set(cont[:PS])
    second = prompt + cont[:PS] + _tokens(5, 6)
    want = _cold(target, second)
    llm = target.llm(k)
    llm.reset_prefix_cache()
    if k:
        llm.engine.fix_drafts(lambda seq, n: [(t + 1) % 100 for t in
                                              (cont[len(seq.output_ids):] + [3] * n)[:n]])
    try:
        assert llm.generate([prompt], params)[0].token_ids == cont
        if k:
            llm.engine.fix_drafts(None)
        before = _hits(llm)
        assert llm.generate([second], GREEDY)[0].token_ids == want
        assert _hits(llm) - before == 2 * PS  # the prompt's page and the output's
    finally:
        llm.reset_prefix_cache()


@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_eviction_under_a_small_cache_keeps_outputs_exact(target, k):
    """Twelve pages for three running sequences of up to five pages: cached pages are evicted
    and sequences preempted; no output changes."""
    PS = PAGE_SIZE[target.arch]
    heads = [_tokens(2 * PS + 4, 7), _tokens(2 * PS + 4, 8)]
    # NOTE: each prompt also fills a page of its own, so finished ones leave cached pages
    prompts = [heads[i % 2] + _tokens(PS + 3 + i, 10 + i) for i in range(8)]
    want = [_cold(target, p) for p in prompts]
    deployed = target.llm(k).deployed
    cls = Engine if k is None else SpecEngine
    eng = cls(deployed, max_batch_size=3, max_num_tokens=16)
    eng.blocks.free_pages = deque(range(12))
    try:
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    finally:
        target.llm(k).reset_prefix_cache()  # this engine wrote pages the LLM's engine cached
    assert [done[i] for i in ids] == want
    stats = eng.stats_dict()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evicted_pages"] > 0


@pytest.mark.parametrize("k", [None, K], ids=["plain", "spec"])
def test_hit_restores_states_then_prefills_like_a_fresh_run(target, k):
    """After a hit on 2 cached pages and the prefill of the rest, every recurrent slot holds
    what a fresh prefill of the whole prompt gives (fp32; the restore is not optional)."""
    if target.arch == "llama":
        pytest.skip("no recurrent state")
    PS = PAGE_SIZE[target.arch]
    prefix = _tokens(2 * PS + 3, 11)
    second = prefix + _tokens(6, 12)
    llm = target.llm(k)
    eng = llm.engine
    llm.reset_prefix_cache()
    try:
        llm.generate([prefix + _tokens(4, 13)], GREEDY)
        rid = eng.add_request(second, GREEDY)
        before = _hits(llm)
        eng.step()  # admission with the hit, prefill of the last 9 tokens
        assert _hits(llm) - before == 2 * PS
        seq = eng._seqs[rid]
        assert seq.num_cached == len(second)
        gm = getattr(llm.deployed, "target", llm.deployed).gm
        got = {n[: -len("_state")]: b[seq.slot].clone() for n, b in gm.named_buffers()
               if n.endswith("_state") and "spec" not in n}
        eng.abort(rid)
        eng.step()
    finally:
        llm.reset_prefix_cache()
    want = _fresh_states(target, second)
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-4, atol=1e-5,
                                   msg=name)


def test_decode_steps_crossing_checkpoint_boundaries_replay(target, monkeypatch):
    """A plain decode step whose token ends a checkpointed page replays its CPU graph and the
    state slot is copied to the checkpoint after it (deploy/runner.py `_checkpoints_after`;
    before, each such step ran eagerly): every decode step replayed, the boundaries' copies
    made, the output the cold run's (the copies' values: test_checkpoints_equal_fresh_...)."""
    from specdeploy.deploy.runner import GraphDeployed

    PS, prompt, params, cont = _crossing(target)
    llm = target.llm()
    runner = getattr(llm.deployed, "target", llm.deployed).graph_runner
    assert runner is not None
    saved = []
    real = GraphDeployed.save_states
    monkeypatch.setattr(GraphDeployed, "save_states",
                        lambda self, s, c: saved.append((s.tolist(), c.tolist())) or real(
                            self, s, c))
    llm.reset_prefix_cache()
    before = runner.replays
    try:
        out = llm.generate([prompt], params)[0].token_ids
    finally:
        llm.reset_prefix_cache()
    assert out == cont
    assert runner.replays - before == 2 * PS - 1  # every decode step (the prefill's is eager)
    assert len(saved) == 2 and all(len(s) == len(c) == 1 for s, c in saved)  # 2 PS and 3 PS
