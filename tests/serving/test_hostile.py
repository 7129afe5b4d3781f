"""Hostile input against a live server while good streams run alongside (hostile_cases.py).

The oracle: the good requests' texts equal the ones they get alone (from `LLM.generate` before
the server takes the engine), every case gets its expected status and an OpenAI-style error
body naming the field, the connection survives or closes cleanly, `/metrics` ends with no page
in use, and the process' RSS grows by less than RSS_BOUND_MIB.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import specdeploy.engine.sample_rows as sample_mod
from specdeploy import LLM, SamplingParams
from tests.serving.hostile_cases import AUTH, BODY_LIMIT, COMP, JSON, KEY, MODEL, all_cases

GOOD = ["Stream one: abc", "Stream two: hello there", "Stream three: xyz xyz",
        "Stream four: the end"]
GOOD_TOKENS = 48
POISON_SEED = 666  # a request whose sampling we break on purpose (isolation)
RSS_BOUND_MIB = 128
TIME_BOUND_S = 90  # the whole hostile round, a hang fails instead of blocking CI
CASES = all_cases()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_batch_size=8, max_seq_len=256)


@pytest.fixture(scope="module")
def solo(llm):
    sp = SamplingParams(max_tokens=GOOD_TOKENS, ignore_eos=True)
    return [llm.generate(p, sp)[0].text for p in GOOD]


@pytest.fixture(scope="module")
def srv(llm, solo, serve):
    from specdeploy.serving.app import create_app

    app = create_app(llm, model_name=MODEL, api_key=KEY, max_queue=64, drain_timeout=5,
                     max_body_bytes=BODY_LIMIT)
    with serve(app) as s:
        yield s


def _encode(body) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


def _stream_text(url: str, prompt: str, out: list, i: int, rounds: int) -> None:
    texts = []
    with httpx.Client(base_url=url, headers=JSON, timeout=60) as c:
        for _ in range(rounds):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": GOOD_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            text = ""
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            texts.append(text)
    out[i] = texts


def test_enough_cases():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)


def test_hostile_round(srv, solo, llm, monkeypatch):
    real = sample_mod.sample

    def poisoned(logits, params, gens, default=None):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampling failure")
        return real(logits, params, gens, default)

    monkeypatch.setattr(sample_mod, "sample", poisoned)
    for _ in range(2):  # warm up the allocator before the RSS baseline
        httpx.post(srv.url + "/v1/completions", json=COMP, headers=AUTH, timeout=30)
    rss0 = _rss_mib()
    results: list = [None] * len(GOOD)
    threads = [threading.Thread(target=_stream_text, args=(srv.url, p, results, i, 3))
               for i, p in enumerate(GOOD)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    failures = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for name, method, path, headers, body, status, param in CASES:
            assert time.monotonic() - t0 < TIME_BOUND_S, "hostile round too slow"
            r = http.request(method, path, headers=headers, content=_encode(body))
            if r.status_code != status:
                failures.append((name, status, r.status_code, r.text[:200]))
                continue
            if status >= 400 and path.startswith("/v1") and r.content and status != 405:
                err = r.json()["error"]
                if set(err) != {"message", "type", "param", "code"} or not err["message"] or (
                        param is not None and err["param"] != param):
                    failures.append((name, "error body", err))
            # the same client (keep-alive, or a clean reconnect) must still be served
            assert http.get("/health").status_code == 200, name
        poison = {**COMP, "temperature": 0.8, "seed": POISON_SEED, "max_tokens": 8}
        r = http.post("/v1/completions", json=poison, headers=AUTH)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", headers=AUTH, json={  # streamed: an error event
            **poison, "prompt": None, "messages": [{"role": "user", "content": "x"}],
            "stream": True})
        events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        assert r.status_code == 200 and "injected" in events[-1]["error"]["message"]
    for t in threads:
        t.join(TIME_BOUND_S)
        assert not t.is_alive(), "a good stream hung"
    assert not failures, "\n".join(map(str, failures))
    assert results == [[s] * 3 for s in solo]  # good streams unharmed, token for token
    m = srv.wait_idle()
    assert m["specdeploy_cache_pages_in_use"] == 0
    assert _rss_mib() - rss0 < RSS_BOUND_MIB


def _raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` on one socket (from a thread, 64 KiB at a time) while reading until the
    server closes it or goes quiet for a second. A reset after the server refused the rest of
    a body is a clean close too: what it answered first was read already."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        def send():
            try:
                for i in range(0, len(data), 65536):
                    s.sendall(data[i:i + 65536])
            except OSError:  # the server stopped reading (413) and closed
                pass
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        s.settimeout(1.0)
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        sender.join(timeout)
    return out


def _req(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}")
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def test_keep_alive_after_errors(srv, llm, monkeypatch):
    """A 400 and an unexpected 500 leave the connection usable: the next request on the same
    socket is answered (Starlette's default 500 path made uvicorn drop it)."""
    tok = llm.tokenizer
    real = tok.encode

    def encode(text, **kw):
        if text == "__boom__":
            raise TypeError("injected tokenizer failure")
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", encode)
    health = _req("GET", "/health")
    for body, status in ((b"{not json", b"400"), (json.dumps({**COMP, "prompt": "__boom__"})
                                                    .encode(), b"500")):
        out = _raw(srv.port, _req("POST", "/v1/completions", body) + health)
        assert out.startswith(b"HTTP/1.1 " + status), out[:200]
        assert out.count(b"HTTP/1.1 ") == 2 and b'{"status":"ok"}' in out, out[-300:]


def test_chunked_body_over_limit_is_413_and_closes(srv):
    """No Content-Length: the limit holds while reading (was: a 40 MiB chunked body got 200)."""
    piece = b"a" * 65536
    start = b'{"prompt": "'
    # 512 KiB of chunks, never finished: the server must not wait for the end
    body = b"%x\r\n%s\r\n" % (len(start), start) + b"".join(
        b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(8))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    t0 = time.monotonic()
    out = _raw(srv.port, head + body + _req("GET", "/health"))
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert b"connection: close" in out.lower() and out.count(b"HTTP/1.1 ") == 1
    assert time.monotonic() - t0 < 10
    # a Content-Length over the limit is refused before any body is read
    big = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n").encode()
    out = _raw(srv.port, big)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    small = json.dumps(COMP).encode()
    ok = b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small)  # a chunked body under the limit: 200
    out = _raw(srv.port, head + ok)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]


def test_prompt_char_bound_skips_tokenizer(srv, llm, monkeypatch):
    """A prompt that cannot fit is refused before tokenizing (was: 15 s of CPU for 10 MB)."""
    calls = []
    real = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda t, **kw: calls.append(len(t)) or
                        real(t, **kw))
    limit = srv.app.state.limits.max_prompt_chars
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={**COMP, "prompt": "q" * (limit + 1)})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert not calls
    assert httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30,
                      json=COMP).status_code == 200 and calls
