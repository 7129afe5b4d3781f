"""Tool calling on `/v1/chat/completions`, vLLM's way:

- `tool_choice: "auto"` (needs `--enable-auto-tool-choice --tool-call-parser P`): the model
  writes calls as `<tool_call>...</tool_call>` blocks, JSON `{"name": ..., "arguments": {...}}`
  in them (P = "hermes": the format Qwen2.5 / Qwen3's templates teach) or XML
  `<function=NAME><parameter=KEY>VALUE</parameter></function>` (P = "qwen3_coder" or
  "qwen3_xml": Qwen3-Coder, Qwen3.5; values take their parameter's JSON-schema type) or GLM's
  `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...` (P = "glm45" / "glm47": GLM-4.5 /
  4.6 write a newline after the name and each tag, 4.7 none; values typed as the XML's); they are
  parsed out of the reply into `tool_calls`, `finish_reason` "tool_calls", `content` the text
  before the first block. P = "openai" (gpt-oss): harmony messages addressed
  `to=functions.NAME` are the calls, the `final` channel the content (serving/harmony.py).
- `tool_choice: {"type": "function", "function": {"name": F}}`: the reply is F's arguments,
  held to F's `parameters` schema by structured output (engine/grammar.py); one call to F.
- `tool_choice: "required"`: the reply is a JSON array of `{"name", "parameters"}` objects, one
  of the tools each, held to that schema; one call per element.
- `tool_choice: "none"`: the template describes the tools; the reply is text. Tools without a
  tool_choice mean "auto" (vLLM's default).

A stream sends text until a block may begin (a `<tool_c` is held back), then each call as one
delta when its block closes and parses; a block that never closes or does not parse is sent as
text at the end. NOTE: a whole response with such a block is all text, while the stream has
already sent the calls before it (vLLM's streams behave the same way).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdeploy.serving import harmony
from specdeploy.serving.errors import bad
from specdeploy.serving.reasoning import held as _held

# "hermes": JSON in the block (Qwen2.5 / Qwen3); "qwen3_coder" (= "qwen3_xml"): XML in the
# block, `<function=NAME><parameter=KEY>VALUE</parameter></function>` (Qwen3-Coder, Qwen3.5)
PARSERS = ("hermes", "qwen3_coder", "qwen3_xml", "glm45", "glm47", "openai")
START, END = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def tool_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools`: function definitions (`name`, optional `description`, `parameters`)."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"must be a list of at most {MAX_TOOLS} tools", "invalid_type")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {...}}",
                      "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise bad(f"tools[{i}].function.name", "must be a unique non-empty string",
                      "invalid_value")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object",
                      "invalid_type")
        names.add(name)
    return tools


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


@dataclass
class ToolPlan:
    """What a request's `tool_choice` makes of its reply. `kind`: "none", "auto", "named" or
    "required"; `guided_json`: the schema structured output holds the reply to (named,
    required)."""

    kind: str
    name: str | None = None
    guided_json: dict | None = None
    tools: list = field(default_factory=list)
    parser: str = "hermes"  # the format "auto" parses (PARSERS)


def plan(body: dict, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools). As vLLM: tools without a tool_choice mean
    "auto", which needs a server that parses calls (else 400: pass "none" to have the template
    describe the tools alone)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs `tools`", "invalid_value")
        return None
    tools = check_tools(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools=tools)
    if choice == "auto":
        if parser is None:
            raise bad("tool_choice", "\"auto\" needs the server started with "
                      "--enable-auto-tool-choice and --tool-call-parser", "unsupported")
        return ToolPlan("auto", tools=tools, parser=parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1,
                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        return ToolPlan("required", guided_json=schema, tools=tools)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": "
                  "\"function\", \"function\": {\"name\": ...}}", "invalid_value")
    found = [t for t in tools if t["function"]["name"] == name]
    if not found:
        raise bad("tool_choice", f"names no tool in `tools`: {name!r}", "invalid_value")
    return ToolPlan("named", name=name, guided_json=_parameters(found[0]), tools=tools)


def _parse_json_block(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one Hermes block's body, or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


_FN, _FN_END, _PARAM, _PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"


def _xml_value(raw: str, schema: dict | None):
    """A parameter's text as its schema's type: strings as written (one newline around it
    dropped), numbers, booleans, null, objects and arrays as JSON; without a type, JSON where it
    parses, else the text."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = (schema or {}).get("type")
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        if kind in ("integer", "number", "boolean", "object", "array", "null"):
            raise
        return text


def _parse_xml_block(text: str, tools: list) -> tuple[str, str] | None:
    """(name, arguments JSON) of one Qwen3-Coder block's body, or None (not that shape, or a
    typed value that does not parse)."""
    body = text.strip()
    if not body.startswith(_FN) or not body.endswith(_FN_END):
        return None
    head, _, rest = body[len(_FN):-len(_FN_END)].partition(">")
    name = head.strip()
    if not name:
        return None
    props = next((t["function"].get("parameters") or {} for t in tools
                  if t["function"]["name"] == name), {}).get("properties", {})
    args, pos = {}, 0
    while True:
        i = rest.find(_PARAM, pos)
        if i < 0:
            break
        j = rest.find(">", i)
        k = rest.find(_PARAM_END, j)
        if j < 0 or k < 0:
            return None
        key = rest[i + len(_PARAM):j].strip()
        try:
            args[key] = _xml_value(rest[j + 1:k], props.get(key))
        except ValueError:
            return None
        pos = k + len(_PARAM_END)
    return name, json.dumps(args, ensure_ascii=False)


_KEY, _KEY_END, _VAL, _VAL_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def _parse_glm_block(text: str, tools: list) -> tuple[str, str] | None:
    """(name, arguments JSON) of one GLM block's body (the name, then key / value pairs, any
    whitespace between the tags), or None (not that shape, or a typed value that does not
    parse)."""
    body = text.strip()
    first = body.find(_KEY)
    name = (body if first < 0 else body[:first]).strip()
    if not name or any(ch in name for ch in "<>\n"):
        return None
    props = next((t["function"].get("parameters") or {} for t in tools
                  if t["function"]["name"] == name), {}).get("properties", {})
    args, pos = {}, len(body) if first < 0 else first
    while pos < len(body):
        k0 = body.find(_KEY, pos)
        if k0 < 0 or body[pos:k0].strip():
            return None
        k1 = body.find(_KEY_END, k0)
        v0 = body.find(_VAL, k1)
        v1 = body.find(_VAL_END, v0)
        if min(k1, v0, v1) < 0 or body[k1 + len(_KEY_END):v0].strip():
            return None
        key = body[k0 + len(_KEY):k1].strip()
        try:
            args[key] = _xml_value(body[v0 + len(_VAL):v1], props.get(key))
        except ValueError:
            return None
        pos = v1 + len(_VAL_END)
        if not body[pos:].strip():
            break
    return name, json.dumps(args, ensure_ascii=False)


def parse_block(parser: str, text: str, tools: list) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's body in `parser`'s format, or None."""
    if parser == "hermes":
        return _parse_json_block(text)
    if parser in ("glm45", "glm47"):
        return _parse_glm_block(text, tools)
    return _parse_xml_block(text, tools)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """`parse_calls` of the Hermes format."""
    return parse_calls("hermes", text, [])


def parse_calls(parser: str, text: str, tools: list) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a whole reply: the calls of its complete blocks, the
    text before the first as content; a reply with none, or with a block that does not parse
    or never closes, is all content ("openai": harmony.calls)."""
    if parser == "openai":
        return harmony.calls(text, True)
    calls, pos = [], 0
    first = text.find(START)
    if first < 0:
        return text, []
    while True:
        i = text.find(START, pos)
        if i < 0:
            break
        j = text.find(END, i)
        parsed = None if j < 0 else parse_block(parser, text[i + len(START):j], tools)
        if parsed is None:
            return text, []
        calls.append(parsed)
        pos = j + len(END)
    return (text[:first] if text[:first].strip() else None), calls


@dataclass
class ToolReply:
    """One choice's reply under a tool plan: its whole message, or its stream's deltas."""

    plan: ToolPlan
    head: str | None = None  # "openai": the message the prompt leaves open (harmony.py)
    _sent: int = 0  # characters of the reply handled (sent as text, or parsed as calls)
    _calls: int = 0
    _started: bool = False  # the first block has begun: no more text but failed blocks

    @property
    def reads_messages(self) -> bool:
        """The parser takes the whole reply (harmony's channels), not the reasoning parser's
        content."""
        return self.plan.kind == "auto" and self.plan.parser == "openai"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(message fields, finish_reason) of the whole reply."""
        kind = self.plan.kind
        if self.reads_messages:
            content, calls = harmony.calls(text, True, self.head)
            msg = {"content": content or None}
            if calls:
                msg["tool_calls"] = [tool_call(n, a) for n, a in calls]
            return msg, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)
        if kind == "auto":
            content, calls = parse_calls(self.plan.parser, text, self.plan.tools)
            if calls:
                return {"content": content, "tool_calls": [tool_call(n, a) for n, a in calls]}, \
                    ("tool_calls" if finish_reason == "stop" else finish_reason)
            return {"content": text}, finish_reason
        calls = self._forced(text, finish_reason)
        if calls is None:
            return {"content": text}, finish_reason
        return {"content": None, "tool_calls": [tool_call(n, a) for n, a in calls]}, \
            ("tool_calls" if kind == "required" and finish_reason == "stop" else finish_reason)

    def _forced(self, text: str, finish_reason: str | None) -> list[tuple[str, str]] | None:
        """The calls of a named / required reply (None: cut short, not valid JSON)."""
        if finish_reason != "stop":
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if self.plan.kind == "named":
            return [(self.plan.name, json.dumps(obj, ensure_ascii=False))]
        return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in obj]

    def delta(self, text: str, final: bool, finish_reason: str | None = None) -> dict:
        """Delta fields for the reply's text so far (cumulative): text, and each call once."""
        if self.plan.kind != "auto":  # held to a schema: the calls when the reply is whole
            if not final:
                return {}
            msg, _ = self.message(text, finish_reason)
            return self._calls_delta(msg.get("tool_calls") or []) if "tool_calls" in msg \
                else ({"content": text} if text else {})
        if self.reads_messages:
            content, calls = harmony.calls(text, final, self.head)
            out = {"content": content[self._sent:]} if content and len(content) > self._sent \
                else {}
            self._sent = max(self._sent, len(content or ""))
            if len(calls) > self._calls:
                out.update(self._calls_delta([tool_call(*c) for c in calls[self._calls:]]))
            return out
        out: dict = {}
        calls = []
        if not self._started:  # text until the first block may begin
            i = text.find(START)
            stop = i if i >= 0 else len(text) - (0 if final else _held(text, START))
            if stop > self._sent:
                out["content"] = text[self._sent:stop]
                self._sent = stop
            if i < 0:
                return out
            self._started = True
        while True:  # then the blocks; the text between them is dropped, as in `message`
            i = text.find(START, self._sent)
            if i < 0:  # what may still begin a block stays to be searched again
                self._sent = max(self._sent, len(text) - (0 if final else _held(text, START)))
                break
            j = text.find(END, i)
            if j < 0:
                if final:  # never closed: the block's text, as text
                    out["content"] = out.get("content", "") + text[i:]
                    self._sent = len(text)
                break
            parsed = parse_block(self.plan.parser, text[i + len(START):j], self.plan.tools)
            if parsed is None:  # not a call: its text, as text
                out["content"] = out.get("content", "") + text[i:j + len(END)]
            else:
                calls.append(tool_call(*parsed))
            self._sent = j + len(END)
        if calls:
            out.update(self._calls_delta(calls))
        return out

    def _calls_delta(self, calls: list[dict]) -> dict:
        out = []
        for c in calls:
            out.append({"index": self._calls, **c})
            self._calls += 1
        return {"tool_calls": out}

    def finish(self, reason: str | None) -> str | None:
        """The stream's finish_reason: "tool_calls" where it sent calls (auto, required)."""
        if self._calls and self.plan.kind in ("auto", "required") and reason == "stop":
            return "tool_calls"
        return reason
