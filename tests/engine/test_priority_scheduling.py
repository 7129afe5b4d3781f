"""The "priority" scheduling policy (vLLM's): requests run in (priority, arrival) order, a full
cache preempts the least urgent, and the tokens are those of each request run alone. Oracles:
sorting by (priority, arrival) and the request run alone on a fresh engine."""
from __future__ import annotations

import random

import pytest
from toy_engine import VOCAB, make_engine, run_all

from specdeploy.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _alone(prompt, params=GREEDY):
    return run_all(make_engine(), [prompt], params)[0].token_ids


def _finish_order(eng, ids) -> list[str]:
    order = []
    for _ in range(10_000):
        order += [o.request_id for o in eng.step() if o.finished]
        if not eng.has_unfinished():
            break
    assert sorted(order) == sorted(ids)
    return order


def test_one_at_a_time_runs_in_priority_then_arrival_order():
    eng = make_engine(max_batch_size=1)
    eng.scheduler.set_policy("priority")
    prompts = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    prios = [3, 1, 2, 1, -4]
    ids = [eng.add_request(p, GREEDY, priority=q) for p, q in zip(prompts, prios)]
    want = [ids[i] for i in sorted(range(5), key=lambda i: (prios[i], i))]
    assert _finish_order(eng, ids) == want
    fcfs = make_engine(max_batch_size=1)  # the default keeps arrival order
    ids = [fcfs.add_request(p, GREEDY) for p in prompts]
    assert _finish_order(fcfs, ids) == ids


def _victims(eng) -> list[str]:
    seen = []
    preempt = eng.scheduler.preempt

    def record(seq):
        seen.append(seq.request_id)
        preempt(seq)

    eng.scheduler.preempt = record
    return seen


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_full_cache_preempts_the_least_urgent(policy):
    """Three sequences of 7 prompt tokens fill 6 of 7 pages (4 tokens each); decoding must
    preempt one. The first (priority 5) runs a step alone before the others arrive. FCFS: the
    newest is preempted (the third); priority: the priority-5 one, though it runs longest."""
    eng = make_engine(num_pages=7, page_size=4, max_batch_size=3, max_num_tokens=64)
    eng.scheduler.set_policy(policy)
    prompts = [[1 + i] * 7 for i in range(3)]
    prios = [5, 0, 1] if policy == "priority" else [0, 0, 0]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    victims = _victims(eng)
    ids = [eng.add_request(prompts[0], params, priority=prios[0])]
    outs = {o.request_id: o for o in eng.step() if o.finished}
    ids += [eng.add_request(p, params, priority=q) for p, q in zip(prompts[1:], prios[1:])]
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert victims and victims[0] == ids[0 if policy == "priority" else 2]
    assert [outs[i].token_ids for i in ids] == [_alone(p, params) for p in prompts]


def test_random_load_keeps_order_and_tokens():
    """40 requests of random priorities arriving through a small cache (chunked prefill,
    preemption): after every step the waiting queue and the running list are in (priority,
    arrival) order; each request's tokens are its own alone; every page and slot comes back."""
    rng = random.Random(7)
    eng = make_engine(num_pages=12, page_size=4, max_batch_size=4, max_num_tokens=9)
    eng.scheduler.set_policy("priority")
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 18))] for _ in range(40)]
    ids, done = [], {}
    for p in prompts:  # arriving while the others run, two per step
        ids.append(eng.add_request(p, GREEDY, priority=rng.randint(-2, 2)))
        if len(ids) % 2 == 0:
            done.update({o.request_id: o for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        keys = [(s.priority, s.arrival) for s in eng.scheduler.waiting]
        assert keys == sorted(keys)
        keys = [(s.priority, s.arrival) for s in eng.scheduler.running]
        assert keys == sorted(keys)
    assert eng.stats.num_preemptions > 0
    assert [done[i].token_ids for i in ids] == [_alone(p) for p in prompts]
    assert len(eng.blocks.free_pages) == 12 and len(eng.blocks.free_slots) == 4


def test_priority_needs_the_policy_and_an_integer():
    eng = make_engine()
    with pytest.raises(ValueError, match="^priority: 2 needs"):
        eng.add_request([1], GREEDY, priority=2)
    eng.add_request([1], GREEDY, priority=0)  # 0 is every request's under FCFS
    with pytest.raises(ValueError, match="^scheduling_policy: cannot change"):
        eng.scheduler.set_policy("priority")
    fresh = make_engine()
    with pytest.raises(ValueError, match="^scheduling_policy: must be one of"):
        fresh.scheduler.set_policy("lifo")
    fresh.scheduler.set_policy("priority")
    for bad in (1.5, True, "1"):
        with pytest.raises(ValueError, match="^priority: must be an integer"):
            fresh.add_request([1], GREEDY, priority=bad)


def test_llm_refuses_an_unknown_policy_before_loading(tmp_path):
    from specdeploy import LLM

    with pytest.raises(ValueError, match="^scheduling_policy"):
        LLM(str(tmp_path / "nothing-here"), scheduling_policy="random")
