"""Reasoning parsers (serving/reasoning.py): the split of whole replies against hand-written
expectations, streamed deltas against the whole reply's split under every way of cutting the
text into pieces, and the server's messages and streams (a tiny model whose replies a regex
grammar shapes into thinking blocks)."""
from __future__ import annotations

import itertools
import random

import openai
import pytest

from specdeploy.serving.reasoning import Reasoning

CASES = [  # (parser, prompt opens the block, reply, reasoning, content)
    ("qwen3", False, "<think>\nsteps\n</think>\n\nThe answer.", "\nsteps\n", "\n\nThe answer."),
    ("qwen3", False, "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    ("qwen3", False, "<thinking is a word", None, "<thinking is a word"),
    ("qwen3", False, "", None, ""),
    ("qwen3", True, "steps</think>answer", "steps", "answer"),
    ("qwen3", True, "cut while think", "cut while think", None),
    ("qwen3", False, "<think>a</think>", "a", None),
    ("deepseek_r1", False, "r1 thinks</think>then says", "r1 thinks", "then says"),
    ("deepseek_r1", False, "<think>x</think>y</think>z", "x", "y</think>z"),
    ("deepseek_r1", False, "never closes <", "never closes <", None),
    ("qwen3", True, "plan<tool_call>{}</tool_call>", "plan", "<tool_call>{}</tool_call>"),
    ("qwen3", False, "<think>a</think>b<tool_call>", "a", "b<tool_call>"),
    ("deepseek_r1", False, "a<tool_call>b", "a<tool_call>b", None),
    # nemotron_v3: qwen3's split, the reasoning's trailing whitespace dropped
    ("nemotron_v3", True, "steps \n\n</think>answer", "steps", "answer"),
    ("nemotron_v3", False, "<think>a b  </think>\nc", "a b", "\nc"),
    ("nemotron_v3", True, "plan\n<tool_call>x", "plan", "<tool_call>x"),
    ("nemotron_v3", True, "cut while  ", "cut while", None),
    ("nemotron_v3", False, "No block.  ", None, "No block.  "),
]


@pytest.mark.parametrize("parser, inside, text, reasoning, content", CASES)
def test_split(parser, inside, text, reasoning, content):
    r, c = Reasoning(parser, inside).split(text)
    assert (r or None, c if c or r is None else None) == (reasoning, content)
    msg = Reasoning(parser, inside).message(text)
    assert msg == {"content": content, "reasoning": reasoning, "reasoning_content": reasoning}
    assert Reasoning(parser, inside, include=False).message(text) == {"content": content}


@pytest.mark.parametrize("parser, inside, text, reasoning, content", CASES)
def test_stream_spells_the_whole_split(parser, inside, text, reasoning, content):
    """Every cut into 1-4 pieces (and 50 random cuts into characters' runs): the deltas, joined,
    are the whole reply's fields; nothing is sent twice or taken back."""
    rng = random.Random(0)
    cuts = [list(c) for n in range(0, min(3, len(text)) + 1)
            for c in itertools.combinations(range(1, len(text)), n)]
    cuts += [sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
             for _ in range(50) if len(text) > 1]
    for cut in cuts:
        split = Reasoning(parser, inside)
        got = {"reasoning": "", "content": ""}
        for end in cut + [len(text)]:
            delta = split.delta(text[:end], final=end == len(text))
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for k in got:
                got[k] += delta.get(k, "")
        assert (got["reasoning"] or None, got["content"] or None) == \
            (reasoning or None, content or None), cut


FORCED = [  # nemotron_v3 with thinking off / force_nonempty_content: (prompt opens, reply,
    # reasoning, content) of the message
    (True, "only thinking \n", None, "only thinking"),
    (False, "<think>x</think>", None, "x"),
    (True, "x</think>  ", "  ", "x"),  # whitespace content: swapped, as vLLM does
    (True, "x</think>y", "x", "y"),  # content: nothing to do
    (False, "plain", None, "plain"),
    (False, "", None, ""),
]


@pytest.mark.parametrize("inside, text, reasoning, content", FORCED)
def test_forced_content_message_and_stream(inside, text, reasoning, content):
    """The message swaps an empty-content reply's reasoning into its content; a stream sends
    the reasoning as it comes and, in its last delta, the reasoning again as the content (the
    content deltas joined are the message's content)."""
    msg = Reasoning("nemotron_v3", inside, force_content=True).message(text)
    assert msg == {"content": content, "reasoning": reasoning, "reasoning_content": reasoning}
    for cut in [[]] + [[i] for i in range(1, len(text))]:
        split = Reasoning("nemotron_v3", inside, force_content=True)
        got = {"reasoning": "", "content": ""}
        for end in cut + [len(text)]:
            delta = split.delta(text[:end], final=end == len(text))
            for k in got:
                got[k] += delta.get(k, "")
        assert (got["content"] or None) == (content or None), cut
        unforced = Reasoning("nemotron_v3", inside).message(text)
        assert (got["reasoning"] or None) == unforced["reasoning"], cut
    # other parsers, and nemotron_v3 without the request's kwargs, never swap
    assert Reasoning("qwen3", True, force_content=True).message("t") == \
        {"content": None, "reasoning": "t", "reasoning_content": "t"}
    assert Reasoning("nemotron_v3", True).message("t ")["content"] is None


def test_forces_content_reads_the_template_kwargs():
    from specdeploy.serving.reasoning import forces_content

    assert forces_content({"enable_thinking": False})
    assert forces_content({"thinking": False}) and forces_content({"force_nonempty_content": True})
    for kw in (None, {}, {"enable_thinking": True}, {"enable_thinking": 0},
               {"force_nonempty_content": "yes"}, {"other": False}):
        assert not forces_content(kw), kw


def test_bad_parser_name():
    with pytest.raises(ValueError, match="reasoning_parser"):
        Reasoning("r2")


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path_factory.mktemp("reasoning"))
    with serve(create_app(target.llm(None), model_name="m", reasoning_parser="qwen3")) as srv:
        yield srv.client(None)


SHAPE = "<think>[a-z]{3,6}</think>[A-Z]{2,4}"  # the grammar makes a thinking reply
MSG = [{"role": "user", "content": "Think first"}]


def test_server_splits_messages_and_streams(server):
    import re

    r = server.chat.completions.create(model="m", messages=MSG, max_tokens=40, temperature=0,
                                       extra_body={"guided_regex": SHAPE})
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning"]
    assert re.fullmatch("[a-z]{3,6}", reasoning) and re.fullmatch("[A-Z]{2,4}", m.content)
    assert m.model_extra["reasoning_content"] == reasoning
    parts = {"reasoning": "", "content": ""}
    for chunk in server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                                temperature=0, stream=True,
                                                extra_body={"guided_regex": SHAPE}):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["content"] += d.content or ""
            parts["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
    assert parts == {"reasoning": reasoning, "content": m.content}
    plain = server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                           temperature=0, extra_body={"guided_regex": "[a-z]+"})
    assert plain.choices[0].message.model_extra["reasoning"] is None  # no block: content
    hidden = server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                            temperature=0, extra_body={
                                                "guided_regex": SHAPE, "include_reasoning": False})
    assert hidden.choices[0].message.content == m.content
    assert "reasoning" not in (hidden.choices[0].message.model_extra or {})
    with pytest.raises(openai.BadRequestError) as e:
        server.chat.completions.create(model="m", messages=MSG, max_tokens=4,
                                       extra_body={"include_reasoning": "no"})
    assert e.value.body["param"] == "include_reasoning"


def test_prompt_opens_thinking():
    """Qwen3.5's template ends its generation prompt with an open block: the reply thinks."""
    from specdeploy.serving.reasoning import prompt_opens_thinking

    class Tok:
        def __init__(self, text):
            self.text = text

        def decode(self, ids):
            return self.text

    assert prompt_opens_thinking(Tok("<|im_start|>assistant\n<think>\n"), [1, 2])
    assert not prompt_opens_thinking(Tok("<|im_start|>assistant\n<think>\n\n</think>\n\n"), [1])
    assert not prompt_opens_thinking(Tok("<|im_start|>assistant\n"), [1])


@pytest.fixture(scope="module")
def nemotron_server(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("nemotron_h", tmp_path_factory.mktemp("reasoning_nemotron"))
    with serve(create_app(target.llm(None), model_name="m",
                          reasoning_parser="nemotron_v3")) as srv:
        yield srv.client(None)


def test_nemotron_v3_server_gives_thinking_as_content_when_asked(nemotron_server):
    """A tiny NemotronH whose reply a grammar makes all thinking: reasoning by default; with
    `enable_thinking: false` in chat_template_kwargs, the reasoning comes as the content, in the
    message and in the stream's content deltas."""
    import re

    shape = "<think>[a-z]{3,6} </think>"
    kw = {"guided_regex": shape}
    m = nemotron_server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                                temperature=0, extra_body=kw).choices[0].message
    thought = m.model_extra["reasoning"]
    assert re.fullmatch("[a-z]{3,6}", thought) and m.content is None
    off = {**kw, "chat_template_kwargs": {"enable_thinking": False}}
    m = nemotron_server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                                temperature=0, extra_body=off).choices[0].message
    assert m.content == thought and m.model_extra["reasoning"] is None
    content = ""
    for chunk in nemotron_server.chat.completions.create(model="m", messages=MSG, max_tokens=40,
                                                         temperature=0, stream=True,
                                                         extra_body=off):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
    assert content == thought
