"""`POST /v1/responses`: OpenAI's Responses API (as vLLM serves it) over the chat path.

A request is translated into a chat request and parsed by chat.py, so every rule and limit of
chat applies; a refusal names the Responses field (`max_output_tokens`, `text.format`, `input`).
- `input`: a string (one user message) or a list of messages ({"role", "content"}, `type`
  "message" or none): content a string or parts `input_text` / `output_text` / `input_image`;
  `instructions`: a system message first. Other items (reasoning items, ...) are refused.
- `max_output_tokens`, `temperature`, `top_p`, `top_logprobs`, `text.format` (text, json_object,
  json_schema), `truncation` ("auto": the input's oldest tokens cut to fit), vLLM's sampling
  extras (`top_k`, `min_p`, `repetition_penalty`, `seed`, penalties), `priority`.
- Function `tools` and `tool_choice` (chat's, so `--enable-auto-tool-choice --tool-call-parser`
  for "auto"); `function_call` / `function_call_output` input items are the assistant's
  tool_calls and the tool messages of the conversation; calls come back as `function_call`
  items.
- `store` / `previous_response_id`: with `serve --responses-store N` the last N responses are
  kept (responses_store.py; `store: false` keeps one out), else `store` answers false and
  `previous_response_id` is refused. `background`, other tool types, `reasoning` options and
  `include` entries other than `message.output_text.logprobs` are refused by name.
The response: `output` = a `reasoning` item (with `--reasoning-parser`, when the reply thinks)
and a `message` item of one `output_text` part; `status` "incomplete" with reason
`max_output_tokens` where the reply was cut. Streaming sends the typed events
(`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`), each with its `sequence_number`.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from specdeploy.serving.chat import parse_chat
from specdeploy.serving.errors import APIError, bad
from specdeploy.serving.fields import _log_unknown as log_unknown

# Responses field -> what chat.py knows it as (a refusal naming the latter names the former)
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "messages": "input", "truncate_prompt_tokens": "truncation"}
_PASSED = ("model", "temperature", "top_p", "stream", "top_k", "min_p", "repetition_penalty",
           "parallel_tool_calls",
           "seed", "presence_penalty", "frequency_penalty", "priority", "user", "metadata",
           "stop", "chat_template_kwargs", "ignore_eos", "min_tokens", "guided_regex",
           "guided_choice", "structured_outputs")
_IGNORED = ("store", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options")
_HANDLED = ("input", "instructions", "max_output_tokens", "text", "top_logprobs", "include",
            "truncation", "tools", "tool_choice", "reasoning")
_REFUSED = ("background", "conversation", "prompt", "max_tool_calls")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _text_parts(content, where: str) -> list | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts", "invalid_type")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": p.get("text")})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{where}[{j}].image_url", "must be a URL string (file_id is not "
                          "supported)", "invalid_value")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad(f"{where}[{j}].type", f"{json.dumps(kind)} is not supported (input_text, "
                      "output_text, input_image are)", "unsupported")
    return out


def _instructions(body: dict) -> list[dict]:
    instr = body.get("instructions")
    if instr is None:
        return []
    if not isinstance(instr, str):
        raise bad("instructions", "must be a string", "invalid_type")
    return [{"role": "system", "content": instr}]


def _messages(body: dict) -> list[dict]:
    """The input as chat messages (without the instructions)."""
    raw = body.get("input")
    msgs: list[dict] = []
    if isinstance(raw, str):
        return msgs + [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input", "must be a string or a non-empty list of messages", "invalid_type")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad(f"input[{i}]", "must be an object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "function_call":  # the model's call: an assistant turn's tool_calls
            call = {"id": _str(item, "call_id", i), "type": "function", "function": {
                "name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _str(item, "call_id", i),
                         "content": _str(item, "output", i)})
        elif kind == "message":
            msgs.append({"role": item.get("role"),
                         "content": _text_parts(item.get("content"), f"input[{i}].content")})
        else:
            raise bad(f"input[{i}].type", f"{json.dumps(kind)} items are not supported "
                      "(message, function_call, function_call_output are)", "unsupported")
    return msgs


def _str(item: dict, key: str, i: int) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"input[{i}].{key}", "must be a string", "invalid_type")
    return v


def _tools(body: dict, out: dict) -> None:
    """Function tools and tool_choice in chat's shapes (the server's tool parser runs them)."""
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list", "invalid_type")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad(f"tools[{i}].type", f"{json.dumps(kind)} tools are not supported "
                          "(function tools are)", "unsupported")
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            out["tools"].append({"type": "function", "function": fn})
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise bad("tool_choice", "must be \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"name\": ...}", "invalid_value")
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    elif tc is not None:
        out["tool_choice"] = tc


def _format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object", "invalid_type")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise bad("text.format", "type must be text, json_object or json_schema",
                  "invalid_value")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema",
                                                                       "strict") if k in fmt}}


def chat_body(body: dict, prior: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """(the chat request a Responses request stands for, the conversation it sends without
    the instructions); `prior`: the stored conversation it continues. 400s name the
    Responses field."""
    for name in _REFUSED:
        if body.get(name) not in (None, False):
            raise bad(name, "is not supported by this server (no background runs or "
                      "conversation objects)", "unsupported")
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict) and all(
            v is None for v in reasoning.values())):
        raise bad("reasoning", f"{json.dumps(reasoning)} is not supported by this server",
                  "unsupported")
    for k in body:
        if k not in _PASSED and k not in _HANDLED and k not in _REFUSED and k not in _IGNORED:
            log_unknown(k, "responses")
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include):
        raise bad("include", f"only {LOGPROBS_INCLUDE!r} is supported", "unsupported")
    out = {k: body[k] for k in _PASSED if k in body}
    history = (prior or []) + _messages(body)
    out["messages"] = _instructions(body) + history
    _tools(body, out)
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _format(body)
    if fmt is not None:
        out["response_format"] = fmt
    top = body.get("top_logprobs")
    if top is not None or include:
        out["logprobs"], out["top_logprobs"] = True, 0 if top is None else top
    trunc = body.get("truncation")
    if trunc not in (None, "disabled", "auto"):
        raise bad("truncation", "must be \"auto\" or \"disabled\"", "invalid_value")
    if trunc == "auto":
        out["truncate_prompt_tokens"] = -1
    return out, history


def parse_responses(body: dict, tokenizer, limits, store=None):
    """The GenerationRequest (its `history`: the conversation to store); `store`: the
    server's ResponseStore (responses_store.py), None when it keeps none."""
    prior = None
    prev = body.get("previous_response_id")
    if prev is not None:
        if store is None:
            raise bad("previous_response_id", "needs a server that stores responses "
                      "(serve --responses-store N)", "unsupported")
        found = store.get(prev) if isinstance(prev, str) else None
        if found is None:
            raise APIError(404, f"previous_response_id: response {prev!r} not found (unknown, "
                           f"or older than the last {store.capacity} stored)",
                           "previous_response_id", "not_found")
        prior = found[1]
    try:
        chat, history = chat_body(body, prior)
        return dataclasses.replace(parse_chat(chat, tokenizer, limits), history=history)
    except APIError as e:
        p = e.param or ""
        head = p.split(".")[0].split("[")[0]
        if head in _RENAMED:
            new = _RENAMED[head] + p[len(head):]
            e.param, e.message = new, e.message.replace(p, new, 1)
        raise


# ---- the response and its events ------------------------------------------------------------
def new_ids() -> dict:
    return {"resp": "resp_" + uuid.uuid4().hex, "msg": "msg_" + uuid.uuid4().hex,
            "rs": "rs_" + uuid.uuid4().hex, "created": int(time.time())}


def _logprobs(lp: dict | None) -> list:
    if not lp:
        return []
    return [{"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                               "bytes": t["bytes"]} for t in c["top_logprobs"]]}
            for c in lp["content"]]


def reasoning_item(ids: dict, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": ids["rs"], "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(ids: dict, text: str, lp: list, status: str = "completed") -> dict:
    return {"type": "message", "id": ids["msg"], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": lp}]}


def response_object(req, body: dict, ids: dict, output: list, reason: str | None,
                    usage: dict | None, status: str | None = None, stored: bool = False
                    ) -> dict:
    cut = reason == "length"
    status = status or ("incomplete" if cut else "completed")
    return {
        "id": ids["resp"], "object": "response", "created_at": ids["created"],
        "status": status, "model": req.model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut and status ==
        "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata"),
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"), "reasoning": None,
        "store": stored, "temperature": req.params[0].temperature,
        "text": {"format": body.get("text", {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "top_p": req.params[0].top_p,
        "truncation": body.get("truncation") or "disabled", "usage": usage}


def usage(req, completion_tokens: int) -> dict:
    return {"input_tokens": req.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.prompt_tokens + completion_tokens}


def output_items(req, ids: dict, text: str, lp: dict | None, reason: str | None = None
                 ) -> list:
    """The whole reply as items: its reasoning (with a parser), its message (unless it is
    all calls) and its function calls (with tools: serving/tools.py's parse)."""
    items, whole = [], text
    if req.reasoning is not None:
        fields = req.reasoning[0].message(text)
        if fields.get("reasoning"):
            items.append(reasoning_item(ids, fields["reasoning"]))
        text = fields.get("content") or ""
    calls = []
    if req.tools is not None:
        fields, _ = req.tools[0].message(whole if req.tools[0].reads_messages else text,
                                         reason)
        text, calls = fields.get("content") or "", fields.get("tool_calls") or []
    if text or not calls:
        items.append(message_item(ids, text, _logprobs(lp)))
    for c in calls:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                      "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items
