"""gpt-oss's harmony format (serving/harmony.py): `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai` against replies written by hand from the format's spec
(openai/harmony docs/format.md), their streams against the whole reply under every cut, and
malformed replies (unterminated messages, non-JSON arguments) as the documented fallbacks."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from specdeploy.serving.reasoning import Reasoning
from specdeploy.serving.tools import ToolPlan, ToolReply, parse_calls

# the generation prompt ends `<|start|>assistant`: a reply opens with its header's channel
ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. '
          'Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.')
WEATHER = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>"
           "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
           '<|message|>{"location":"San Francisco"}')
PLAN = ("<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Will call two.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.a<|constrain|>json<|message|>{"x": [1, 2]}<|call|><|start|>assistant'
        "<|channel|>commentary to=functions.b <|constrain|>json<|message|>{}")
BAD_ARGS = ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.f <|constrain|>json<|message|>{oops")

REASONING = [  # (reply, reasoning, content)
    (ANSWER, 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4."),
    (ANSWER + "<|return|>", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
     "2 + 2 = 4."),  # the stop token kept (ignore_eos): it ends the message
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b"
     "<|end|><|start|>assistant<|channel|>final<|message|>c", "a\nb", "c"),
    ("<|channel|>analysis<|message|>cut while thin", "cut while thin", None),  # max_tokens
    ("<|channel|>final<|message|>Only the answer.", None, "Only the answer."),
    ("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>",
     "r", None),
    (WEATHER, "Need to use function get_weather.", None),  # the call is the tool parser's
    (PLAN, "plan", "Will call two."),  # a preamble (commentary, no recipient) is content
    ("<|channel|>analysis to=python code<|message|>print(2 + 2)", "print(2 + 2)", None),
    # not the format: content as written, from where it stops following it
    ("Plain text, no header.", None, "Plain text, no header."),
    ('{"a": 1}', None, '{"a": 1}'),
    ("<|channel|>analysis", None, "<|channel|>analysis"),  # a header never ended
    ("<|channel|>analysis<|end|>oops", None, "<|channel|>analysis<|end|>oops"),
    ("<|channel|>final<|message|>Hi<|end|> trailing <", None, "Hi\ntrailing <"),
    ("", None, None),
]


def _cuts(text: str, rng: random.Random) -> list[list[int]]:
    """Every cut into 1-3 pieces, each character alone, and 30 random cuts."""
    cuts = [list(c) for n in range(0, 3) for c in itertools.combinations(range(1, len(text)), n)]
    cuts.append(list(range(1, len(text))))
    cuts += [sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
             for _ in range(30) if len(text) > 1]
    return cuts


@pytest.mark.parametrize("text, reasoning, content", REASONING)
def test_reasoning_whole_replies(text, reasoning, content):
    msg = Reasoning("openai_gptoss").message(text)
    assert msg == {"content": content, "reasoning": reasoning, "reasoning_content": reasoning}
    assert Reasoning("openai_gptoss", include=False).message(text) == {"content": content}


@pytest.mark.parametrize("text, reasoning, content", REASONING)
def test_reasoning_stream_spells_the_whole_reply(text, reasoning, content):
    rng = random.Random(0)
    for cut in _cuts(text, rng):
        split = Reasoning("openai_gptoss")
        got = {"reasoning": "", "content": ""}
        for end in cut + [len(text)]:
            delta = split.delta(text[:end], final=end == len(text))
            for k in got:
                got[k] += delta.get(k, "")
        assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content), cut


def test_reasoning_of_a_prompt_that_opened_the_body():
    """A prompt ending in an open message (`...<|channel|>final<|message|>`, e.g.
    continue_final_message): the reply is that message's body."""
    head = "assistant<|channel|>final<|message|>"
    assert Reasoning("openai_gptoss", head=head).message("Sure.<|end|>")["content"] == "Sure."
    head = "assistant<|channel|>analysis<|message|>"
    assert Reasoning("openai_gptoss", head=head).message(
        "hm<|end|><|start|>assistant<|channel|>final<|message|>ok") == {
        "content": "ok", "reasoning": "hm", "reasoning_content": "hm"}


def test_prompt_head():
    from specdeploy.serving.harmony import prompt_head

    class Tok:
        def __init__(self, text):
            self.text = text

        def decode(self, ids):
            return self.text

    assert prompt_head(Tok("<|start|>user<|message|>hi<|end|><|start|>assistant"), [1]) == \
        "assistant"
    assert prompt_head(Tok("<|start|>assistant<|channel|>final<|message|>Sure"), [1]) == \
        "assistant<|channel|>final<|message|>"
    assert prompt_head(Tok("<|start|>user<|message|>hi<|end|>"), [1]) is None
    assert prompt_head(Tok("no harmony here"), [1]) is None


CALLS = [  # (reply, content, [(name, arguments)])
    (WEATHER, None, [("get_weather", '{"location": "San Francisco"}')]),
    # the recipient in the role part (as the released template writes earlier calls)
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}',
     None, [("get_weather", '{"location": "Oslo"}')]),
    (PLAN, "Will call two.", [("a", '{"x": [1, 2]}'), ("b", "{}")]),
    (ANSWER, "2 + 2 = 4.", []),
    ("Plain text.", "Plain text.", []),
    # a body that does not parse as a JSON object, or another recipient: content as written
    (BAD_ARGS, "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
     "<|message|>{oops", []),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1]",
     "<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1]", []),
    ('<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}',
     '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}', []),
    ('<|channel|>commentary to=functions.g <|constrain|>json<|message|>{"a": 1}<|end|>'
     "<|start|>assistant<|channel|>commentary to=functions.h json<|message|>{bad",
     "<|start|>assistant<|channel|>commentary to=functions.h json<|message|>{bad",
     [("g", '{"a": 1}')]),
]


@pytest.mark.parametrize("text, content, calls", CALLS)
def test_openai_tool_parser_whole_replies(text, content, calls):
    assert parse_calls("openai", text, []) == (content, calls)
    msg, reason = ToolReply(ToolPlan("auto", parser="openai")).message(text, "stop")
    assert msg["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])] == calls
    assert reason == ("tool_calls" if calls else "stop")
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in msg.get("tool_calls", []))
    # cut by max_tokens: the finish reason stays "length"
    assert ToolReply(ToolPlan("auto", parser="openai")).message(text, "length")[1] == "length"


@pytest.mark.parametrize("text, content, calls", CALLS)
def test_openai_tool_parser_stream_sends_each_call_once(text, content, calls):
    rng = random.Random(1)
    for cut in _cuts(text, rng):
        rep = ToolReply(ToolPlan("auto", parser="openai"))
        got_text, got = "", []
        for end in cut + [len(text)]:
            d = rep.delta(text[:end], end == len(text), "stop")
            got_text += d.get("content", "")
            got += [(c["index"], c["function"]["name"], c["function"]["arguments"])
                    for c in d.get("tool_calls", [])]
        assert got == [(i, n, a) for i, (n, a) in enumerate(calls)], cut
        assert (got_text or None) == content, cut
        assert rep.finish("stop") == ("tool_calls" if calls else "stop")


def test_a_call_goes_out_when_its_message_ends():
    """The stream sends a call once its message is closed (`<|end|>`, `<|call|>` or the next
    `<|start|>`), not while its arguments may still grow."""
    rep = ToolReply(ToolPlan("auto", parser="openai"))
    part = '<|channel|>commentary to=functions.g <|constrain|>json<|message|>{"a": 1}'
    assert "tool_calls" not in rep.delta(part, False)
    d = rep.delta(part + "<|call|>", False)
    assert json.loads(d["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert rep.delta(part + "<|call|>", True) == {}


def test_reasoning_and_tools_together():
    """Both parsers on one reply, as the server composes them (serving/replies.py): reasoning
    from the analysis channel, content and calls from the tool parser on the whole reply."""
    from specdeploy.serving.protocol import GenerationRequest
    from specdeploy.serving.replies import _parsed_delta
    from specdeploy.serving.responses import response_body

    def request():
        return GenerationRequest(True, "m", [[1]], [None], False, False, None, 1, None,
                                 [Reasoning("openai_gptoss")],
                                 [ToolReply(ToolPlan("auto", parser="openai"))])

    body = response_body(request(), "id", 0, [PLAN], ["stop"], {})
    m = body["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == ("plan", "Will call two.")
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["a", "b"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    req, got = request(), {"reasoning": "", "content": "", "calls": []}
    for end in range(1, len(PLAN) + 1):
        d = _parsed_delta(req, 0, PLAN[:end], end == len(PLAN), "stop")
        got["reasoning"] += d.get("reasoning", "")
        got["content"] += d.get("content", "")
        got["calls"] += [c["function"]["name"] for c in d.get("tool_calls", [])]
    assert got == {"reasoning": "plan", "content": "Will call two.", "calls": ["a", "b"]}
