"""Request heads over 16 KiB get 400 however they arrive: h11 only refuses them when they come
in pieces, so the server's own guard checks the parsed headers too (made the hostile suite's
64 KiB-header case flaky under load before)."""
from __future__ import annotations

import asyncio
import json

from specdeploy.serving.app import MAX_HEADER_BYTES, _Guard


def _call(headers):
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/health", "headers": headers}
    asyncio.run(_Guard(app)(scope, receive, send))
    return sent, reached


def test_large_head_refused_before_the_app():
    sent, reached = _call([(b"x-junk", b"j" * (MAX_HEADER_BYTES + 1))])
    assert not reached and sent[0]["status"] == 400
    assert (b"connection", b"close") in sent[0]["headers"]
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert "headers over" in body["error"]["message"]


def test_normal_head_reaches_the_app():
    _, reached = _call([(b"host", b"127.0.0.1"), (b"x-small", b"j" * 1000)])
    assert reached == ["/health"]
