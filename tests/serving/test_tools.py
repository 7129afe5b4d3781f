"""Tool calling (serving/tools.py): the Hermes parser against hand-written replies, its stream
against the whole reply under every cut, the tool_choice plans and their errors, and the server
(a tiny model whose replies a regex grammar shapes into calls, or structured output holds to a
tool's schema)."""
from __future__ import annotations

import itertools
import json
import re

import openai
import pytest

from specdeploy.serving.errors import APIError
from specdeploy.serving.tools import ToolPlan, ToolReply, parse_hermes, plan

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
HERMES = [  # (reply, content, [(name, arguments)])
    ("no calls here", "no calls here", []),
    ("Sure." + CALL, "Sure.", [("f", '{"x": 1}')]),
    (CALL + "\n" + CALL.replace('"f"', '"g"'), None, [("f", '{"x": 1}'), ("g", '{"x": 1}')]),
    ("a" + CALL[:-3], "a" + CALL[:-3], []),  # never closed: text
    ("a<tool_call>{not json}</tool_call>", "a<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "h"}</tool_call>', None, [("h", "{}")]),
]


@pytest.mark.parametrize("reply, content, calls", HERMES)
def test_hermes_whole_replies(reply, content, calls):
    assert parse_hermes(reply) == (content, calls)
    msg, reason = ToolReply(ToolPlan("auto")).message(reply, "stop")
    assert msg["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])] == calls
    assert reason == ("tool_calls" if calls else "stop")
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in msg.get("tool_calls", []))


@pytest.mark.parametrize("reply, content, calls", HERMES)
def test_hermes_stream_sends_each_call_once(reply, content, calls):
    """Every cut into up to 3 pieces: the text deltas join to the content (or, for a block
    that never closes or does not parse, the whole text), each call comes once, in order."""
    for n in range(0, 4):
        for cut in itertools.combinations(range(1, len(reply)), n):
            rep = ToolReply(ToolPlan("auto"))
            text, got = "", []
            for end in list(cut) + [len(reply)]:
                d = rep.delta(reply[:end], end == len(reply), "stop")
                text += d.get("content", "")
                got += [(c["index"], c["function"]["name"], c["function"]["arguments"])
                        for c in d.get("tool_calls", [])]
            assert got == [(i, nm, a) for i, (nm, a) in enumerate(calls)], cut
            assert text == (content or "" if calls else reply), cut
            assert rep.finish("stop") == ("tool_calls" if calls else "stop")


XML = ("Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n"
       "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=alerts>\ntrue\n"
       "</parameter>\n<parameter=note>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_xml_calls_take_their_schema_types():
    """Strings as written (even when they look like numbers), typed values as JSON, untyped
    ones as JSON where they parse; a typed value that does not parse leaves the reply text."""
    from specdeploy.serving.tools import parse_calls

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "alerts": {"type": "boolean"}}}}}]
    content, calls = parse_calls("qwen3_coder", XML, tools)
    assert content == "Let me check." and calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": "San Jose", "days": 3, "alerts": True,
                                       "note": {"a": 1}}
    as_text = XML.replace("San Jose", "42")
    assert json.loads(parse_calls("qwen3_xml", as_text, tools)[1][0][1])["city"] == "42"
    broken = XML.replace("\n3\n", "\nthree\n")
    assert parse_calls("qwen3_coder", broken, tools) == (broken, [])
    rep = ToolReply(ToolPlan("auto", tools=tools, parser="qwen3_coder"))
    deltas = [rep.delta(XML[:end], end == len(XML), "stop") for end in range(1, len(XML) + 1)]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert json.loads(call["function"]["arguments"])["days"] == 3


GLM45 = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Jose"
         "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note"
         "</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n</tool_call>")


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_glm_calls(parser):
    """GLM-4.5's layout (a newline after the name and each tag) and GLM-4.7's (none): the name,
    then key / value pairs; values typed as the XML parser's; two calls; a malformed block (a
    value without its key, a typed value that does not parse) leaves the reply text; the
    stream sends the call once, after the text before it."""
    from specdeploy.serving.tools import parse_calls

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}
    }}}]
    reply = GLM45 if parser == "glm45" else GLM45.replace("\n", "")
    content, calls = parse_calls(parser, reply, tools)
    assert content == "Checking." and [c[0] for c in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == {"city": "San Jose", "days": 3, "note": {"a": [1, 2]}}
    two = reply + "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value>" \
        "</tool_call>"
    assert [(n, json.loads(a)) for n, a in parse_calls(parser, two, tools)[1]][1] == (
        "get_time", {"zone": "UTC"})
    bare = "<tool_call>ping</tool_call>"
    assert parse_calls(parser, bare, tools) == (None, [("ping", "{}")])
    for broken in (reply.replace("<arg_key>days</arg_key>", ""),
                   reply.replace(">3<", ">three<"), "<tool_call>a b<c</tool_call>"):
        assert parse_calls(parser, broken, tools) == (broken, [])
    rep = ToolReply(ToolPlan("auto", tools=tools, parser=parser))
    deltas = [rep.delta(reply[:end], end == len(reply), "stop")
              for end in range(1, len(reply) + 1)]
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert json.loads(call["function"]["arguments"])["days"] == 3


def test_glm45_reasoning_split():
    """GLM's thinking: a reply that opens `<think>` thinks until `</think>`; one without it (the
    template closed an empty block: thinking off) is all content."""
    from specdeploy.serving.reasoning import Reasoning

    r = Reasoning("glm45")
    assert r.message("<think>hmm</think>The answer.") == {
        "content": "The answer.", "reasoning": "hmm", "reasoning_content": "hmm"}
    assert r.message("Just text.")["content"] == "Just text."
    text = "<think>a b</think>ok"
    s = Reasoning("glm45")
    parts = [s.delta(text[:i], i == len(text)) for i in range(1, len(text) + 1)]
    assert "".join(p.get("reasoning", "") for p in parts) == "a b"
    assert "".join(p.get("content", "") for p in parts) == "ok"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}}}]


def test_plans_and_their_errors():
    assert plan({"messages": []}, None) is None
    assert plan({"tools": TOOLS, "tool_choice": "none"}, None).kind == "none"
    assert plan({"tools": TOOLS}, "hermes").kind == "auto"
    named = plan({"tools": TOOLS, "tool_choice": {"type": "function",
                                                  "function": {"name": "get_time"}}}, None)
    assert named.kind == "named" and named.guided_json == TOOLS[1]["function"]["parameters"]
    req = plan({"tools": TOOLS, "tool_choice": "required"}, None)
    assert req.guided_json["type"] == "array" and len(req.guided_json["items"]["anyOf"]) == 2
    for body, param in (({"tools": TOOLS}, "tool_choice"),  # auto by default: no parser
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {}}],
                          "tool_choice": "none"}, "tools[0].function.name"),
                        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "none"},
                         "tools[2].function.name")):
        with pytest.raises(APIError) as e:
            plan(body, None)
        assert e.value.param == param, body


@pytest.fixture(scope="module")
def client(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path_factory.mktemp("tools"))
    app = create_app(target.llm(None), model_name="m", enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
    with serve(app) as srv:
        yield srv.client(None)


MSG = [{"role": "user", "content": "Weather in Paris?"}]
SHAPE = r'Ok<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,3}"\}\}' \
        r'</tool_call>'


def test_auto_calls_in_responses_and_streams(client):
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=80,
                                       temperature=0, extra_body={"guided_regex": SHAPE})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Ok"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch("[A-Z][a-z]{1,3}", json.loads(call.function.arguments)["city"])
    content, calls, reasons = "", [], []
    for chunk in client.chat.completions.create(model="m", messages=MSG, tools=TOOLS,
                                                max_tokens=80, temperature=0, stream=True,
                                                extra_body={"guided_regex": SHAPE}):
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += [(t.index, t.function.name, t.function.arguments) for t in d.tool_calls or []]
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Ok" and calls == [(0, "get_weather", call.function.arguments)]
    assert reasons[-1] == "tool_calls"
    plain = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=8,
                                           temperature=0, extra_body={"guided_regex": "[a-z]+"})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_named_and_required_calls_follow_the_schemas(client):
    r = client.chat.completions.create(
        model="m", messages=MSG, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.content
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert set(args) == {"city"} and len(args["city"]) <= 5
    # the tiny model's array would go on: "]" (the tiny tokenizer's id 3 + 93 - 32) favoured
    close = {"logit_bias": {str(3 + ord("]") - 32): 30}}
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=200,
                                       temperature=0, tool_choice="required", **close)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1
    for t in c.message.tool_calls:
        args = json.loads(t.function.arguments)
        assert (t.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    streamed = [t for chunk in client.chat.completions.create(
        model="m", messages=MSG, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice="required", stream=True, **close)
        for t in chunk.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_history_with_calls_and_results(client):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4,
                                       tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    bad = [dict(history[1], tool_calls=[{"function": {"name": "get_weather",
                                                      "arguments": "{oops"}}])]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG + bad, max_tokens=4)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=4,
                                       tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"


def test_thinking_then_calls(tmp_path, serve):
    """--reasoning-parser qwen3 with the Hermes parser: the thinking apart first, then the
    calls out of what is content; the stream spells the same."""
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path)
    app = create_app(target.llm(None), model_name="m", reasoning_parser="qwen3",
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    shape = "<think>[a-z]{2,3}</think>" + SHAPE
    with serve(app) as srv:
        c = srv.client(None)
        kw = dict(model="m", messages=MSG, tools=TOOLS, max_tokens=100, temperature=0,
                  extra_body={"guided_regex": shape})
        m = c.chat.completions.create(**kw).choices[0].message
        assert re.fullmatch("[a-z]{2,3}", m.model_extra["reasoning"]) and m.content == "Ok"
        assert m.tool_calls[0].function.name == "get_weather"
        got = {"reasoning": "", "content": "", "calls": []}
        for chunk in c.chat.completions.create(**kw, stream=True):
            d = chunk.choices[0].delta
            got["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
            got["content"] += d.content or ""
            got["calls"] += [t.function.arguments for t in d.tool_calls or []]
        assert got == {"reasoning": m.model_extra["reasoning"], "content": "Ok",
                       "calls": [m.tool_calls[0].function.arguments]}


def test_qwen3_coder_calls_through_the_server(tmp_path, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    app = create_app(Target("llama", tmp_path).llm(None), model_name="m",
                     enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    shape = (r"<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n"
             r"</function>\n</tool_call>")
    with serve(app) as srv:
        r = srv.client(None).chat.completions.create(
            model="m", messages=MSG, tools=TOOLS, max_tokens=100, temperature=0,
            extra_body={"guided_regex": shape})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == \
            "get_time"
        assert json.loads(c.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_glm45_calls_and_thinking_through_the_server(tmp_path, serve):
    """`--reasoning-parser glm45 --tool-call-parser glm45`: the thinking apart, then the call
    out of the content."""
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    app = create_app(Target("llama", tmp_path).llm(None), model_name="m",
                     reasoning_parser="glm45", enable_auto_tool_choice=True,
                     tool_call_parser="glm45")
    shape = (r"<think>[a-z]{2,3}</think><tool_call>get_time\n<arg_key>zone</arg_key>\n"
             r"<arg_value>(UTC|CET)</arg_value>\n</tool_call>")
    with serve(app) as srv:
        r = srv.client(None).chat.completions.create(
            model="m", messages=MSG, tools=TOOLS, max_tokens=200, temperature=0,
            extra_body={"guided_regex": shape})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == \
            "get_time"
        assert json.loads(c.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
        assert re.fullmatch("[a-z]{2,3}", c.message.model_extra["reasoning"])
