"""Logits processing against naive references: the penalties (vLLM's formulas, one row and one
token at a time, counting the drafts before each verify row), min_tokens, min_p, the packed
logprobs, and the JSON grammar's masks and draft walk."""
from __future__ import annotations

import json
import math

import pytest
import torch

from specdeploy.engine.logits_process import logprob_pack, process, unpack_logprobs
from specdeploy.engine.request import SamplingParams, Sequence
from specdeploy.engine.sampler import _filter_min_p, filter_logits

V = 40
EOS = frozenset({2})


def _seq(prompt, out, **kw) -> Sequence:
    s = Sequence(prompt, SamplingParams(max_tokens=64, **kw), None)
    s.output_ids = list(out)
    return s


def _penalized_ref(row: list[float], prompt: list[int], generated: list[int],
                   p: SamplingParams, eos) -> list[float]:
    """vLLM's order on one row: allowed_token_ids and logit_bias, then repetition over prompt +
    generated, then frequency and presence over generated, then min_tokens bans the stop
    tokens."""
    out = list(row)
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(out)]
    for t, b in dict(p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in generated:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else \
                out[t] * p.repetition_penalty
        c = generated.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    if len(generated) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = -math.inf
    return out


def test_penalties_match_the_naive_reference_on_every_verify_row():
    g = torch.Generator().manual_seed(0)
    seqs = [
        _seq([3, 4, 5, 5], [6, 7, 6], repetition_penalty=1.7, frequency_penalty=0.4,
             presence_penalty=-0.3),
        _seq([9], [], repetition_penalty=0.6, min_tokens=3, stop_token_ids=[11]),
        _seq([1, 2, 3], [2, 8], frequency_penalty=-1.5, min_tokens=4, ignore_eos=True),
        _seq([12, 13], [13, 13, 14]),  # no penalties: must pass through untouched
    ]
    drafts = [[6, 9, 9], [11], [], [5, 5, 5]]
    r = 4
    logits = torch.randn(len(seqs), r, V, generator=g) * 3
    got = process(logits, seqs, drafts, EOS).logits
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        for j in range(len(d) + 1):  # rows past them are padding (never read)
            gen = seq.output_ids + d[:j]
            ref = _penalized_ref(logits[i, j].tolist(), seq.prompt_ids, gen, seq.params, EOS)
            assert torch.allclose(got[i, j], torch.tensor(ref), atol=1e-5), (i, j)
    assert torch.equal(got[3], logits[3])


def test_logit_bias_and_allowed_token_ids_match_the_naive_reference():
    """Before the penalties (a biased positive logit is then divided by the repetition
    penalty), on every verify row; a row left with nothing falls back to the raw logits."""
    g = torch.Generator().manual_seed(1)
    seqs = [
        _seq([3, 4], [6], logit_bias={6: 5.0, 7: -100.0, 30: 2.5}, repetition_penalty=1.5),
        _seq([9], [10], allowed_token_ids=[2, 10, 11, 39], logit_bias={11: 1.0},
             frequency_penalty=0.5),
        _seq([1], [], allowed_token_ids=[2], min_tokens=2),  # only EOS allowed, EOS banned
        _seq([12], [13]),
    ]
    drafts = [[7, 6], [11, 10], [], [5]]
    logits = torch.randn(len(seqs), 3, V, generator=g) * 3
    got = process(logits, seqs, drafts, EOS)
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        for j in range(len(d) + 1):
            gen = seq.output_ids + d[:j]
            ref = torch.tensor(_penalized_ref(logits[i, j].tolist(), seq.prompt_ids, gen,
                                              seq.params, EOS))
            if i == 2:  # nothing left: the raw row
                assert torch.isinf(ref).all() and torch.equal(got.logits[i, j], logits[i, j])
                continue
            assert torch.allclose(got.logits[i, j], ref, atol=1e-5), (i, j)
    assert torch.equal(got.raw, logits)  # raw logprobs: before bias and mask (vLLM's raw)
    assert SamplingParams(logit_bias={5: 1, 2: -3}).logit_bias == ((2, -3.0), (5, 1.0))


def test_bad_words_ban_a_last_token_after_its_prefix_on_every_verify_row():
    """Naive reference: on row j, a word's last token is banned where output + drafts[:j]
    ends with its other tokens (a one-token word everywhere); nothing else changes."""
    g = torch.Generator().manual_seed(2)
    seqs = [_seq([1], [5, 6], bad_words=["x"]), _seq([1], [7], bad_words=["y"]), _seq([1], [])]
    seqs[0].bad_words_ids = [(6, 7), (9,), (5, 6, 8)]
    seqs[1].bad_words_ids = [(7, 7, 3)]
    drafts = [[7, 5, 6], [7, 1], []]
    logits = torch.randn(3, 4, V, generator=g)
    got = process(logits, seqs, drafts, EOS).logits
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        for j in range(4):
            gen = seq.output_ids + d[:j]
            ref = logits[i, j].clone()
            for w in seq.bad_words_ids:
                if len(gen) >= len(w) - 1 and tuple(gen[len(gen) - len(w) + 1:]) == w[:-1]:
                    ref[w[-1]] = -math.inf
            assert torch.equal(got[i, j], ref), (i, j)
    assert torch.isinf(got[0, 0, 7]) and torch.isinf(got[0, 0, 8])
    assert torch.isinf(got[0, :, 9]).all()
    assert not torch.isinf(got[0, 1, 7]) and torch.isinf(got[1, 1, 3])


def test_bad_word_ids_spellings():
    """As written (leading blanks stripped), and after a space only where that spelling starts
    with another token and is as long (vLLM's rule)."""
    from specdeploy.engine.logits_process import bad_word_ids

    class Tok:
        ids = {"hello": [5, 6], " hello": [7, 6], "bye": [8], " bye": [9, 10], "x": [11],
               " x": [11]}

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return self.ids[text]

    assert bad_word_ids(Tok(), [" hello", "bye", "x"]) == [(5, 6), (7, 6), (8,), (11,)]


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"), (dict(logit_bias="x"), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids"),
    (dict(bad_words="x"), "bad_words"), (dict(bad_words=[" "]), "bad_words"),
])
def test_bad_logit_bias_and_allowed_ids_name_their_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_min_tokens_bans_stops_until_reached():
    seq = _seq([5], [7, 8], min_tokens=4, stop_token_ids=[9])
    logits = torch.zeros(1, 4, V)
    got = process(logits, [seq], [[1, 2, 3]], EOS).logits[0]
    # rows 0, 1: 2 and 3 tokens generated (< 4): EOS and 9 banned; rows 2, 3: allowed
    assert torch.isinf(got[:2, [2, 9]]).all() and torch.isfinite(got[2:]).all()
    assert torch.isfinite(got[:, [0, 1, 3]]).all()


def test_min_p_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 2
    min_p = torch.tensor([0.0, 0.1, 0.5])
    got = _filter_min_p(logits, min_p)
    for i in range(3):
        probs = [math.exp(x) for x in logits[i].tolist()]
        top = max(probs)
        for t in range(V):
            assert math.isinf(got[i, t]) == (probs[t] < min_p[i] * top), (i, t)
    params = [SamplingParams(temperature=1.0, min_p=m) for m in (0.0, 0.1, 0.5)]
    assert torch.equal(filter_logits(logits, params), got)


def test_logprob_pack_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(2, 3, V, generator=g)
    tokens = torch.tensor([[1, 5, 7], [0, 39, 2]])
    pack = logprob_pack(raw, tokens, 4).tolist()
    ref = raw.log_softmax(-1)
    for i in range(2):
        for j in range(3):
            d = unpack_logprobs(pack[i][j], 4, 3, int(tokens[i, j]))
            top = ref[i, j].topk(3)
            assert list(d)[:3] == top.indices.tolist()  # best first
            for t, lp in d.items():
                assert abs(lp - float(ref[i, j, t])) < 1e-6


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from specdeploy.checkpoint.tiny import write_tiny_tokenizer
    from specdeploy.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d, 128)
    return load_tokenizer(d)


def test_grammar_masks_walks_and_ends_with_eos(tiny_tokenizer):
    from specdeploy.engine.grammar import GrammarCompiler, Matcher, unpack_bitmask

    tok = tiny_tokenizer
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                         "required": ["ok"]})
    g = GrammarCompiler(tok, 130, [2]).compile(schema)  # 2 model-only ids past the tokenizer
    m = Matcher(g)
    doc = tok.encode('{"ok":true}', add_special_tokens=False)
    states = m.walk(doc + tok.encode("x", add_special_tokens=False) + doc)
    assert len(states) == len(doc) + 1  # the walk stops at the first forbidden token
    allowed = unpack_bitmask(g.bitmask(m.state), 130)
    assert allowed.tolist() == [t == tok.token_to_id("{") for t in range(130)]
    for t in doc:
        m.advance(t)
    end = unpack_bitmask(g.bitmask(m.state), 130)
    assert end.nonzero().flatten().tolist() == [2]  # only EOS once the object is closed
    with pytest.raises(ValueError):
        Matcher(g).advance(tok.token_to_id("x"))
    # the drafts' rows: each row's mask is the state after the drafts before it
    seq = _seq([5], [], guided_json=schema)
    seq.matcher = Matcher(g)
    logits = torch.zeros(1, 3, 130)
    raw = process(logits, [seq], [doc[:2]], EOS).raw[0]
    for j in range(3):
        want = unpack_bitmask(g.bitmask(states[j]), 130)
        assert torch.equal(torch.isfinite(raw[j]), want)


def test_a_grammar_that_must_end_wins_over_min_tokens(tiny_tokenizer):
    from specdeploy.engine.grammar import GrammarCompiler, Matcher

    tok = tiny_tokenizer
    g = GrammarCompiler(tok, 128, [2]).compile(json.dumps({"type": "boolean"}))
    seq = _seq([5], [], guided_json=json.dumps({"type": "boolean"}), min_tokens=10)
    seq.matcher = Matcher(g)
    for t in tok.encode("true", add_special_tokens=False):
        seq.matcher.advance(t)
    got = process(torch.zeros(1, 1, 128), [seq], [[]], EOS).logits[0, 0]
    assert torch.isfinite(got).nonzero().flatten().tolist() == [2]  # EOS, the only way on
