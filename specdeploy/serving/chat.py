"""`/v1/chat/completions` requests: messages, the chat template's options (vLLM's names) and
the prompt ids they render to (also used by `/tokenize`)."""
from __future__ import annotations

import json
from typing import Any

from specdeploy.chat_template import RESERVED, chat_ids
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
)
from specdeploy.serving.reasoning import Reasoning, prompt_opens_thinking

ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any, images: list | None = None, vision: Any = None) -> dict:
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
            if isinstance(part, dict) and part.get("type") == "image_url" and images is not None:
                from specdeploy.vision.chat import served_image_url

                if vision is None:
                    raise bad(f"{field}.content[{j}]", "this model takes no images (text parts "
                              "only)", "unsupported")
                images.append(served_image_url(part, bad, f"{field}.content[{j}].image_url.url"))
                parts.append({"type": "image"})
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
    return {"role": role, "content": content}


def _text_chars(content: str | list) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def _template_options(body: dict) -> dict:
    """chat_ids keyword arguments from the request (400s name the field)."""
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
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none"):
        raise bad("tool_choice", f"{json.dumps(choice)} is not supported by this server "
                  "(no tool-call parsing)", "unsupported")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list", "invalid_type")
        if choice != "none":  # the model would call tools nobody parses out of its text
            raise bad("tools", "tool calling is not supported by this server (no tool-call "
                      "parser); with tool_choice \"none\" the chat template still describes "
                      "the tools to the model", "unsupported")
        kwargs["tools"] = tools
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad("chat_template", "must be a string", "invalid_type")
    return dict(add_generation_prompt=gen, continue_final_message=cont,
                chat_template=template, template_kwargs=kwargs)


def render_messages(body: dict, tokenizer, limits: Limits) -> tuple[list[int], Any]:
    """(prompt ids, images prompt or None) of the request's `messages`."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages", "invalid_type")
    options = _template_options(body)
    specials = _bool(body, "add_special_tokens", False)
    images: list = []
    conversation = [_message(i, m, images, limits.vision) for i, m in enumerate(msgs)]
    _check_chars(sum(_text_chars(m["content"]) for m in conversation), limits, "messages")
    try:
        ids = chat_ids(tokenizer, conversation, **options)
    except Exception as e:  # the template may reject a conversation (roles, order)
        raise bad("messages", f"the chat template rejected the conversation: {e}",
                  "invalid_value") from None
    if specials:  # vLLM's add_special_tokens: the tokenizer's own (BOS) on top of the template
        ids = list(tokenizer.encode("", add_special_tokens=True)) + ids
    mm = None
    if images:
        from specdeploy.vision import ImageError
        from specdeploy.vision.chat import build_prompt

        try:
            mm = build_prompt(limits.vision, ids, images, "messages")
        except ImageError as e:
            raise APIError(400, str(e), "messages", "invalid_image") from None
        ids = mm.ids
    return ids, mm


def parse_chat(body: dict, tokenizer, limits: Limits) -> GenerationRequest:
    check_fields(body, "chat", bad)
    stream, include_usage = _common(body)
    model = _model(body, limits)
    _unsupported(body, "echo", (None, False))
    ids, mm = render_messages(body, tokenizer, limits)
    _check_prompt(ids, limits, "messages")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    params = _sampling(body, _max_tokens(body, field, len(ids), limits, None), limits, True)
    n = len(params)
    include = _bool(body, "include_reasoning", True)
    reasoning = None
    if limits.reasoning_parser is not None:
        inside = prompt_opens_thinking(tokenizer, ids)
        reasoning = [Reasoning(limits.reasoning_parser, inside, include) for _ in range(n)]
    return GenerationRequest(True, model, [ids] * n, params, stream, include_usage,
                             None if mm is None else [mm] * n, n, tokenizer, reasoning)
