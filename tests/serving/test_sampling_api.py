"""The sampling features through the official `openai` client, on a plain and an EAGLE-3 server
of the same tiny Llama: logprobs (spec equal to plain), n > 1, penalties, min_tokens,
logit_bias, allowed_token_ids, bad_words and structured output (response_format json_schema /
json_object, vLLM's structured_outputs, guided_regex and guided_choice)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.spec.tiny_targets import Target

K = 3
LOGPROB_ATOL = 1e-4  # fp32: a verify row and a decode row differ only in summation order
MSG = [{"role": "user", "content": "Say something"}]
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 5}},
    "required": ["ok", "name"]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app

    target = Target("llama", tmp_path_factory.mktemp("api"))
    with serve(create_app(target.llm(None), model_name="m")) as plain, \
            serve(create_app(target.llm(K), model_name="m")) as spec:
        yield plain.client(None), spec.client(None)


def test_chat_logprobs_sorted_consistent_and_equal_under_speculation(servers):
    got = []
    for client in servers:
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=12,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        assert len(content) == 12 and "".join(c.token for c in content) == \
            r.choices[0].message.content
        for c in content:
            tops = [t.logprob for t in c.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            # greedy: the chosen token is the top one (raw logprobs, no penalties here)
            assert c.top_logprobs[0].token == c.token and c.logprob == tops[0] <= 0
            assert bytes(c.bytes).decode() == c.token
        got.append(content)
    for a, b in zip(*got):
        assert a.token == b.token and abs(a.logprob - b.logprob) < LOGPROB_ATOL


def test_completion_logprobs_and_stream_spell_the_same(servers):
    plain, spec = servers
    kw = dict(model="m", prompt="Hello", max_tokens=10, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    r = plain.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 10
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    s = spec.completions.create(**kw)
    assert s.choices[0].text == r.choices[0].text
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs,
                                          s.choices[0].logprobs.token_logprobs)) < LOGPROB_ATOL
    chunks = [c for c in spec.completions.create(stream=True, **kw) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_n_choices_distinct_with_seeds(servers):
    plain, spec = servers
    for client in servers:
        kw = dict(model="m", messages=MSG, max_tokens=8, temperature=1.0, seed=11, n=2,
                  extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1]
        texts = [c.message.content for c in r.choices]
        assert texts[0] != texts[1]
        again = client.chat.completions.create(**kw)
        assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
        assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == \
            again.usage.prompt_tokens
    c = plain.completions.create(model="m", prompt=["a", "b"], max_tokens=4, n=3,
                                 temperature=1.0, seed=3)
    assert [x.index for x in c.choices] == list(range(6))


def test_penalties_and_min_tokens_greedy_spec_equals_plain(servers):
    texts = []
    for client in servers:
        r = client.completions.create(model="m", prompt="Once upon", max_tokens=16,
                                      temperature=0, presence_penalty=0.5,
                                      frequency_penalty=0.8,
                                      extra_body={"repetition_penalty": 1.5, "min_tokens": 10,
                                                  "min_p": 0.05})
        assert r.usage.completion_tokens >= 10
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1]


def test_logit_bias_and_allowed_token_ids(servers):
    """OpenAI's logit_bias (string keys) forces or bans tokens, vLLM's allowed_token_ids limits
    them; speculation gives plain's tokens. The token ids are read back with /tokenize."""
    plain, spec = servers
    root = plain.with_options(base_url=str(plain.base_url).rstrip("/").removesuffix("/v1"))
    ids = root.post("/tokenize", body={"prompt": "abc", "add_special_tokens": False},
                    cast_to=object)["tokens"]
    assert len(ids) == 3
    got = []
    for client in servers:
        forced = client.completions.create(model="m", prompt="Once upon", max_tokens=6,
                                           temperature=0, logit_bias={str(ids[0]): 100},
                                           extra_body={"ignore_eos": True})
        assert forced.choices[0].text == "a" * 6
        r = client.chat.completions.create(
            model="m", messages=MSG, max_tokens=8, temperature=0,
            logit_bias={str(ids[1]): -100}, extra_body={"allowed_token_ids": ids,
                                                        "ignore_eos": True})
        assert set(r.choices[0].message.content) <= {"a", "c"}
        got.append(r.choices[0].message.content)
    assert got[0] == got[1]


def _valid(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"ok", "name"} and isinstance(doc["ok"], bool)
            and isinstance(doc["name"], str) and len(doc["name"]) <= 5)


def test_json_schema_response_parses_and_validates(servers):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for client in servers:
        for temperature in (0, 1.0):
            r = client.chat.completions.create(model="m", messages=MSG, max_tokens=60,
                                               temperature=temperature, seed=2,
                                               response_format=fmt)
            assert r.choices[0].finish_reason == "stop"
            assert _valid(json.loads(r.choices[0].message.content))
        r = client.completions.create(model="m", prompt="x", max_tokens=60, temperature=0,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
        assert _valid(json.loads(r.choices[0].text))
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=4,
                                           response_format={"type": "json_object"})
        assert r.choices[0].message.content.startswith("{")


def test_echo_prepends_the_prompt(servers):
    """vLLM's completions `echo`: the prompt's text (as sent, or its ids' text) before the
    reply, streamed first (with logprobs: test_token_fields_api.py)."""
    plain, _ = servers
    kw = dict(model="m", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    base = plain.completions.create(prompt="Once", **kw).choices[0].text
    r = plain.completions.create(prompt=["Once", "Up"], echo=True, **kw)
    assert r.choices[0].text == "Once" + base and r.choices[1].text.startswith("Up")
    streamed = "".join(c.choices[0].text for c in plain.completions.create(
        prompt="Once", echo=True, stream=True, **kw) if c.choices)
    assert streamed == "Once" + base
    root = plain.with_options(base_url=str(plain.base_url).rstrip("/").removesuffix("/v1"))
    ids = root.post("/tokenize", body={"prompt": "Once", "add_special_tokens": False},
                    cast_to=object)["tokens"]
    assert plain.completions.create(prompt=ids, echo=True, **kw).choices[0].text == \
        "Once" + base


def test_skip_special_tokens(servers):
    """vLLM's skip_special_tokens: control tokens (the tiny tokenizer's <|im_start|>, id 1,
    forced in here) leave the text, the other tokens stay."""
    plain, spec = servers
    a = 3 + ord("a") - 32  # the tiny tokenizer: printable characters from id 3
    texts = []
    for client in servers:
        got = [client.completions.create(
            model="m", prompt="Hi", max_tokens=6, temperature=0, logit_bias={"1": 3.0},
            extra_body={"allowed_token_ids": [1, a], "ignore_eos": True,
                        "skip_special_tokens": skip}).choices[0].text for skip in (False, True)]
        assert "<|im_start|>" in got[0] and got[1] == got[0].replace("<|im_start|>", "")
        texts.append(got)
    assert texts[0] == texts[1]


def test_bad_words_through_the_api(servers):
    """vLLM's bad_words reach the engine (tests/spec/test_sampling_features.py checks what they
    ban): the greedy text changes, speculation gives plain's."""
    texts = []
    for client in servers:
        kw = dict(model="m", prompt="Once upon", max_tokens=12, temperature=0)
        free = client.completions.create(**kw).choices[0].text
        words = [free[i:i + 2] for i in range(0, 6, 2) if free[i:i + 2].strip()]
        r = client.completions.create(**kw, extra_body={"bad_words": words})
        assert r.choices[0].text != free
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1]


def test_regex_and_choice_through_the_api(servers):
    """vLLM's guided_regex / guided_choice and structured_outputs {regex, choice}: the text
    matches; speculation gives plain's text."""
    import re

    texts = []
    for client in servers:
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=8, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no", "n/a"]})
        assert r.choices[0].message.content in ("yes", "no", "n/a")
        code = "[A-C]{3}-[0-9]{2}"
        c = client.completions.create(model="m", prompt="Code:", max_tokens=10, temperature=0,
                                      extra_body={"structured_outputs": {"regex": code}})
        assert re.fullmatch(code, c.choices[0].text)
        s = client.completions.create(model="m", prompt="Code:", max_tokens=10, temperature=0.8,
                                      seed=2, extra_body={"guided_regex": "x(y|z)+"})
        assert re.fullmatch("x(y|z)+", s.choices[0].text) or s.choices[0].finish_reason == \
            "length"
        texts.append((r.choices[0].message.content, c.choices[0].text))
    assert texts[0] == texts[1]


def test_bad_structured_requests_are_400(servers):
    plain, _ = servers
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format"),
           ({"response_format": {"type": "json_schema",
                                 "json_schema": {"schema": {"type": "nonsense"}}}},
            "response_format"),
           ({"structured_outputs": {"grammar": "a"}}, "structured_outputs"),
           ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
           ({"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag"),
           ({"guided_regex": "(a"}, "guided_regex"),
           ({"structured_outputs": {"regex": "[a"}}, "structured_outputs"),
           ({"guided_choice": "a"}, "guided_choice"),
           ({"top_logprobs": 2}, "top_logprobs"),
           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            plain.chat.completions.create(model="m", messages=MSG, max_tokens=4,
                                          extra_body=extra)
        assert e.value.param == param, (extra, e.value)
