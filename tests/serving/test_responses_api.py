"""`/v1/responses` (OpenAI's Responses API, as vLLM serves it) on a tiny Llama with the qwen3
reasoning parser, through the openai client (whose typed objects check the shapes). Oracles:
the chat endpoint's reply to the same conversation (a Responses request is that chat request),
the unstreamed response for a stream, a JSON schema's own validation."""
from __future__ import annotations

import json
import re

import openai
import pytest

MSGS = [{"role": "user", "content": "Hello there"}]
GREEDY = dict(model="m", temperature=0, extra_body={"ignore_eos": True})
SHAPE = "<think>[a-z]{3,6}</think>[A-Z]{2,4}"  # a grammar-shaped thinking reply


@pytest.fixture(scope="module")
def client(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path_factory.mktemp("responses"))
    with serve(create_app(target.llm(None), model_name="m", reasoning_parser="qwen3")) as srv:
        yield srv.client(None)


def _chat(client, messages, n=8, **kw):
    return client.chat.completions.create(messages=messages, max_tokens=n, **GREEDY, **kw)


def test_text_is_the_chat_reply_and_a_cut_reply_is_incomplete(client):
    r = client.responses.create(input="Hello there", max_output_tokens=8, **GREEDY)
    chat = _chat(client, MSGS)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert r.usage.total_tokens == chat.usage.total_tokens and r.store is False


def test_instructions_and_message_lists(client):
    convo = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    want = _chat(client, convo).choices[0].message.content
    r = client.responses.create(
        instructions="Be brief", max_output_tokens=8, **GREEDY,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello"}]},
               {"role": "user", "content": "Again"}])
    assert r.output_text == want and r.instructions == "Be brief"


def test_stream_events_spell_the_response(client):
    whole = client.responses.create(input="Hello there", max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(input="Hello there", max_output_tokens=10,
                                          stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_reasoning_becomes_its_own_item(client):
    r = client.responses.create(input="Think first", max_output_tokens=40, temperature=0,
                                model="m", extra_body={"guided_regex": SHAPE})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert re.fullmatch("[a-z]{3,6}", r.output[0].content[0].text)
    assert re.fullmatch("[A-Z]{2,4}", r.output_text) and r.status == "completed"
    events = list(client.responses.create(input="Think first", max_output_tokens=40,
                                          temperature=0, model="m", stream=True,
                                          extra_body={"guided_regex": SHAPE}))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == (r.output[0].content[0].text, r.output_text)
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"] and events[-1].type == "response.completed"


def test_json_schema_format_and_logprobs(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(input="A number", max_output_tokens=30, model="m",
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "n", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["a"], int)
    r = client.responses.create(input="Hello there", max_output_tokens=6, top_logprobs=2,
                                **GREEDY)
    chat = _chat(client, MSGS, 6, logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in got] == [(x.token, x.logprob) for x in want]
    assert all(len(x.top_logprobs) == 2 for x in got)


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
     "input[0].output"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
])
def test_refusals_name_the_responses_field(client, extra, param):
    body = {"input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": "m", **body}, cast_to=object)
    assert e.value.body["param"] == param


# ---- function tools (a server with vLLM's tool flags; hermes calls shaped by a grammar) --------
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                if k != "type"}}]
CALL = (r'Ok<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,3}"\}\}'
        r'</tool_call>')


@pytest.fixture(scope="module")
def tools_client(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path_factory.mktemp("responses_tools"))
    app = create_app(target.llm(None), model_name="m", enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
    with serve(app) as srv:
        yield srv.client(None)


def test_function_calls_come_back_as_items(tools_client):
    kw = dict(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=80,
              temperature=0, extra_body={"guided_regex": CALL})
    r = tools_client.responses.create(**kw)
    chat = tools_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=CHAT_TOOLS, max_tokens=80, temperature=0, extra_body={"guided_regex": CALL})
    (want,) = chat.choices[0].message.tool_calls
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Ok" and r.status == "completed"
    call = r.output[1]
    assert (call.name, call.arguments) == (want.function.name, want.function.arguments)
    assert call.call_id and call.id.startswith("fc_") and r.tools[0].name == "get_weather"
    events = list(tools_client.responses.create(stream=True, **kw))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Ok"


def test_call_and_output_items_are_the_tool_turns(tools_client):
    """function_call / function_call_output input items = chat's assistant tool_calls and tool
    message: the same prompt, so the same greedy reply."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    r = tools_client.responses.create(model="m", input=items, tools=TOOLS, max_output_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    chat = tools_client.chat.completions.create(model="m", messages=msgs, tools=CHAT_TOOLS,
                                                max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


# ---- stored responses (serve --responses-store N) ------------------------------------------
@pytest.fixture(scope="module")
def stored_client(tmp_path_factory, serve):
    from specdeploy.serving.app import create_app
    from tests.spec.tiny_targets import Target

    target = Target("llama", tmp_path_factory.mktemp("responses_store"))
    with serve(create_app(target.llm(None), model_name="m", responses_store=3)) as srv:
        yield srv.client(None)


def _get(client, rid):
    return client.get(f"/responses/{rid}", cast_to=object)


def test_previous_response_id_continues_the_stored_conversation(stored_client):
    """A continued conversation is the stored one, the reply as an assistant turn, then the new
    input: the chat endpoint's reply to those messages (instructions not carried over)."""
    c = stored_client
    first = c.responses.create(input="Hello there", instructions="Be brief",
                               max_output_tokens=6, **GREEDY)
    assert first.store is True and _get(c, first.id)["output"][0]["content"][0]["text"] == \
        first.output_text
    second = c.responses.create(input="Again", previous_response_id=first.id,
                                max_output_tokens=6, **GREEDY)
    assert second.previous_response_id == first.id
    msgs = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Again"}]
    assert second.output_text == _chat(c, msgs, 6).choices[0].message.content
    third = c.responses.create(input="More", previous_response_id=second.id,
                               max_output_tokens=6, stream=True, **GREEDY)
    final = list(third)[-1].response
    assert final.store is True and _get(c, final.id)["id"] == final.id
    msgs += [{"role": "assistant", "content": second.output_text},
             {"role": "user", "content": "More"}]
    assert final.output_text == _chat(c, msgs, 6).choices[0].message.content


def test_the_store_is_bounded_and_store_false_keeps_one_out(stored_client):
    c = stored_client
    kept = c.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    out = c.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        _get(c, out.id)
    for _ in range(3):  # three more: the oldest (kept) leaves
        c.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        _get(c, kept.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="x", previous_response_id=kept.id, max_output_tokens=2,
                           model="m")
    assert e.value.body["param"] == "previous_response_id"
