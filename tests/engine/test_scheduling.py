"""Continuous batching, chunked prefill and preemption give the same tokens as running alone."""
from __future__ import annotations

import random

import pytest
from toy_engine import VOCAB, make_engine, run_all

from specdeploy.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _alone(prompts, params=GREEDY):
    return [run_all(make_engine(), [p], params)[0].token_ids for p in prompts]


def test_batch_equals_alone():
    prompts = _prompts(8, seed=1)
    batch = run_all(make_engine(), prompts, GREEDY)
    assert [o.token_ids for o in batch] == _alone(prompts)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in batch)


def test_chunked_prefill_identical():
    prompts = _prompts(6, seed=2, lo=10, hi=40)
    eng = make_engine(max_num_tokens=5)
    out = run_all(eng, prompts, GREEDY)
    assert [o.token_ids for o in out] == _alone(prompts)
    assert eng.stats.num_steps > 40  # prompts really went in chunks


def test_64_requests_small_cache_with_preemption():
    prompts = _prompts(64, seed=3, lo=1, hi=20)
    # 10 pages of 4 tokens: a few sequences at a time, and decode growth forces preemption.
    eng = make_engine(num_pages=10, page_size=4, max_batch_size=4, max_num_tokens=16)
    out = run_all(eng, prompts, GREEDY)
    assert [o.token_ids for o in out] == _alone(prompts)
    assert eng.stats.num_preemptions > 0
    assert len(eng.blocks.free_pages) == 10 and len(eng.blocks.free_slots) == 4


def test_seeded_sampling_survives_batching_and_preemption():
    prompts = _prompts(12, seed=4, lo=1, hi=20)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    alone = [run_all(make_engine(), [p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    eng = make_engine(num_pages=8, page_size=4, max_batch_size=3, max_num_tokens=7)
    out = run_all(eng, prompts, params)
    assert [o.token_ids for o in out] == alone
    assert eng.stats.num_preemptions > 0


def test_requests_arriving_mid_batch():
    prompts = _prompts(6, seed=5)
    eng = make_engine(max_batch_size=4)
    ids, done = [], {}
    for p in prompts:
        ids.append(eng.add_request(p, GREEDY))
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[i].token_ids for i in ids] == _alone(prompts)


def test_abort_frees_resources():
    eng = make_engine(max_batch_size=2)
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request([4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    c = eng.add_request([6], SamplingParams(max_tokens=5, ignore_eos=True))  # waits: no slot
    eng.step()
    assert eng.abort(a) and not eng.abort("nope")
    outs = {o.request_id: o for o in eng.step()}
    assert outs[a].finish_reason == "abort"
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[b].finish_reason == done[c].finish_reason == "length"
    assert len(eng.blocks.free_pages) == eng.blocks.num_pages


@pytest.mark.parametrize("prompt_len,max_tokens", [(129, 1), (120, 9)])
def test_never_fits_rejected_at_add(prompt_len, max_tokens):
    eng = make_engine(max_seq_len=128)
    with pytest.raises(ValueError, match="prompt|max_tokens"):
        eng.add_request([1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def test_bigger_than_cache_rejected():
    eng = make_engine(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([VOCAB], SamplingParams())
