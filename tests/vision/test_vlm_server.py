"""`/v1/chat/completions` with image_url parts on a VLM deployment (OpenAI client)."""
from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from specdeploy import SamplingParams
from tests.serving.conftest import KEY, running
from tests.vision.conftest import rand_image


def _data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _msgs(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


IMAGE_URL = _data_url(rand_image(48, 33, 5))


@pytest.fixture(scope="module")
def want(vlm_llm):
    """LLM.chat's answer, computed before the server starts: while it runs, its engine thread
    owns the engine, and a second caller stepping the same engine races it."""
    return vlm_llm.chat(_msgs(IMAGE_URL), SamplingParams(max_tokens=8))[0]


@pytest.fixture(scope="module")
def srv(vlm_llm, want):
    from specdeploy.serving.app import create_app

    with running(create_app(vlm_llm, model_name="vlm", api_key=KEY)) as s:
        yield s


def test_openai_client_image_equals_llm_chat(srv, want):
    r = srv.client().chat.completions.create(model="vlm", messages=_msgs(IMAGE_URL), max_tokens=8,
                                             temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("url, needle", [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("/etc/passwd", "must be a data URL"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
    ("data:image/png;base64,!!", "invalid base64"),
])
def test_bad_image_urls_are_400(srv, url, needle):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model="vlm", messages=_msgs(url), max_tokens=2)
    assert needle in str(e.value)


def test_truncated_image_400_and_others_unaffected(srv):
    url = _data_url(rand_image(64, 64))
    head, payload = url.split(",")
    raw = base64.b64decode(payload)
    cut = head + "," + base64.b64encode(raw[: len(raw) // 2]).decode()
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "vlm", "messages": _msgs(cut), "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
    assert "cannot decode" in r.json()["error"]["message"]
    ok = srv.client().chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_more_images_than_placeholders_is_400(srv):
    """A literal <|image_pad|> in the text is one more placeholder than images (never merged
    silently into text)."""
    url = _data_url(rand_image(16, 16))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a <|image_pad|> b"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model="vlm", messages=msgs, max_tokens=2)
    assert "1 image(s) but 2 image placeholder token(s)" in str(e.value)
    text_only = [{"role": "user", "content": "a <|image_pad|> b"}]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model="vlm", messages=text_only, max_tokens=2)
    assert "but no images" in str(e.value)


def test_text_model_refuses_image_parts():
    from specdeploy.serving import protocol as P
    from specdeploy.serving.chat import parse_chat

    limits = P.Limits("m", max_seq_len=64, kv_capacity=64, vocab_size=128)
    with pytest.raises(P.APIError, match="this model takes no images") as e:
        parse_chat({"messages": _msgs("data:image/png;base64,AAAA")}, None, limits)
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
