"""Speculation under engine pressure: preemption, arrivals mid-batch, stop strings inside an
accepted run. Oracle: the non-speculative path."""
from __future__ import annotations

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.engine.request import SamplingParams as SP
from tests.spec.tiny_targets import LIMITS


def _oracle(baseline_by_prompt):
    def propose(seq, k):
        cont = baseline_by_prompt[tuple(seq.prompt_ids)]
        start = len(seq.output_ids)
        return (cont[start:start + k] + [3] * k)[:k]

    return propose


def test_preempting_speculating_sequences_is_lossless(target):
    prompts = target.prompts * 3
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in target.llm().generate(prompts, params)]
    # NOTE: ~24 pages of 8 tokens for up to 8 running sequences: decoding must preempt (pages
    # of 8, not the default 16 / 64: sequences must outgrow their pages often)
    tight = dict(LIMITS, max_seq_len=160, page_size=8)
    tight["max_cache_gib"] = _budget_for_tokens(target, 24 * 8 + 4)
    llm = LLM(str(target.path), spec=target.spec(3), **tight)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.stats()["num_preemptions"] > 0


def _budget_for_tokens(target, tokens) -> float:
    """A cache budget (GiB) holding the recurrent slots plus KV pages for `tokens` tokens."""
    probe = target.llm(3).deployed
    plan = probe.target.plan
    kv_per_token = sum(b for n, b in plan.bytes_by_handler.items()
                       if "kv_cache" in n) / plan.num_pages / plan.page_size
    # NOTE: prefix-cache checkpoints only take what is left after the pages: not budgeted here
    slots = sum(b for n, b in plan.bytes_by_handler.items()
                if "kv_cache" not in n and not n.endswith("_ckpt"))
    return (slots + kv_per_token * tokens) / 2**30


def test_requests_arriving_mid_batch(target):
    params = SP(max_tokens=16, ignore_eos=True)
    want = {tuple(p): o.token_ids
            for p, o in zip(target.prompts, target.llm().generate(target.prompts, params))}
    eng = target.llm(2).engine
    ids = {eng.add_request(p, params): tuple(p) for p in target.prompts[:2]}
    done = {}
    late = list(target.prompts[2:])
    while eng.has_unfinished() or late:
        if late and eng.stats.num_steps % 3 == 2:
            p = late.pop(0)
            ids[eng.add_request(p, params)] = tuple(p)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        if not eng.has_unfinished() and late:
            ids[eng.add_request(late[0], params)] = tuple(late.pop(0))
    assert {ids[r]: t for r, t in done.items()} == want


@pytest.mark.parametrize("cut", [3, 6])
def test_stop_string_inside_an_accepted_run(target, cut):
    """Forced right drafts accept whole runs; the stop string ends output mid-run, exactly where
    the non-speculative path ends it."""
    prompt = target.prompts[2]
    base = target.llm()
    full = base.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= cut + 2, "the fixed prompt's continuation must hold the stop string"
    stop = text[cut:cut + 2]
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop])
    want = base.generate([prompt], params)[0]
    llm = target.llm(5)
    llm.engine.fix_drafts(_oracle({tuple(prompt): full.token_ids}))
    got = llm.generate([prompt], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert stop not in got.text
