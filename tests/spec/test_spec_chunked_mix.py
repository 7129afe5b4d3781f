"""Speculation mixed with chunked prefill in the same step: while one request speculates (its
verify segment carries K drafts), another request's long prompt is prefilled in chunks under a
small token budget, in the same forwards. Greedy output must equal the non-speculative path's,
token for token, on every architecture (oracle: the same deployment without a drafter)."""
from __future__ import annotations

import pytest

from specdeploy import SamplingParams
from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL

K = 3
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _run(llm, early: list[int], late: list[int], budget: int):
    """`early` decodes first; `late` arrives once `early` speculates. Returns both outputs and
    the number of steps that carried a verify segment and a mid-prompt chunk together."""
    eng = llm.engine
    sched = eng.scheduler
    mixed = [0]
    segments = eng._segments

    def spy(batch):
        segs = segments(batch)
        # a prompt chunk: a NORMAL segment of several tokens (decode rows feed one)
        if any(s.kind == SEG_EXTEND for s in segs) and any(
                s.kind == SEG_NORMAL and len(s.token_ids) > 1 for s in segs):
            mixed[0] += 1
        return segs

    eng._segments = spy
    old = sched.max_num_tokens
    sched.max_num_tokens = budget
    try:
        a = eng.add_request(early, GREEDY)
        out: dict[str, list[int]] = {}
        for _ in range(4):  # prefill + first verify steps of `early`
            for o in eng.step():
                out[o.request_id] = o.token_ids
        b = eng.add_request(late, GREEDY)
        for _ in range(400):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                out[o.request_id] = o.token_ids
        assert not eng.has_unfinished()
    finally:
        sched.max_num_tokens = old
        eng._segments = segments
    return out[a], out[b], mixed[0]


def test_spec_with_chunked_prefill_of_another_request(target):
    early, late = target.prompts[1], target.prompts[3]  # 7 and 100 tokens
    plain = target.llm()
    want = [o.token_ids for o in plain.generate([early, late], GREEDY)]
    llm = target.llm(K)
    llm.reset_prefix_cache()
    # room for a verify segment and a page of the prompt: a recurrent target's prompt chunks
    # end on page boundaries (engine/scheduler.py)
    page = llm.engine.blocks.page_size
    got_a, got_b, mixed = _run(llm, early, late, budget=K + 1 + page)
    llm.reset_prefix_cache()
    assert [got_a, got_b] == want
    # the 100-token prompt took several chunks while the other request verified drafts
    assert mixed >= min(3, -(-len(late) // page)), mixed  # (2 pages of 64 on Qwen3.5)


def test_a_budget_under_a_page_is_warned(target, caplog):
    """A recurrent target's prompt chunks end on page boundaries only if the budget holds a
    page: under one, the engine says what that costs."""
    import logging

    from specdeploy import LLM
    from tests.spec.tiny_targets import LIMITS, PAGE_SIZE

    if target.arch != "nemotron_h":
        pytest.skip("one hybrid and the attention-only target are enough")
    with caplog.at_level(logging.WARNING, logger="specdeploy.engine"):
        llm = LLM(str(target.path), max_num_tokens=PAGE_SIZE["nemotron_h"] - 1, **LIMITS)
    assert "under a page" in caplog.text
    llm.shutdown()
