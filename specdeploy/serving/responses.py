"""Response and streamed-chunk bodies of the OpenAI endpoints: whole responses, streamed chunks
(with their logprobs, logprobs_format.py), usage and SSE framing."""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdeploy.serving.protocol import GenerationRequest


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(req: GenerationRequest, rid: str, created: int, texts: list[str],
                  reasons: list[str], use: dict, logprobs: list | None = None,
                  prompt_logprobs: list | None = None, token_ids: list | None = None) -> dict:
    """`prompt_logprobs` (vLLM's, per choice; None where not asked): on each completions
    choice, and once at the top of a chat response (its choices share the prompt). With
    `return_token_ids`, `token_ids` (the replies') and the prompt's likewise (vLLM's)."""
    lps = logprobs or [None] * len(texts)
    plps = prompt_logprobs or [None] * len(texts)
    if req.chat:
        choices = []
        for i, (t, r, lp) in enumerate(zip(texts, reasons, lps)):
            message = {"role": "assistant", "content": t}
            if req.reasoning is not None:  # serving/reasoning.py
                message.update(req.reasoning[i].message(t))
            if req.tools is not None:  # serving/tools.py: on what is content
                reply = t if req.tools[i].reads_messages else message["content"] or ""
                fields, r = req.tools[i].message(reply, r)
                message.update(fields)
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": r})
            if req.reply_ids_shown:
                choices[-1]["token_ids"] = token_ids[i]
        obj = "chat.completion"
    else:
        shown = req.echo or [""] * len(texts)
        choices = [{"index": i, "text": e + t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp, e) in enumerate(zip(texts, reasons, lps, shown))]
        for i, (c, p) in enumerate(zip(choices, plps)):
            if p is not None:
                c["prompt_logprobs"] = p
            if req.return_token_ids:
                c["prompt_token_ids"], c["token_ids"] = req.prompts[i], token_ids[i]
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": choices, "usage": use}
    if req.chat and plps[0] is not None:
        body["prompt_logprobs"] = plps[0]
    if req.chat and req.return_token_ids:
        body["prompt_token_ids"] = req.prompts[0]
    return body


def chunk_body(req: GenerationRequest, rid: str, created: int, index: int, text: str | None,
               finish_reason: str | None, first: bool = False, logprobs: dict | None = None,
               fields: dict | None = None, prompt_ids: list | None = None,
               token_ids: list | None = None) -> dict:
    """One streamed chunk; a chat stream's first chunk of a choice carries the role. `fields`:
    a chat delta's own fields (reasoning and content, serving/reasoning.py) instead of text.
    `prompt_ids`, `token_ids` (return_token_ids): the prompt's on the choice (completions) or
    the chunk (chat), the reply's on the choice."""
    if req.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if fields:
            delta.update(fields)
        elif text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_ids is not None and not req.chat:
        choice["prompt_token_ids"] = prompt_ids
    body = {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": [choice]}
    if prompt_ids is not None and req.chat:
        body["prompt_token_ids"] = prompt_ids
    if req.include_usage:
        body["usage"] = None
    return body


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict) -> dict:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": use}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def now() -> int:
    return int(time.time())
