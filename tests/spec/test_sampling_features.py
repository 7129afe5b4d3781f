"""Penalties, min_tokens, logit_bias, allowed_token_ids, bad_words, logprobs and grammars
(JSON, regex, choice) on a tiny Llama, with and without EAGLE-3:
the oracle is the plain (non-speculative) deployment of the same checkpoint.

Drafts come from the real (random) drafter, which gets nearly everything rejected, and from an
oracle that drafts the plain run's own future tokens with every third one wrong, so verify rows
past accepted drafts are exercised too."""
from __future__ import annotations

import json

import pytest

from specdeploy import SamplingParams
from tests.spec.tiny_targets import Target

K = 3
PENALTIES = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=-0.4)
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 6},
    "color": {"enum": ["red", "green"]}}, "required": ["ok", "name", "color"]}
LOGPROB_ATOL = 1e-4  # fp32: a verify row and a decode row differ only in summation order


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return Target("llama", tmp_path_factory.mktemp("features"))


def _oracle(ref: dict):
    def drafts(seq, k):
        n = len(seq.output_ids)
        out = ref[tuple(seq.prompt_ids)][n:n + k]
        return [t if (n + i) % 3 != 2 else (t + 1) % 100 for i, t in enumerate(out)]
    return drafts


def _both_sources(target, prompts, params):
    """Outputs of the plain deployment, then of the speculative one with its own drafter and
    with oracle drafts."""
    plain = target.llm(None).generate(prompts, params)
    spec = target.llm(K)
    own = spec.generate(prompts, params)
    spec.engine.fix_drafts(_oracle({tuple(o.prompt_token_ids): o.token_ids for o in plain}))
    spec.engine.reset_spec_stats()
    try:
        oracle = spec.generate(prompts, params)
        accepted = spec.engine.spec_stats.accepted_tokens
    finally:
        spec.engine.fix_drafts(None)
    return plain, own, oracle, accepted


def test_greedy_spec_equals_plain_with_penalties_and_min_tokens(target):
    prompts = target.prompts[:4]
    params = SamplingParams(max_tokens=24, min_tokens=6, **PENALTIES)
    plain, own, oracle, accepted = _both_sources(target, prompts, params)
    assert accepted > 0
    for p, a, b in zip(plain, own, oracle):
        assert a.token_ids == p.token_ids and b.token_ids == p.token_ids
    unpenalized = target.llm(None).generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in unpenalized] != [o.token_ids for o in plain]


def test_greedy_spec_equals_plain_with_logit_bias_and_allowed_token_ids(target):
    """The plain run's tokens are the oracle's; a forced token (+100) and the allowed set hold
    on every token, drafted or not."""
    prompts = target.prompts[:4]
    free = target.llm(None).generate(prompts, SamplingParams(max_tokens=20))
    first = free[0].token_ids[0]
    allowed = sorted({t for o in free for t in o.token_ids[:6]} | {first + 1})[:5]
    params = SamplingParams(max_tokens=20, logit_bias={first: -100.0, allowed[-1]: 3.0},
                            allowed_token_ids=allowed, repetition_penalty=1.3)
    plain, own, oracle, accepted = _both_sources(target, prompts, params)
    assert accepted > 0
    for p, a, b in zip(plain, own, oracle):
        assert a.token_ids == p.token_ids and b.token_ids == p.token_ids
        assert set(p.token_ids) <= set(allowed) and first not in p.token_ids
    forced = target.llm(K).generate(prompts[:2], SamplingParams(max_tokens=8,
                                                                logit_bias={first: 100.0}))
    assert all(o.token_ids == [first] * 8 for o in forced)


def test_greedy_spec_equals_plain_with_bad_words(target):
    """Two-character words made of the free run's tokens (the tiny tokenizer: a printable
    character a token) never appear as tokens in the output; drafts or not, the tokens are
    plain's."""
    from specdeploy.engine.logits_process import bad_word_ids

    prompts = target.prompts[:3]
    llm = target.llm(None)
    free = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    chars = range(3, 3 + 95)  # ' ' .. '~'
    pairs = {(a, b) for o in free for a, b in zip(o.token_ids, o.token_ids[1:])
             if a in chars and b in chars and a != 3}  # no leading blank: stripped
    words = [llm.tokenizer.decode(list(p)) for p in sorted(pairs)[:6]]
    banned = bad_word_ids(llm.tokenizer, words)
    assert words and all(len(w) == 2 for w in banned)
    params = SamplingParams(max_tokens=24, ignore_eos=True, bad_words=words)
    plain, own, oracle, accepted = _both_sources(target, prompts, params)
    for p, a, b in zip(plain, own, oracle):
        assert a.token_ids == p.token_ids and b.token_ids == p.token_ids
        assert not set(zip(p.token_ids, p.token_ids[1:])) & set(banned), words
    assert [o.token_ids for o in plain] != [o.token_ids for o in free]


def test_logprobs_under_speculation_equal_plain(target):
    prompts = target.prompts[:3]
    params = SamplingParams(max_tokens=16, logprobs=3, **PENALTIES)
    plain, own, oracle, _ = _both_sources(target, prompts, params)
    for p in plain:
        assert len(p.logprobs) == len(p.token_ids)
        for t, entry in zip(p.token_ids, p.logprobs):
            assert t in entry and 3 <= len(entry) <= 4
            top = list(entry.values())[:3]
            assert top == sorted(top, reverse=True)
    for out in (own, oracle):
        for p, s in zip(plain, out):
            assert s.token_ids == p.token_ids
            for a, b in zip(p.logprobs, s.logprobs):
                assert list(a)[:3] == list(b)[:3]
                assert all(abs(a[t] - b[t]) < LOGPROB_ATOL for t in a)


def test_min_tokens_holds_back_stop_tokens(target):
    prompt = target.prompts[1]
    first = target.llm(None).generate(prompt, SamplingParams(max_tokens=8))[0].token_ids[0]
    stop = SamplingParams(max_tokens=12, stop_token_ids=[first])
    assert target.llm(None).generate(prompt, stop)[0].token_ids == [first]
    held = SamplingParams(max_tokens=12, stop_token_ids=[first], min_tokens=5)
    for llm in (target.llm(None), target.llm(K)):
        out = llm.generate(prompt, held)[0]
        assert len(out.token_ids) >= 5 and first not in out.token_ids[:4]


def _valid(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"ok", "name", "color"}
            and isinstance(doc["ok"], bool) and isinstance(doc["name"], str)
            and len(doc["name"]) <= 6 and doc["color"] in ("red", "green"))


@pytest.mark.parametrize("k", [None, K])
def test_json_schema_output_parses_and_validates(target, k):
    llm = target.llm(k)
    prompts = target.prompts[:3]
    for params in (SamplingParams(max_tokens=80, guided_json=SCHEMA),
                   SamplingParams(max_tokens=80, guided_json=SCHEMA, temperature=1.0, seed=5)):
        for out in llm.generate(prompts, params):
            assert out.finish_reason == "stop", out.text
            assert _valid(json.loads(out.text)), out.text
    greedy = SamplingParams(max_tokens=80, guided_json=SCHEMA)
    if k is not None:  # lossless under the grammar too
        plain = target.llm(None).generate(prompts, greedy)
        assert [o.text for o in llm.generate(prompts, greedy)] == [o.text for o in plain]
    obj = llm.generate(prompts[0], SamplingParams(max_tokens=120, json_object=True,
                                                  temperature=1.0, seed=1))[0]
    if obj.finish_reason == "stop":  # a random model may run out of tokens inside a string
        assert isinstance(json.loads(obj.text), dict)
    assert obj.text.startswith("{")


@pytest.mark.parametrize("k", [None, K])
def test_regex_and_choice_outputs_match(target, k):
    """guided_regex: the whole output matches (re.fullmatch, Python's engine, not the grammar
    library's); guided_choice: the output is one of the strings (metacharacters escaped).
    Greedy and sampled; with drafts, greedy equals plain."""
    import re

    llm = target.llm(k)
    prompts = target.prompts[:3]
    regex = r"[a-c]{2,4}-(x|yz)[0-9]"
    choices = ["a.b", "(c)", "d|e*"]
    for extra in ({}, {"temperature": 1.0, "seed": 3}):
        for out in llm.generate(prompts, SamplingParams(max_tokens=12, guided_regex=regex,
                                                        **extra)):
            assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
        for out in llm.generate(prompts, SamplingParams(max_tokens=8, guided_choice=choices,
                                                        **extra)):
            assert out.finish_reason == "stop" and out.text in choices, out.text
    if k is not None:
        for p in (SamplingParams(max_tokens=12, guided_regex=regex),
                  SamplingParams(max_tokens=8, guided_choice=choices)):
            plain = target.llm(None).generate(prompts, p)
            assert [o.text for o in llm.generate(prompts, p)] == [o.text for o in plain]
