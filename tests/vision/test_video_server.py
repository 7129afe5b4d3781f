"""`/v1/chat/completions` with video_url parts (data URLs of video files) on a VLM deployment,
and vLLM's per-request `mm_processor_kwargs` (OpenAI client, `extra_body`)."""
from __future__ import annotations

import base64

import openai
import pytest

from specdeploy import SamplingParams
from tests.serving.conftest import KEY, running
from tests.vision.video_util import rand_frames, video_bytes

CLIP = rand_frames(25, 24, 32, 6)
URL = "data:video/x-matroska;base64," + base64.b64encode(video_bytes(CLIP, 10)).decode()


def _msgs(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "what"}]}]


@pytest.fixture(scope="module")
def want(vlm_llm):
    """LLM.chat's answers (the frames with the file's rate; and sampled at 1 fps), computed
    before the server starts (its engine thread then owns the engine)."""
    sp = SamplingParams(max_tokens=8)
    frames = [{"role": "user", "content": [{"type": "video", "video": (CLIP, {"fps": 10})},
                                           {"type": "text", "text": "what"}]}]
    slow = vlm_llm.deployed.video_processor
    vlm_llm.deployed.video_processor = slow.with_kwargs({"fps": 1.0})
    try:
        one_fps = vlm_llm.chat(frames, sp)[0]
    finally:
        vlm_llm.deployed.video_processor = slow
    return vlm_llm.chat(frames, sp)[0], one_fps


@pytest.fixture(scope="module")
def srv(vlm_llm, want):
    from specdeploy.serving.app import create_app

    with running(create_app(vlm_llm, model_name="vlm", api_key=KEY)) as s:
        yield s


def test_video_url_equals_llm_chat(srv, want):
    r = srv.client().chat.completions.create(model="vlm", messages=_msgs(URL), max_tokens=8,
                                             temperature=0)
    assert r.choices[0].message.content == want[0].text
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)


def test_request_processor_kwargs_resample_the_video(srv, want):
    """extra_body={"mm_processor_kwargs": {"fps": 1}}: 2 frames (1 step) instead of 5 (3)."""
    r = srv.client().chat.completions.create(
        model="vlm", messages=_msgs(URL), max_tokens=8, temperature=0,
        extra_body={"mm_processor_kwargs": {"fps": 1}})
    assert r.usage.prompt_tokens == len(want[1].prompt_token_ids) < len(want[0].prompt_token_ids)
    assert r.choices[0].message.content == want[1].text


@pytest.mark.parametrize("url, kwargs, needle", [
    ("https://example.com/v.mp4", None, "remote video URLs are not fetched"),
    ("/tmp/v.mp4", None, "must be a data URL (data:video/"),
    ("data:video/mp4;base64," + base64.b64encode(b"not a video").decode(), None, "not a video"),
    (URL, {"fps": "fast"}, "fps must be a positive number"),
    (URL, {"min_frames": 9, "max_frames": 4}, "min_frames 9 is above max_frames 4"),
    (URL, {"resolution": 3}, "'resolution' is not supported"),
])
def test_bad_video_requests_are_400(srv, url, kwargs, needle):
    extra = {} if kwargs is None else {"mm_processor_kwargs": kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model="vlm", messages=_msgs(url), max_tokens=2,
                                             extra_body=extra)
    assert needle in str(e.value)


def test_text_model_refuses_video_parts():
    from specdeploy.serving import protocol as P
    from specdeploy.serving.chat import parse_chat

    limits = P.Limits("m", max_seq_len=64, kv_capacity=64, vocab_size=128)
    with pytest.raises(P.APIError, match="this model takes no videos") as e:
        parse_chat({"messages": _msgs("data:video/mp4;base64,AAAA")}, None, limits)
    assert e.value.status == 400 and e.value.param == "messages[0].content[0]"
