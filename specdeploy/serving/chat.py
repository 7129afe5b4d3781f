"""`/v1/chat/completions` requests: messages, the chat template's options (vLLM's names) and
the prompt ids they render to (also used by `/tokenize`)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from specdeploy.chat_template import RESERVED, ChatTemplateError, chat_ids
from specdeploy.serving import harmony
from specdeploy.serving import tools as tools_mod
from specdeploy.serving.errors import APIError, bad
from specdeploy.serving.fields import check_fields
from specdeploy.serving.protocol import (
    GenerationRequest,
    Limits,
    _bool,
    _check_chars,
    _check_prompt,
    _common,
    _max_tokens,
    _model,
    _sampling,
    _unsupported,
    priority,
)
from specdeploy.serving.reasoning import Reasoning, forces_content, prompt_opens_thinking
from specdeploy.serving.token_fields import token_ids_flags, truncation

ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any, images: list | None = None, vision: Any = None,
             videos: list | None = None) -> dict:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(field, "must be an object with `role` and `content`", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{field}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                  "invalid_value")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text, and image_url on a VLM
        texts, parts = [], []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            media = {"image_url": ("image", images), "video_url": ("video", videos)}.get(kind)
            if media is not None and media[1] is not None:
                from specdeploy.vision.chat import served_image_url

                what, dst = media
                if vision is None:
                    raise bad(f"{field}.content[{j}]", f"this model takes no {what}s (text "
                              "parts only)", "unsupported")
                dst.append(served_image_url(part, bad, f"{field}.content[{j}].{kind}.url", what))
                parts.append({"type": what})
                continue
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"{field}.content[{j}]", "only {\"type\": \"text\", \"text\": ...} "
                          "parts are supported", "unsupported")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        content = parts if len(parts) > len(texts) else "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise bad(f"{field}.content", "must be a string or a list of text parts",
                  "invalid_type")
    out = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(field, m["tool_calls"])
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"{field}.{key}", "must be a string", "invalid_type")
                out[key] = m[key]
    return out


def _tool_calls(field: str, calls: Any) -> list[dict]:
    """An assistant message's earlier calls, for the template: `arguments` as an object (the
    templates write it with `tojson`), as vLLM hands them over."""
    if not isinstance(calls, list):
        raise bad(f"{field}.tool_calls", "must be a list", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{field}.tool_calls[{j}]", "must be {\"id\", \"type\": \"function\", "
                      "\"function\": {\"name\", \"arguments\"}}", "invalid_value")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"{field}.tool_calls[{j}].function.arguments", "must be JSON",
                          "invalid_value") from None
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def _text_chars(content: str | list) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def _template_options(body: dict, tool_parser: str | None = None) -> tuple[dict, Any]:
    """(chat_ids keyword arguments, the tool plan or None) from the request (400s name the
    field)."""
    gen = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if gen and cont:
        raise bad("continue_final_message", "cannot be combined with add_generation_prompt "
                  "(set add_generation_prompt to false to continue the final message)",
                  "invalid_value")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object", "invalid_type")
    reserved = [k for k in kwargs if k in RESERVED]
    if reserved:
        raise bad("chat_template_kwargs", f"{reserved[0]!r} has its own request field",
                  "invalid_value")
    kwargs = dict(kwargs)
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list):
            raise bad("documents", "must be a list", "invalid_type")
        kwargs["documents"] = docs
    tool_plan = tools_mod.plan(body, tool_parser)  # serving/tools.py
    if tool_plan is not None:
        kwargs["tools"] = tool_plan.tools
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad("chat_template", "must be a string", "invalid_type")
    return dict(add_generation_prompt=gen, continue_final_message=cont,
                chat_template=template, template_kwargs=kwargs), tool_plan


def render_messages(body: dict, tokenizer, limits: Limits,
                    check_chars: bool = True) -> tuple[list[int], Any, Any]:
    """(prompt ids, images prompt or None, tool plan or None) of the request's `messages`.
    `check_chars` False: the text may be longer than the context (it will be truncated)."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages", "invalid_type")
    options, tool_plan = _template_options(body, limits.tool_parser)
    specials = _bool(body, "add_special_tokens", False)
    images: list = []
    videos: list = []
    conversation = [_message(i, m, images, limits.vision, videos) for i, m in enumerate(msgs)]
    if check_chars:
        _check_chars(sum(_text_chars(m["content"]) for m in conversation), limits, "messages")
    try:
        ids = chat_ids(tokenizer, conversation, **options)
    except ChatTemplateError as e:  # the template failed (the request's own, or the model's)
        raise bad("chat_template" if options["chat_template"] is not None else "messages",
                  str(e), "invalid_value") from None
    except Exception as e:  # the template may reject a conversation (roles, order)
        raise bad("messages", f"the chat template rejected the conversation: {e}",
                  "invalid_value") from None
    if specials:  # vLLM's add_special_tokens: the tokenizer's own (BOS) on top of the template
        ids = list(tokenizer.encode("", add_special_tokens=True)) + ids
    mm = None
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is not None and kwargs != {}:
        from specdeploy.vision.image import check_processor_kwargs

        try:
            check_processor_kwargs(kwargs)
        except ValueError as e:
            raise bad("mm_processor_kwargs", str(e).removeprefix("mm_processor_kwargs: "),
                      "invalid_value") from None
    if images or videos:
        from specdeploy.vision import ImageError
        from specdeploy.vision.chat import build_prompt

        try:
            mm = build_prompt(limits.vision, ids, images, "messages", videos,
                              lambda s: tokenizer.encode(s, add_special_tokens=False), kwargs)
        except ImageError as e:
            kind = "invalid_video" if videos and "video" in str(e) else "invalid_image"
            raise APIError(400, str(e), "messages", kind) from None
        except ValueError as e:  # e.g. min_frames above max_frames
            raise bad("mm_processor_kwargs", str(e).removeprefix("mm_processor_kwargs: "),
                      "invalid_value") from None
        ids = mm.ids
    return ids, mm, tool_plan


def parse_chat(body: dict, tokenizer, limits: Limits) -> GenerationRequest:
    check_fields(body, "chat", bad)
    stream, include_usage = _common(body)
    model = _model(body, limits)
    _unsupported(body, "echo", (None, False))
    trunc = truncation(body)  # (serving/token_fields.py)
    ids, mm, tool_plan = render_messages(body, tokenizer, limits, trunc.keep is None)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    ids = trunc.apply(ids, limits.context, body.get(field), mm is not None)
    _check_prompt(ids, limits, "messages")
    params = _sampling(body, _max_tokens(body, field, len(ids), limits, None), limits, True)
    if tool_plan is not None and tool_plan.guided_json is not None:
        params = _held_to_tools(params, tool_plan, limits)
    n = len(params)
    include = _bool(body, "include_reasoning", True)
    harmony_parsed = limits.reasoning_parser == "openai_gptoss" or (
        tool_plan is not None and tool_plan.kind == "auto" and tool_plan.parser == "openai")
    if harmony_parsed and params[0].skip_special_tokens:
        raise bad("skip_special_tokens", "must be false with the openai_gptoss / openai "
                  "parsers: they read harmony's special tokens in the reply", "invalid_value")
    head = harmony.prompt_head(tokenizer, ids) if harmony_parsed else None
    reasoning = None
    if limits.reasoning_parser is not None:
        inside = prompt_opens_thinking(tokenizer, ids)
        force = forces_content(body.get("chat_template_kwargs"))
        reasoning = [Reasoning(limits.reasoning_parser, inside, include, force, head)
                     for _ in range(n)]
    tools = None
    if tool_plan is not None and tool_plan.kind != "none":
        tools = [tools_mod.ToolReply(tool_plan, head) for _ in range(n)]
    if stream and params[0].prompt_logprobs is not None:
        raise bad("prompt_logprobs", "the prompt's logprobs are not streamed; send the request "
                  "without stream", "unsupported")
    ret_ids, as_ids = token_ids_flags(body, limits.return_tokens_as_token_ids)
    return GenerationRequest(True, model, [ids] * n, params, stream, include_usage,
                             None if mm is None else [mm] * n, n, tokenizer, reasoning, tools,
                             prompt_logprobs_asked=params[0].prompt_logprobs is not None,
                             return_token_ids=ret_ids, as_ids=as_ids,
                             priority=priority(body, limits))


def _held_to_tools(params: list, tool_plan, limits: Limits) -> list:
    """A named / required tool_choice: the reply held to its JSON schema (structured output)."""
    if params[0].structured:
        raise bad("tool_choice", "cannot be combined with response_format or another "
                  "structured output", "invalid_value")
    try:
        params = [dataclasses.replace(p, guided_json=tool_plan.guided_json) for p in params]
        if limits.grammar is not None:
            limits.grammar(params[0].grammar_key)
    except ValueError as e:
        raise bad("tool_choice", f"the tool's parameters: {str(e).split(': ', 1)[-1]}",
                  "invalid_value") from None
    return params
