"""method="suffix": n-gram lookup plus a store of replies (engine/suffix_store.py), no drafter
model, on every tiny target (Llama, NemotronH, Qwen3.5-MoE). Oracle: the non-speculative path
of the same deployment code."""
from __future__ import annotations

import json

import pytest

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.engine.spec_accept import store_bucket
from specdeploy.engine.spec_control import CostController, cut_drafts
from specdeploy.engine.spec_cost import MeasuredCost
from specdeploy.engine.suffix_store import SuffixStore
from tests.spec.cost_models import Linear
from tests.spec.tiny_targets import LIMITS

MAX_TOKENS = 24


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def replies(target):
    """The target's own greedy replies to its prompts: what a store built from its replies
    to training prompts holds, here for the very prompts the tests ask again."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return _ids(target.llm().generate(target.prompts, params))


@pytest.fixture(scope="module")
def store_dir(target, replies, tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / target.arch
    vocab = target.llm().deployed.vocab_size
    SuffixStore.save(path, replies, vocab)
    return path


def test_suffix_greedy_equals_plain_and_drafts_from_the_store(target, replies, store_dir):
    """The store's drafts (the target's own replies) are accepted, and the tokens are the
    non-speculative path's; with the controller off every store match is verified."""
    llm = LLM(str(target.path), spec=SpecConfig("suffix", 3, suffix_store=str(store_dir),
                                                suffix_decoding_max_cached_requests=0,
                                                controller="off"), **LIMITS)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _ids(llm.generate(target.prompts, params)) == replies
    s = llm.stats()
    assert s["store_steps"] > 0 and s["store_accepted_tokens"] > s["store_steps"]
    assert s["mean_accepted_length"] > 2
    assert llm.deployed.drafter is None
    assert f"suffix store: {sum(map(len, replies))} tokens loaded" in llm.deployed.report()
    # batch 1, one prompt at a time: the same
    assert _ids(llm.generate([target.prompts[3]], params)) == [replies[3]]


def test_suffix_learns_from_finished_requests(target, replies):
    """No corpus: the first answer teaches the store, so asking again drafts from it; the
    output stays the plain path's either way."""
    llm = LLM(str(target.path), spec=SpecConfig("suffix", 3, suffix_store=None,
                                                controller="off"), **LIMITS)
    assert llm.deployed.suffix_corpus is None  # nothing is shipped for a tiny target
    assert "suffix store: no corpus" in llm.deployed.report()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = target.prompts[2]
    assert _ids(llm.generate([prompt], params)) == [replies[2]]
    first = llm.stats()
    assert _ids(llm.generate([prompt], params)) == [replies[2]]
    second = llm.stats()
    assert second["store_accepted_tokens"] > first["store_accepted_tokens"]
    # lookup (the prompt and reply so far) and the store together: most tokens come drafted
    assert second["accepted_tokens"] - first["accepted_tokens"] >= MAX_TOKENS // 2
    assert llm.engine.store.num_tokens == 2 * MAX_TOKENS


def test_suffix_sampling_is_seeded_and_follows_the_target(target, store_dir):
    """Sampled requests verify store drafts by rejection sampling (q one-hot): a seed gives
    the same tokens twice, and temperature near 0 gives the greedy tokens."""
    llm = LLM(str(target.path), spec=SpecConfig("suffix", 3, suffix_store=str(store_dir),
                                                suffix_decoding_max_cached_requests=0,
                                                controller="off"), **LIMITS)

    def run(seed, temperature=1.0):
        p = SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)
        return llm.generate([target.prompts[1]], p)[0].token_ids

    assert run(3) == run(3)
    assert len({tuple(run(s)) for s in range(4)}) > 1
    cold = run(0, temperature=1e-4)
    plain = target.llm().generate([target.prompts[1]], SamplingParams(
        max_tokens=12, ignore_eos=True))[0].token_ids
    assert cold == plain
    assert llm.stats()["store_steps"] > 0


def test_suffix_with_a_drafter_and_the_controller(target, replies, store_dir):
    """The store behind lookup behind the method's own drafter, the cost controller on (over a
    synthetic cost model where a row costs little): lossless."""
    spec = SpecConfig(target.method, 3, draft_model=None if target.draft_model is None
                      else str(target.draft_model), suffix_store=str(store_dir),
                      suffix_decoding_max_cached_requests=0, controller="off")
    assert spec.prompt_lookup_max == 4  # a store turns lookup on
    llm = LLM(str(target.path), spec=spec, **LIMITS)
    llm.engine.set_controller(CostController(Linear(1.0, 0.05, 0.25), 3, llm.engine.max_k,
                                             probe_every=0))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _ids(llm.generate(target.prompts, params)) == replies
    assert llm.stats()["store_steps"] > 0


def test_controller_prices_store_drafts_by_their_estimate():
    ctl = CostController(Linear(1.0, 0.05, 0.25), 3, 6, drafter=False, probe_every=0)

    class Seq:
        class spec:
            drafts = [1, 2, 3]
            store_conf = [0.95, 0.25, 0.05]
            lookup_copy = 0
            from_lookup = True
            draft_probs = None
            control = None
            limit = None

    seq = Seq()
    acc = ctl.seq_lookup_acc(seq, 3)
    assert acc == [ctl.store_hold[store_bucket(c)] for c in (0.95, 0.25, 0.05)]
    assert acc[0] > 0.7 and acc[2] < 0.15
    # a verify that accepted the first and rejected the second teaches those two buckets
    before = list(ctl.store_hold)
    ctl.observe(seq, 1, 3, True)
    assert ctl.store_hold[store_bucket(0.95)] > before[store_bucket(0.95)]
    assert ctl.store_hold[store_bucket(0.25)] < before[store_bucket(0.25)]
    assert ctl.store_hold[store_bucket(0.05)] == before[store_bucket(0.05)]
    assert ctl.hold == list(CostController(Linear(1.0, 0.05, 0.25), 3, 6).hold)  # copies untaught
    # cutting drafts cuts their estimates with them (drafter drafts first, store drafts last)
    st = type("St", (), {})()
    st.drafts, st.store_conf, st.draft_probs, st.from_lookup = [9, 1, 2, 3], [0.9, 0.8, 0.7], \
        None, True
    cut_drafts(st, 2)
    assert st.drafts == [9, 1] and st.store_conf == [0.9]
    cut_drafts(st, 1)
    assert st.drafts == [9] and st.store_conf == []


def test_suffix_config_and_errors(tmp_path):
    s = SpecConfig("suffix")
    assert (s.suffix_store, s.prompt_lookup_max, s.uses_store) == ("shipped", 4, True)
    assert s.suffix_decoding_min_token_prob == 0.1
    assert not SpecConfig("ngram").uses_store
    v = SpecConfig.from_dict({"method": "suffix", "num_speculative_tokens": 5,
                              "suffix_decoding_max_cached_requests": 0,
                              "suffix_decoding_min_token_prob": 0.3})
    assert (v.num_draft_tokens, v.suffix_decoding_max_cached_requests,
            v.suffix_decoding_min_token_prob) == (5, 0, 0.3)
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig("suffix", draft_model="somewhere")
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        SpecConfig("suffix", suffix_decoding_min_token_prob=1.5)
    with pytest.raises(ValueError, match="suffix_decoding_max_cached_requests"):
        SpecConfig("suffix", suffix_decoding_max_cached_requests=-1)
    with pytest.raises(ValueError, match="suffix_store"):
        SpecConfig("suffix", suffix_store="")


def test_suffix_store_errors_name_the_path(target, tmp_path):
    with pytest.raises(ValueError, match="not a suffix store directory"):
        LLM(str(target.path), spec=SpecConfig("suffix", suffix_store=str(tmp_path)), **LIMITS)
    SuffixStore.save(tmp_path / "other", [[1, 2, 3]], 5)
    with pytest.raises(ValueError, match="vocabulary of 5 tokens"):
        LLM(str(target.path), spec=SpecConfig("suffix", suffix_store=str(tmp_path / "other")),
            **LIMITS)


def test_suffix_store_cli(tmp_path, capsys):
    """`specdeploy suffix-store` encodes gen-drafter-data's replies with the target's tokenizer
    and writes a store `load` reads; a bad record is named by line."""
    from specdeploy.cli import main
    from specdeploy.default_model import default_model_path
    from specdeploy.tokenizer import load_tokenizer

    replies = ["Sure! Here is a list:\n1. apples\n2. pears", "Hello there."]
    f = tmp_path / "self.jsonl"
    f.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": r}]}) + "\n"
        for i, r in enumerate(replies)))
    assert main(["suffix-store", "--replies", str(f), "--out", str(tmp_path / "st")]) == 0
    assert "2 replies" in capsys.readouterr().out
    tok = load_tokenizer(default_model_path())
    ids = tok.encode(replies[0])
    store = SuffixStore.load(tmp_path / "st", 49152)
    assert store.next_token(ids[:2])[0] == ids[2]
    # several files: read in order, --max-tokens over all of them
    g = tmp_path / "more.jsonl"
    g.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "Goodbye now."}]})
                 + "\n")
    assert main(["suffix-store", "--replies", str(f), str(g), "--out", str(tmp_path / "st3")]) == 0
    assert "3 replies" in capsys.readouterr().out
    cap = len(ids) + len(tok.encode(replies[1]))
    assert main(["suffix-store", "--replies", str(f), str(g), "--out", str(tmp_path / "st4"),
                 "--max-tokens", str(cap)]) == 0
    assert "2 replies" in capsys.readouterr().out
    f.write_text(f.read_text() + '{"messages": []}\n')
    assert main(["suffix-store", "--replies", str(f), "--out", str(tmp_path / "st2")]) == 2
    assert "line 3" in capsys.readouterr().err


class _Seq:
    class spec:
        control = None
        drafts = ()
        from_lookup = False


def test_controller_skips_asking_the_store_until_a_probe_is_due():
    """Where a verify row costs more than an even bet wins (here a row costs as much as a whole
    step, break-even 1.0), after a step whose lookup / store drafts were all cut, the store is
    not asked (host time a cut would throw away) until the next probe is due; with no cut it is
    always asked."""
    ctl = CostController(Linear(0.0, 1.0, 0.25), 3, 6, drafter=False, probe_every=4)
    seq = _Seq()
    ctl.cut([seq])
    assert ctl.break_even(1) == pytest.approx(1.0) and not ctl.store_free
    assert all(ctl.wants_store(seq) for _ in range(5))  # nothing cut yet
    c = ctl.state(seq)
    c.idle_lookup, c.gap_lookup = 1, 4  # one step cut to none
    assert [ctl.wants_store(seq) for _ in range(3)] == [False, False, True]
    assert c.idle_lookup == 3  # the skips counted: the controller's cut then probes
    off = CostController(Linear(0.0, 1.0, 0.25), 3, 6, drafter=False, probe_every=0)
    off.state(seq).idle_lookup = 5
    assert off.wants_store(seq)


def test_the_store_is_asked_every_step_where_an_even_bet_pays_a_row():
    """One more verify row pays from acceptance B * (t(B + 1) / t(B) - 1) on: with a row at 5%
    of the fixed cost that is 0.05 / 1.05 at batch 1 (< 0.5): the store is asked even right
    after a cut to none. At 16 sequences it is 16 * 0.05 / 1.8 = 0.44, still asked; with a row
    at 10% (16 * 0.1 / 2.6 = 0.62) the asks are gated again."""
    ctl = CostController(Linear(1.0, 0.05, 0.25), 3, 6, drafter=False, probe_every=4)
    seq = _Seq()
    ctl.cut([seq])
    assert ctl.break_even(1) == pytest.approx(0.05 / 1.05, rel=1e-12) and ctl.store_free
    c = ctl.state(seq)
    c.idle_lookup, c.gap_lookup = 1, 4
    assert all(ctl.wants_store(seq) for _ in range(5))
    ctl.cut([_Seq() for _ in range(16)])
    assert ctl.break_even(16) == pytest.approx(16 * 0.05 / 1.8, rel=1e-12) and ctl.store_free
    dear = CostController(Linear(1.0, 0.1, 0.25), 3, 6, drafter=False, probe_every=4)
    dear.cut([_Seq() for _ in range(16)])
    assert dear.break_even(16) == pytest.approx(16 * 0.1 / 2.6, rel=1e-12)
    assert not dear.store_free
    c = dear.state(seq)
    c.idle_lookup, c.gap_lookup = 1, 4
    assert not dear.wants_store(seq)


def test_break_even_reads_the_calibration_table():
    """A learnt model that saw a 17-row step cheaper than the 16-row ones (early in a wave)
    prices the 17th row at nothing; the break-even acceptance comes from the table, where
    every row count was timed alike: 16 * (13 / 12 - 1)."""
    m = MeasuredCost({16: 12.0, 17: 13.0, 32: 21.0}, {}, alpha=0.5)
    for rows, s in ((16, 9.0), (16, 18.0), (17, 9.0), (17, 15.0)):
        m.observe(rows, s)  # (the first at each row count: a warm-up)
    assert m.target_s(17) == m.target_s(16)
    c = CostController(m, 3, 6, drafter=False)
    assert c.break_even(16) == pytest.approx(16 * (13.0 / 12.0 - 1), rel=1e-12)
    c.cut([_Seq() for _ in range(16)])
    assert not c.store_free
