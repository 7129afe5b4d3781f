"""The OpenAI-compatible server end to end, with the official `openai` client, on a tiny Llama.

References come from `LLM.generate` / `LLM.chat` on the same `LLM` before the server takes its
engine, so "identical" means token-for-token the offline API's answer.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdeploy import LLM, SamplingParams

MODEL = "tiny"
MAX_TOKENS = 8
MAX_BATCH, MAX_QUEUE = 8, 24  # capacity 32 in flight
PROMPTS = [f"Prompt {i}: " + "abcdefgh"[: i % 8 + 1] * (i % 5 + 1) for i in range(32)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
KEY = "test-key"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_batch_size=MAX_BATCH, max_seq_len=256)


@pytest.fixture(scope="module")
def refs(llm):
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    alone = [llm.generate(p, greedy)[0] for p in PROMPTS]
    stop = alone[0].text[2:4]
    assert stop, "tiny model produced too little text to pick a stop string from"
    return {
        "alone": alone,
        "chat": llm.chat(CHAT, greedy)[0],
        "stop": stop,
        "stopped": llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS,
                                                           stop=stop))[0],
        "sampled": llm.generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS,
                                                           **SAMPLED))[0],
        "long": llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True))[0],
    }


@pytest.fixture(scope="module")
def srv(llm, refs, serve):
    from specdeploy.serving.app import create_app

    app = create_app(llm, model_name=MODEL, api_key=KEY, max_queue=MAX_QUEUE, drain_timeout=20)
    with serve(app) as s:
        yield s


def test_models_health_and_metrics(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    m = srv.metrics()
    for name in ("specdeploy_prompt_tokens_total", "specdeploy_generation_tokens_total",
                 "specdeploy_time_to_first_token_seconds_count",
                 "specdeploy_inter_token_latency_seconds_count", "specdeploy_cache_pages_in_use",
                 "specdeploy_num_requests_waiting",
                 'specdeploy_requests_total{finish_reason="stop"}'):
        assert name in m


def test_completions_stream_and_non_stream_equal_generate(srv, refs):
    c, ref = srv.client(), refs["alone"][0]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids), len(ref.token_ids))
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and all(ch.object == "text_completion"
                                                      for ch in chunks)
    *body, last_choice, usage = chunks
    assert all(ch.choices[0].finish_reason is None and ch.usage is None for ch in body)
    assert last_choice.choices[0].finish_reason == ref.finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref.token_ids)
    assert usage.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == ref.text
    # token ids as the prompt: same answer; several prompts: one choice each, in order
    r = c.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS,
                             temperature=0)
    assert r.choices[0].text == ref.text
    want = [o.text for o in refs["alone"][:3]]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                             temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    texts = ["", "", ""]
    for ch in c.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                                   temperature=0, stream=True):
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == want


def test_raw_sse_format(srv):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert "usage" not in payloads[0]  # only with stream_options.include_usage
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_and_non_stream_equal_llm_chat(srv, refs):
    c, ref = srv.client(), refs["chat"]
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_strings_and_seeded_sampling_equal_generate(srv, refs):
    c = srv.client()
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                             temperature=0, stop=[refs["stop"]])
    assert r.choices[0].finish_reason == "stop" == refs["stopped"].finish_reason
    assert r.choices[0].text == refs["stopped"].text
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0, stop=refs["stop"], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == refs["stopped"].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    for stream in (False, True):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                 stream=stream, **SAMPLED)
        text = "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
        assert text == refs["sampled"].text


def test_32_concurrent_streams_get_their_alone_texts(srv, refs):
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                                timeout=60)

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True)
        text, reason = "", None
        async for ch in stream:
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 120)
        finally:
            await client.close()

    before = srv.metrics()
    got = asyncio.run(main())
    assert got == [(o.text, o.finish_reason) for o in refs["alone"]]
    m = srv.wait_idle()
    assert m["specdeploy_generation_tokens_total"] - before[
        "specdeploy_generation_tokens_total"] == sum(len(o.token_ids) for o in refs["alone"])


def _aborted(m: dict) -> float:
    return m['specdeploy_requests_total{finish_reason="abort"}']


def test_client_disconnect_mid_stream_frees_pages(srv):
    before = _aborted(srv.wait_idle())
    stream = srv.client().completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=200,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    assert srv.metrics()["specdeploy_cache_pages_in_use"] > 0
    stream.close()
    m = srv.wait_idle()
    assert _aborted(m) == before + 1


def test_non_streaming_disconnect_aborts(srv, llm, monkeypatch):
    before = _aborted(srv.wait_idle())
    # NOTE: each step made slow, so 200 tokens take ~2 s whatever the machine: on a fast one the
    # tiny model finished them inside the 0.3 s read timeout and nothing was abandoned
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3),
                   headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 20
    while _aborted(srv.metrics()) < before + 1:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    srv.wait_idle()


BAD = [  # (endpoint, raw body, status, param)
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": 7}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("completions", {"prompt": "x" * 600}, 400, "prompt"),
    ("completions", {"prompt": [5] * 300}, 400, "prompt"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400,
     "top_p"),
]


def test_bad_inputs_get_their_status_and_the_server_keeps_answering(srv, refs):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    http = httpx.Client(base_url=srv.url, headers=headers, timeout=30)
    for endpoint, body, status, param in BAD:
        raw = body if isinstance(body, str) else json.dumps(body)
        r = http.post(f"/v1/{endpoint}", content=raw)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["param"] == param, (body, err)
        assert err["message"]
    http.close()
    with pytest.raises(openai.BadRequestError) as e:  # the client sees the same
        srv.client().completions.create(model=MODEL, prompt="hi", max_tokens=4, n=0)
    assert e.value.status_code == 400 and e.value.param == "n"
    r = srv.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert r.choices[0].text == refs["alone"][0].text
    srv.wait_idle()


def test_api_key(srv):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        srv.client(key="wrong").models.list()
    assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
    assert srv.client().models.list().data[0].id == MODEL


def test_full_queue_gets_429_then_recovers(srv, refs):
    c = srv.client()
    srv.wait_idle()

    def open_stream(i: int):
        return c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=200,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(open_stream, range(MAX_BATCH + MAX_QUEUE)))
    try:
        with pytest.raises(openai.RateLimitError) as e:
            open_stream(0)
        assert e.value.status_code == 429
        assert srv.metrics()["specdeploy_num_requests_waiting"] > 0
    finally:
        for s in streams:
            s.close()
    srv.wait_idle()
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                             temperature=0)
    assert r.choices[0].text == refs["alone"][0].text


def test_engine_failure_fails_only_its_requests(srv, llm, refs):
    engine = llm.engine
    real_step = engine.step

    def failing_step():  # NOTE: runs on the engine thread
        engine.step = real_step
        raise RuntimeError("injected")

    srv.wait_idle()
    engine.step = failing_step
    with pytest.raises(openai.InternalServerError):
        srv.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0)
    srv.wait_idle()
    assert httpx.get(srv.url + "/health").status_code == 200
    r = srv.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert r.choices[0].text == refs["alone"][0].text


def test_shutdown_drains_in_flight_requests(srv, refs):
    """Last in this module: stops the server while a stream is in flight."""
    ref = refs["long"]
    first = threading.Event()
    got: dict = {}

    def consume():
        text, reason = "", None
        for ch in srv.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40,
                                                  temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True}):
            first.set()
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
        got.update(text=text, reason=reason)

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(30)
    srv.server.should_exit = True
    t.join(60)
    assert got == {"text": ref.text, "reason": "length"}
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    loop = srv.app.state.engine_loop
    assert not loop.alive and loop.inflight == 0
