"""gpt-oss deployments in harmony (serving/harmony.py, tokenizer.py): a harmony-style chat
template (written here in the released chat_template.jinja's structure) rendered with tools and
an earlier call and its result, its errors; generation stops at <|return|> / <|call|>, never at
<|end|>, whatever the files declare; and a tiny gpt-oss served with `--reasoning-parser
openai_gptoss --tool-call-parser openai` whose reply a regex grammar forces into a call."""
from __future__ import annotations

import datetime
import json
import re

import openai
import pytest

from specdeploy.checkpoint.tiny import write_tiny_tokenizer

# the tiny character tokenizer (checkpoint/tiny.py) with harmony's special tokens
SPECIALS = {100: "<|start|>", 101: "<|end|>", 102: "<|message|>", 103: "<|channel|>",
            104: "<|constrain|>", 105: "<|return|>", 106: "<|call|>"}
RETURN, END, CALL = 105, 101, 106

# The released template's structure: system message (identity, dates, reasoning, channels), a
# developer message (instructions, tools as a TypeScript namespace), earlier calls addressed
# in the role part, tool results from `functions.NAME`, `<|start|>assistant` to generate.
TEMPLATE = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.enum is defined -%}{{- spec.enum | map("tojson") | join(" | ") -}}
    {%- elif spec.type == "integer" or spec.type == "number" -%}{{- "number" -}}
    {%- elif spec.type == "array" -%}{{- ts_type(spec["items"]) + "[]" -}}
    {%- elif spec.type == "string" or spec.type == "boolean" -%}{{- spec.type -}}
    {%- else -%}{{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
    {{- "## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function -%}
        {%- if fn.description -%}{{- "// " + fn.description + "\n" -}}{%- endif -%}
        {%- set params = fn.parameters or {} -%}
        {%- if params.properties -%}
            {{- "type " + fn.name + " = (_: {\n" -}}
            {%- for name, spec in params.properties.items() -%}
                {%- if spec.description -%}{{- "// " + spec.description + "\n" -}}{%- endif -%}
                {{- name + ("" if name in params.get("required", []) else "?") + ": "
                    + ts_type(spec) + ",\n" -}}
            {%- endfor -%}
            {{- "}) => any;\n\n" -}}
        {%- else -%}
            {{- "type " + fn.name + " = () => any;\n\n" -}}
        {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
{%- endmacro -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" -}}
{{- "Knowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\n" -}}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- if messages[0].role in ("system", "developer") -%}
    {%- set instructions = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}{{- "# Instructions\n\n" + instructions + "\n\n" -}}{%- endif -%}
    {%- if tools -%}{{- "# Tools\n\n" + render_tools(tools) -}}{%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}
{%- set last_call = namespace(name=none) -%}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" and message.tool_calls -%}
        {%- set later_final = namespace(found=false) -%}
        {%- for m in loop_messages[loop.index:] -%}
            {%- if m.role == "assistant" and not m.tool_calls -%}
                {%- set later_final.found = true -%}
            {%- endif -%}
        {%- endfor -%}
        {%- if message.content and not later_final.found -%}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" -}}
        {%- endif -%}
        {%- set call = message.tool_calls[0].function -%}
        {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json"
            + "<|message|>" + call.arguments | tojson + "<|call|>" -}}
        {%- set last_call.name = call.name -%}
    {%- elif message.role == "assistant" -%}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
        {%- set last_call.name = none -%}
    {%- elif message.role == "tool" -%}
        {%- if last_call.name is none -%}
            {{- raise_exception("Message has tool role, but there was no previous assistant "
                                + "message with a tool call!") -}}
        {%- endif -%}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary"
            + "<|message|>" + message.content | tojson + "<|end|>" -}}
    {%- elif message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "The city and state, e.g. San Francisco, CA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}}]
HISTORY = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_current_weather", "arguments": '{"location": "San Francisco"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'}]


def harmony_dir(path, eos=(RETURN, 0, CALL)):
    """A tiny gpt-oss checkpoint with a harmony vocabulary and template; `eos`: its
    generation_config's eos_token_id (the release's: <|return|>, <|endoftext|>, <|call|>),
    None: no generation_config.json."""
    from specdeploy.models import gpt_oss

    hf = gpt_oss.tiny_hf_config()
    hf.update(eos_token_id=RETURN, pad_token_id=0, max_position_embeddings=2048)
    gpt_oss.make_tiny(path, seed=0, hf_config=hf)
    write_tiny_tokenizer(path, hf["vocab_size"], specials_at=SPECIALS, chat_template=TEMPLATE)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|return|>"}))
    if eos is None:
        (path / "generation_config.json").unlink()
    else:
        (path / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": None, "eos_token_id": list(eos), "pad_token_id": 0}))
    return path


def test_template_renders_tools_an_earlier_call_and_its_result(tmp_path):
    """The rendered prompt, written out by hand from the harmony spec's example."""
    from specdeploy.serving.chat import render_messages
    from specdeploy.serving.protocol import Limits
    from specdeploy.tokenizer import load_tokenizer

    tok = load_tokenizer(harmony_dir(tmp_path / "ckpt"))
    ids, _, plan = render_messages({"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"},
                                   tok, Limits("m", 2048, 2048, 128))
    today = datetime.date.today().strftime("%Y-%m-%d")
    expected = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n"
        "## functions\n\nnamespace functions {\n\n// Gets the location of the user.\n"
        "type get_location = () => any;\n\n"
        "// Gets the current weather in the provided location.\n"
        "type get_current_weather = (_: {\n// The city and state, e.g. San Francisco, CA\n"
        'location: string,\nformat?: "celsius" | "fahrenheit",\n}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant to=functions.get_current_weather<|channel|>commentary json"
        '<|message|>{"location": "San Francisco"}<|call|>'
        "<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"sunny\\": true, \\"temperature\\": 20}"<|end|><|start|>assistant')
    assert tok.decode(ids) == expected
    # each marker is its one special token, not its characters
    assert ids[0] == 100 and ids.count(100) == expected.count("<|start|>")
    assert ids.count(102) == expected.count("<|message|>") and ids.count(CALL) == 1
    assert plan.kind == "none"


def test_template_errors_name_the_problem(tmp_path, serve):
    from specdeploy.serving.chat import render_messages
    from specdeploy.serving.errors import APIError
    from specdeploy.serving.protocol import Limits
    from specdeploy.tokenizer import load_tokenizer

    tok = load_tokenizer(harmony_dir(tmp_path / "ckpt"))
    limits = Limits("m", 2048, 2048, 128)
    orphan = [HISTORY[1], HISTORY[3]]  # a tool result with no call before it
    with pytest.raises(APIError) as e:
        render_messages({"messages": orphan}, tok, limits)
    assert e.value.param == "messages" and e.value.status == 400
    assert "no previous assistant message with a tool call" in str(e.value.message)
    # the request's own template failing: where and why, naming the field
    for template, says in (("{% if %}x{% endif %}", "does not parse: line 1: Expected an "
                            "expression"),
                           ("x\n{{ messages[0].content + 1 }}", "failed at line 2: TypeError")):
        with pytest.raises(APIError) as e:
            render_messages({"messages": HISTORY[1:2], "chat_template": template}, tok, limits)
        assert e.value.param == "chat_template" and says in str(e.value.message), template


@pytest.mark.parametrize("eos", [(RETURN, 0, CALL), None, (END,)])
def test_generation_stops_at_return_and_call_not_end(tmp_path, eos):
    """The release's generation_config, none, or one that names <|end|> alone: a harmony
    vocabulary always stops at <|return|> and <|call|> (not in the text), never at <|end|>."""
    from specdeploy import LLM, SamplingParams

    llm = LLM(str(harmony_dir(tmp_path / "ckpt", eos)), max_batch_size=2, max_seq_len=64,
              max_cache_gib=0.01)
    assert {RETURN, CALL} <= llm.engine.eos_token_ids and END not in llm.engine.eos_token_ids
    prompt = llm.tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant",
                                  add_special_tokens=False)
    for stop in (RETURN, CALL):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                       logit_bias={stop: 100.0}))
        assert (out.token_ids, out.text, out.finish_reason) == ([stop], "", "stop")
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0,
                                                   logit_bias={END: 100.0}))
    assert (out.token_ids, out.text, out.finish_reason) == ([END] * 3, "<|end|>" * 3, "length")


def test_gguf_harmony_vocabulary_stops(tmp_path):
    """A GGUF that names <|return|> as EOS and <|end|> as EOT (llama.cpp's keys): the stops
    are <|return|> and <|call|>."""
    gguf = pytest.importorskip("gguf")
    from specdeploy.tokenizer import load_tokenizer
    from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer

    write_tiny_tokenizer(tmp_path, 128, specials_at=SPECIALS)
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    add_tokenizer(w, tmp_path, 128)
    w.add_eos_token_id(RETURN)
    w.add_eot_token_id(END)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_tokenizer(tmp_path / "v.gguf").eos_token_ids == [RETURN, CALL]
    plain = tmp_path / "plain"
    plain.mkdir()
    write_tiny_tokenizer(plain, 128)  # no harmony tokens: its files' EOS only
    assert load_tokenizer(plain).eos_token_ids == [2]


TIME = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MSG = [{"role": "user", "content": "Time?"}]
SHAPE = (r"<\|channel\|>analysis<\|message\|>[a-z]{2,4}<\|end\|><\|start\|>assistant"
         r"<\|channel\|>commentary to=functions\.get_time <\|constrain\|>json<\|message\|>"
         r'\{"zone": "(UTC|CET)"\}')


def test_calls_and_reasoning_through_the_server(tmp_path, serve):
    """`--reasoning-parser openai_gptoss --tool-call-parser openai` on a tiny gpt-oss: the
    analysis apart, the commentary message to functions.get_time as a call (response and
    stream alike), finish_reason tool_calls; the next turn (the call and its result in the
    history) renders, and a final-channel reply is content."""
    from specdeploy import LLM
    from specdeploy.serving.app import create_app

    llm = LLM(str(harmony_dir(tmp_path / "ckpt")), max_batch_size=2, max_seq_len=1024,
              max_cache_gib=0.05)
    app = create_app(llm, model_name="m", reasoning_parser="openai_gptoss",
                     enable_auto_tool_choice=True, tool_call_parser="openai")
    with serve(app) as srv:
        client = srv.client(None)
        kw = dict(model="m", messages=MSG, tools=TIME, max_tokens=300, temperature=0,
                  extra_body={"guided_regex": SHAPE})
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        thought = c.message.model_extra["reasoning"]
        assert re.fullmatch("[a-z]{2,4}", thought)
        got, reasons = {"reasoning": "", "content": "", "calls": []}, []
        for chunk in client.chat.completions.create(**kw, stream=True):
            d = chunk.choices[0].delta
            got["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
            got["content"] += d.content or ""
            got["calls"] += [(t.index, t.function.name, t.function.arguments)
                             for t in d.tool_calls or []]
            reasons.append(chunk.choices[0].finish_reason)
        assert got == {"reasoning": thought, "content": "",
                       "calls": [(0, "get_time", call.function.arguments)]}
        assert reasons[-1] == "tool_calls"
        turn = MSG + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
        final = r"<\|channel\|>final<\|message\|>It is [0-9]{2}\."
        c = client.chat.completions.create(model="m", messages=turn, tools=TIME,
                                           max_tokens=40, temperature=0,
                                           extra_body={"guided_regex": final}).choices[0]
        assert c.finish_reason == "stop" and c.message.tool_calls is None
        assert re.fullmatch(r"It is [0-9]{2}\.", c.message.content)
        assert c.message.model_extra["reasoning"] is None
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MSG, max_tokens=4,
                                           extra_body={"skip_special_tokens": True})
        assert e.value.body["param"] == "skip_special_tokens"
