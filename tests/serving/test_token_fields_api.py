"""vLLM's token-level fields through the server on a tiny Llama (serving/token_fields.py):
`return_token_ids`, `return_tokens_as_token_ids`, `truncate_prompt_tokens` / `truncation_side`;
and OpenAI's legacy scoring use of completions, `echo` with `logprobs`, streamed and with
`max_tokens` 0. Oracles: the engine's own greedy output and prompt logprobs (computed before
the server owns the LLM: never step an engine from two threads), the tokenizer, the same
request without the field (an explicitly cut prompt, names by text), and the unstreamed
response for a stream."""
from __future__ import annotations

import openai
import pytest

from specdeploy import SamplingParams
from specdeploy.serving import protocol as P
from tests.spec.tiny_targets import Target

PROMPT = "Once upon a time there was"
MSGS = [{"role": "user", "content": "Hello there"}]
GREEDY = dict(model="m", temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def setup(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app

    target = Target("llama", tmp_path_factory.mktemp("tok_api"))
    llm = target.llm(None)
    ids = llm.tokenizer.encode(PROMPT)
    refs = {}
    for key, p in (("prompt", ids), ("chat", llm.chat_ids(MSGS))):
        out = llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True,
                                               prompt_logprobs=2))[0]
        refs[key] = out.token_ids, out.prompt_logprobs
    with serve(create_app(llm, model_name="m")) as srv:
        yield llm, srv.client(None), refs


def _extra(**kw) -> dict:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"], **kw}}


def test_completions_return_token_ids(setup):
    llm, client, refs = setup
    ids = llm.tokenizer.encode(PROMPT)
    r = client.completions.create(prompt=[PROMPT, ids[:3]], max_tokens=6, n=2,
                                  **_extra(return_token_ids=True))
    for j, c in enumerate(r.choices):  # prompt i's choices are 2i, 2i + 1
        want = ids if j < 2 else ids[:3]
        assert c.model_extra["prompt_token_ids"] == want
        assert llm.tokenizer.decode(c.model_extra["token_ids"]) == c.text
    assert r.choices[0].model_extra["token_ids"] == refs["prompt"][0]
    plain = client.completions.create(prompt=PROMPT, max_tokens=6, **GREEDY)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    chunks = [c for c in client.completions.create(
        prompt=PROMPT, max_tokens=6, stream=True, **_extra(return_token_ids=True)) if c.choices]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == refs["prompt"][0]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_return_token_ids(setup):
    llm, client, refs = setup
    raw = client.chat.completions.with_raw_response.create(
        messages=MSGS, max_tokens=6, **_extra(return_token_ids=True))
    body = raw.http_response.json()
    assert body["prompt_token_ids"] == llm.chat_ids(MSGS)
    assert body["choices"][0]["token_ids"] == refs["chat"][0]
    chunks = list(client.chat.completions.create(messages=MSGS, max_tokens=6, stream=True,
                                                 **_extra(return_token_ids=True)))
    assert chunks[0].model_extra["prompt_token_ids"] == llm.chat_ids(MSGS)
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    got = sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks if c.choices), [])
    assert got == refs["chat"][0]


def test_return_tokens_as_token_ids(setup):
    """Tokens named "token_id:<id>"; the same logprobs as the names by text, offsets and chat
    bytes still those of the text."""
    llm, client, refs = setup
    kw = dict(prompt=PROMPT, max_tokens=6, logprobs=3)
    named = client.completions.create(**kw, **_extra(return_tokens_as_token_ids=True))
    plain = client.completions.create(**kw, **GREEDY)
    a, b = named.choices[0].logprobs, plain.choices[0].logprobs
    assert a.tokens == [f"token_id:{t}" for t in refs["prompt"][0]]
    assert a.token_logprobs == b.token_logprobs and a.text_offset == b.text_offset
    for top_a, top_b in zip(a.top_logprobs, b.top_logprobs):
        by_text = {llm.tokenizer.decode([int(k.split(":")[1])]): v for k, v in top_a.items()}
        assert all(k.startswith("token_id:") for k in top_a) and by_text == top_b
    c = client.chat.completions.create(messages=MSGS, max_tokens=6, logprobs=True,
                                       top_logprobs=2, **_extra(return_tokens_as_token_ids=True))
    for e, t in zip(c.choices[0].logprobs.content, refs["chat"][0]):
        assert e.token == f"token_id:{t}" and bytes(e.bytes).decode() == llm.tokenizer.decode([t])
        assert all(x.token.startswith("token_id:") for x in e.top_logprobs)


def test_token_names_default_from_the_server():
    """`--return-tokens-as-token-ids` is the default; a request's false overrides it."""
    class Tok:
        def encode(self, s, add_special_tokens=True):
            return [3, 4]

    limits = P.Limits(model_name="m", max_seq_len=32, kv_capacity=32, vocab_size=10,
                      return_tokens_as_token_ids=True)
    assert P.parse_completion({"prompt": "x"}, Tok(), limits).as_ids
    assert not P.parse_completion({"prompt": "x", "return_tokens_as_token_ids": False}, Tok(),
                                  limits).as_ids
    assert not P.parse_completion({"prompt": "x"}, Tok(), P.Limits("m", 32, 32, 10)).as_ids


def test_truncate_prompt_tokens(setup):
    llm, client, _ = setup
    ids = llm.tokenizer.encode(PROMPT)
    for side, want in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        extra = {"truncate_prompt_tokens": 3, "return_token_ids": True}
        if side:
            extra["truncation_side"] = side
        r = client.completions.create(prompt=PROMPT, max_tokens=4, **_extra(**extra))
        cut = client.completions.create(prompt=want, max_tokens=4, **GREEDY)
        assert r.usage.prompt_tokens == 3 and r.choices[0].model_extra["prompt_token_ids"] == want
        assert r.choices[0].text == cut.choices[0].text
    # a prompt longer than the context (256) fits once cut; -1 keeps what max_tokens leaves
    long = (ids * 60)[:300]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=long, max_tokens=4, **GREEDY)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.completions.create(prompt=long, max_tokens=4, **_extra(truncate_prompt_tokens=-1))
    assert r.usage.prompt_tokens == 252
    text = " ".join([PROMPT] * 80)
    r = client.completions.create(prompt=text, max_tokens=4, echo=True,
                                  **_extra(truncate_prompt_tokens=10))
    assert r.usage.prompt_tokens == 10
    assert r.choices[0].text.startswith(llm.tokenizer.decode(llm.tokenizer.encode(text)[-10:]))
    chat = client.chat.completions.with_raw_response.create(
        messages=MSGS, max_tokens=2, **_extra(truncate_prompt_tokens=5, return_token_ids=True))
    assert chat.http_response.json()["prompt_token_ids"] == llm.chat_ids(MSGS)[-5:]


@pytest.mark.parametrize("extra, param", [
    ({"truncate_prompt_tokens": 253}, "truncate_prompt_tokens"),  # > 256 - max_tokens 4
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids")])
def test_bad_token_fields_are_400(setup, extra, param):
    _, client, _ = setup
    for call in (lambda: client.completions.create(model="m", prompt="Hi", max_tokens=4,
                                                   extra_body=extra),
                 lambda: client.chat.completions.create(model="m", messages=MSGS, max_tokens=4,
                                                        extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param


def test_streamed_echo_with_logprobs_equals_unstreamed(setup):
    """The prompt's text and its tokens' logprobs come first (once its prefill is done), then
    the reply's: concatenated, the unstreamed response's fields exactly."""
    llm, client, refs = setup
    kw = dict(prompt=PROMPT, max_tokens=5, echo=True, logprobs=2, **GREEDY)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].text == PROMPT
    n = len(llm.tokenizer.encode(PROMPT))
    assert chunks[0].logprobs.token_logprobs[0] is None
    assert chunks[0].logprobs.token_logprobs[1:] == pytest.approx(
        [refs["prompt"][1][i][t] for i, t in enumerate(llm.tokenizer.encode(PROMPT)) if i],
        abs=1e-9)
    assert "".join(c.text for c in chunks) == whole.text
    for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.logprobs, f) for c in chunks if c.logprobs), []) == \
            getattr(whole.logprobs, f), f
    assert len(whole.logprobs.tokens) == n + 5


def test_max_tokens_zero_with_echo_scores_the_prompt(setup):
    """OpenAI's legacy scoring: echo + logprobs + max_tokens 0 gives the prompt's logprobs and
    no reply (lm-evaluation-harness's loglikelihood requests)."""
    llm, client, refs = setup
    ids = llm.tokenizer.encode(PROMPT)
    kw = dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, model="m")
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert c.logprobs.tokens == [llm.tokenizer.decode([t]) for t in ids]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [refs["prompt"][1][i][t] for i, t in enumerate(ids) if i], abs=1e-9)
    chunks = [x.choices[0] for x in client.completions.create(stream=True, **kw) if x.choices]
    assert "".join(x.text for x in chunks) == PROMPT
    assert sum((x.logprobs.tokens for x in chunks if x.logprobs), []) == c.logprobs.tokens
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:  # without echo there is nothing to show
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_priority_needs_the_priority_policy():
    """vLLM's `priority`: 0 anywhere; anything else only on a server started with
    --scheduling-policy priority (Limits.priority_scheduling), else a 400 naming it."""
    class Tok:
        def encode(self, s, add_special_tokens=True):
            return [3, 4]

    fcfs = P.Limits("m", 32, 32, 10)
    assert P.parse_completion({"prompt": "x", "priority": 0}, Tok(), fcfs).priority == 0
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "x", "priority": 2}, Tok(), fcfs)
    assert e.value.param == "priority" and "--scheduling-policy priority" in e.value.message
    prio = P.Limits("m", 32, 32, 10, priority_scheduling=True)
    assert P.parse_completion({"prompt": "x", "priority": -3}, Tok(), prio).priority == -3
    with pytest.raises(P.APIError) as e:
        P.parse_completion({"prompt": "x", "priority": 1.5}, Tok(), prio)
    assert e.value.param == "priority"


def test_priority_reaches_the_engine(tmp_path_factory, serve):
    """A priority server hands each request's priority to the engine (recorded at add, on the
    engine thread), and the reply is the one without it."""
    from specdeploy.serving.app import create_app

    llm = Target("llama", tmp_path_factory.mktemp("prio_api")).llm(None)
    llm.engine.scheduler.set_policy("priority")
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))[0].text
    seen, add = [], llm.engine.add_request

    def record(*a, priority=0, **kw):
        seen.append(priority)
        return add(*a, priority=priority, **kw)

    llm.engine.add_request = record
    with serve(create_app(llm, model_name="m")) as srv:
        client = srv.client(None)
        r = client.completions.create(prompt=PROMPT, max_tokens=4, **_extra(priority=-2))
        c = client.chat.completions.create(messages=MSGS, max_tokens=2, n=2,
                                           **_extra(priority=3))
    assert r.choices[0].text == ref and len(c.choices) == 2
    assert seen == [-2, 3, 3]
