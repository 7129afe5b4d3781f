"""The hostile-input table for test_hostile.py: (name, method, path, headers, body, status, param).

`body` is bytes sent as is, a str (UTF-8, so invalid JSON stays as written), or a dict/list
(JSON, with NaN / Infinity literals where a value is a float of those). `param` is the field
the 4xx error body must name (None: no field, or no check for statuses uvicorn answers itself).
"""
from __future__ import annotations

import json

KEY = "test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0}
NAN, INF = float("nan"), float("inf")
BODY_LIMIT = 256 * 1024  # the app under test's max_body_bytes (the default is 16 MiB)


def _with(base: dict, **kw) -> dict:
    d = dict(base)
    for k, v in kw.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()

# Every sampling field, wrong in every way: same answer on both endpoints.
SAMPLING_BAD = {
    "temperature": ["0.5", True, -1, 1e-45, 1e-300, NAN, INF, -INF, 1e30, [0.5], {}],
    "top_p": [0, -0.1, 1.5, "1", NAN, True, INF],
    "top_k": [1e30, 10**30, 129, -2, "5", True, 2.5],
    "max_tokens": [True, "8", 0, -1, 1e30, 10**30, 2.5, []],
    "seed": ["x", 1.5, -1, 2**64, True],
    "stop": [5, [5], [""], ["a"] * 17, "x" * 600, {"a": 1}, [["a"]]],
    "stop_token_ids": [["5"], [True], 5, [-1], [10**30], [128], "12"],
    "ignore_eos": ["yes", 1],
    "presence_penalty": [3, "1", NAN, [0.5]],
    "frequency_penalty": [-3, INF],
    "n": [17, 0, "1", True],
    "repetition_penalty": [0, -1, "1.2", NAN],
    "min_p": [1.5, -0.1],
    "min_tokens": [-1, "3", 10**6, 1.5],
    "stream": ["yes", 1],
}


def sampling_cases():
    out = []
    for field, values in SAMPLING_BAD.items():
        for i, v in enumerate(values):
            base = COMP if i % 2 == 0 else CHAT
            path = "/v1/completions" if base is COMP else "/v1/chat/completions"
            out.append((f"{field}={json.dumps(v)[:20]}", "POST", path, JSON,
                        _with(base, **{field: v}), 400, field))
    return out


def _nested(depth: int) -> str:
    return '{"model": "tiny", "prompt": "hi", "x": ' + "[" * depth + "]" * depth + "}"


BAD_PROMPTS = [None, 7, "", [], [[]], [1, 2, 10**6], [-1], ["a", 5], [1.5], [True],
               ["hi"] * 65, "\ud800", "x" * 5000, [[1, 2], "x", 3]]


def completion_cases():
    out = [(f"prompt={json.dumps(p)[:20]}", "POST", "/v1/completions", JSON,
            _with(COMP, prompt=p), 400, "prompt") for p in BAD_PROMPTS]
    out.append(("prompt missing", "POST", "/v1/completions", JSON, _with(COMP, prompt=_DROP),
                400, "prompt"))
    for field, v in (("echo", "yes"), ("best_of", 2), ("logprobs", 21), ("suffix", "x"),
                     ("logit_bias", {"1": 500}), ("logit_bias", {"x": 5}),
                     ("logit_bias", [1]), ("allowed_token_ids", []),
                     ("allowed_token_ids", [10**9]), ("stream_options", {"include_usage": True})):
        out.append((f"{field}={json.dumps(v)[:24]} refused", "POST", "/v1/completions", JSON,
                    _with(COMP, **{field: v}), 400, field))
    out.append(("stream_options not an object", "POST", "/v1/completions", JSON,
                _with(COMP, stream=True, stream_options="x"), 400, "stream_options"))
    for v, status in ((5, 400), ("gpt-4", 404), ("\ud800", 400), (["tiny"], 400)):
        out.append((f"model={v!r}", "POST", "/v1/completions", JSON, _with(COMP, model=v),
                    status, "model"))
    return out


def _msgs(*m):
    return _with(CHAT, messages=list(m))


def chat_cases():
    p0 = "messages[0]"
    cases = [
        ("messages missing", _with(CHAT, messages=_DROP), "messages"),
        ("messages empty", _msgs(), "messages"),
        ("messages str", _with(CHAT, messages="hello"), "messages"),
        ("message int", _msgs(1), p0),
        ("role wizard", _msgs({"role": "wizard", "content": "x"}), f"{p0}.role"),
        ("role list", _msgs({"role": ["user"], "content": "x"}), f"{p0}.role"),
        ("role missing", _msgs({"content": "x"}), f"{p0}.role"),
        ("content missing", _msgs({"role": "user"}), f"{p0}.content"),
        ("content int", _msgs({"role": "user", "content": 3}), f"{p0}.content"),
        ("content dict", _msgs({"role": "user", "content": {"text": "x"}}), f"{p0}.content"),
        ("part image", _msgs({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}), f"{p0}.content[0]"),
        ("part audio", _msgs({"role": "user", "content": [{"type": "input_audio"}]}),
         f"{p0}.content[0]"),
        ("part no text", _msgs({"role": "user", "content": [{"type": "text"}]}),
         f"{p0}.content[0]"),
        ("part text int", _msgs({"role": "user", "content": [{"type": "text", "text": 5}]}),
         f"{p0}.content[0]"),
        ("part str", _msgs({"role": "user", "content": ["hi"]}), f"{p0}.content[0]"),
        ("content surrogate", _msgs({"role": "user", "content": "a\ud800b"}), f"{p0}.content"),
        ("content huge", _msgs({"role": "user", "content": "y" * 5000}), "messages"),
        ("tools, auto by default", _with(CHAT, tools=[{"type": "function",
                                                       "function": {"name": "f"}}]),
         "tool_choice"),
        ("tools not a list", _with(CHAT, tools={"f": 1}, tool_choice="none"), "tools"),
        ("tool_choice", _with(CHAT, tool_choice="auto"), "tool_choice"),
        ("response_format", _with(CHAT, response_format={"type": "regex"}),
         "response_format"),
        ("response_format schema", _with(CHAT, response_format={"type": "json_schema"}),
         "response_format"),
        ("logprobs", _with(CHAT, logprobs="yes"), "logprobs"),
        ("top_logprobs", _with(CHAT, top_logprobs=3), "top_logprobs"),
        ("max_completion_tokens str", _with(CHAT, max_completion_tokens="5"),
         "max_completion_tokens"),
        ("max_completion_tokens huge", _with(CHAT, max_completion_tokens=10**6),
         "max_completion_tokens"),
    ]
    return [(n, "POST", "/v1/chat/completions", JSON, b, 400, p) for n, b, p in cases]


def raw_body_cases():
    c, ch = "/v1/completions", "/v1/chat/completions"
    cases = [
        ("not json", c, "{not json"), ("json list", c, "[1, 2]"), ("empty body", c, ""),
        ("json null", c, "null"), ("json string", ch, '"hello"'), ("json number", ch, "123"),
        ("invalid utf-8", c, b'{"prompt": "\xff\xfe"}'), ("truncated", ch, '{"messages": ['),
        ("deep nesting 100k", c, "[" * 100_000), ("deep nesting in field", c, _nested(40)),
        ("deep object", ch, '{"a":' * 5000 + "1" + "}" * 5000),
        ("escaped surrogate key", c, '{"prompt": "hi", "\\udc00": 1}'),
        ("NaN literal", c, '{"prompt": "hi", "temperature": NaN}'),
    ]
    out = [(n, "POST", p, JSON, b, 400, None) for n, p, b in cases]
    out[-1] = out[-1][:-1] + ("temperature",)
    return out


def http_cases():
    """Methods, paths, auth and header tricks (statuses from the app or from uvicorn)."""
    ok = 200
    return [
        ("GET completions", "GET", "/v1/completions", AUTH, None, 405, None),
        ("PUT chat", "PUT", "/v1/chat/completions", JSON, CHAT, 405, None),
        ("DELETE models", "DELETE", "/v1/models", AUTH, None, 405, None),
        ("POST health", "POST", "/health", {}, None, 405, None),
        ("PATCH metrics", "PATCH", "/metrics", {}, None, 405, None),
        ("unknown path", "GET", "/nope", {}, None, 404, None),
        ("v1 root", "GET", "/v1", AUTH, None, 404, None),
        ("traversal", "GET", "/v1/../../etc/passwd", AUTH, None, 404, None),
        ("docs off", "GET", "/docs", {}, None, 404, None),
        ("openapi off", "GET", "/openapi.json", {}, None, 404, None),
        ("long path", "GET", "/" + "a" * 8000, {}, None, 404, None),
        ("no auth", "POST", "/v1/completions", {}, COMP, 401, None),
        ("wrong key", "POST", "/v1/completions", {"Authorization": "Bearer nope"}, COMP, 401,
         None),
        ("basic auth", "GET", "/v1/models", {"Authorization": "Basic dGVzdC1rZXk="}, None, 401,
         None),
        ("key prefix", "GET", "/v1/models", {"Authorization": f"Bearer {KEY[:-1]}"}, None, 401,
         None),
        ("key longer", "GET", "/v1/models", {"Authorization": f"Bearer {KEY}x"}, None, 401,
         None),
        ("empty bearer", "GET", "/v1/models", {"Authorization": "Bearer"}, None, 401, None),
        ("key in x-api-key only", "GET", "/v1/models", {"x-api-key": KEY}, None, 401, None),
        ("lowercase scheme", "GET", "/v1/models", {"Authorization": f"bearer {KEY}"}, None, ok,
         None),
        ("text/plain body", "POST", "/v1/completions", {**AUTH, "Content-Type": "text/plain"},
         COMP, ok, None),
        ("no content type", "POST", "/v1/completions", AUTH, COMP, ok, None),
        ("form content type", "POST", "/v1/completions",
         {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, "prompt=hi", 400, None),
        ("over limit body", "POST", "/v1/completions", JSON,
         json.dumps(_with(COMP, prompt="z" * (BODY_LIMIT + 10))), 413, None),
        ("header 64 KiB", "GET", "/health", {"X-Junk": "j" * 65536}, None, 400, None),
    ]


def all_cases():
    cases = (sampling_cases() + completion_cases() + chat_cases() + raw_body_cases()
             + http_cases())
    names = [c[0] for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    return [(f"{n}#{i}" if n in dup else n, *rest) for i, (n, *rest) in enumerate(cases)]
