"""One sequence's failure (sampling, detokenizing) finishes it alone with "error"; the others
in the same batch produce exactly their solo outputs, and the `LLM` stays usable."""
from __future__ import annotations

import pytest

import specdeploy.engine.sample_rows as sample_mod
from specdeploy import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Hello there", "abc abc abc", "Once upon a time"]
POISON_SEED = 666  # the sampling params of the sequence whose sampling we break


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from specdeploy.models.registry import family_module

    ckpt = family_module("llama").make_tiny(tmp_path_factory.mktemp("iso") / "ckpt", seed=0)
    return LLM(ckpt, dtype="float32", max_batch_size=8, max_seq_len=128)


def _params():
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    return [greedy, seeded, greedy, seeded]


def _solo(llm):
    return [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, _params())]


def test_sampling_failure_fails_one_sequence_only(llm, monkeypatch):
    solo = _solo(llm)
    real = sample_mod.sample
    calls = {"n": 0}

    def flaky(logits, params, gens, default=None):
        if any(p.seed == POISON_SEED for p in params):
            calls["n"] += 1
            if calls["n"] >= 3:  # after a few good tokens, mid-stream
                raise ValueError("injected sampling failure")
        return real(logits, params, gens, default)

    monkeypatch.setattr(sample_mod, "sample", flaky)
    poison = SamplingParams(max_tokens=12, temperature=0.5, seed=POISON_SEED, ignore_eos=True)
    outs = llm.generate(PROMPTS + ["poisoned prompt"], _params() + [poison])
    for out, ref in zip(outs[:4], solo):
        assert (out.text, out.token_ids, out.finish_reason) == (
            ref.text, ref.token_ids, ref.finish_reason)
    bad = outs[4]
    assert bad.finish_reason == "error" and "injected sampling failure" in bad.error
    assert 0 < len(bad.token_ids) < 12
    eng = llm.engine
    assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.num_pages
    assert eng.stats.num_errors >= 1
    monkeypatch.setattr(sample_mod, "sample", real)
    assert [o.token_ids for o in _solo(llm)] == [r.token_ids for r in solo]  # still usable


def test_detokenizer_failure_fails_one_sequence_only(llm, monkeypatch):
    solo = _solo(llm)
    eng = llm.engine
    real_add = eng.add_request

    def add(prompt_ids, params=None, request_id=None, **kw):
        rid = real_add(prompt_ids, params, request_id, **kw)
        if params is not None and params.seed == POISON_SEED:
            seq = eng._seqs[rid]

            def broken(token_id):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            seq.detok.add = broken
        return rid

    monkeypatch.setattr(eng, "add_request", add)
    poison = SamplingParams(max_tokens=12, seed=POISON_SEED, ignore_eos=True)
    outs = llm.generate(PROMPTS + ["poisoned"], _params() + [poison])
    assert [o.text for o in outs[:4]] == [r.text for r in solo]
    assert outs[4].finish_reason == "error" and "UnicodeDecodeError" in outs[4].error
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_failed_step_leaves_llm_usable(llm, monkeypatch):
    """A step that raises (not attributable to one sequence) propagates, but leaves nothing
    queued: the next generate() runs normally (was: every later call raised again)."""
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6))[0]
    real = llm.deployed.forward
    monkeypatch.setattr(llm.deployed, "forward", lambda meta: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=6))
    monkeypatch.setattr(llm.deployed, "forward", real)
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=6))[0].token_ids == ref.token_ids


def test_hostile_sampling_values_refused_by_engine(llm):
    """The probe's cases: refused with the field named, never run; the LLM keeps working."""
    vocab = llm.engine.deployed.vocab_size
    with pytest.raises(ValueError, match="top_k"):
        llm.generate("hi", SamplingParams(top_k=vocab + 1, temperature=0.7))
    for kw in ({"top_k": 10**30, "temperature": 0.7}, {"temperature": 1e-45},
               {"temperature": 1e-300}, {"temperature": float("nan")},
               {"temperature": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    ok = SamplingParams(top_k=vocab, temperature=1e-5, max_tokens=6)
    greedy = llm.generate("hello", SamplingParams(max_tokens=6))[0]
    assert llm.generate("hello", ok)[0].token_ids == greedy.token_ids  # tiny t ~ greedy
