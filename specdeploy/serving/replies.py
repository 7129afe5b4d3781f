"""A generation request's replies: the streamed chunks (`stream`, server-sent events) and the
whole response (`collect`), from the engine loop's events (engine_loop.py)."""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from specdeploy.serving import protocol as P
from specdeploy.serving import responses as R
from specdeploy.serving.engine_loop import EngineLoop, Handle


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that may still grow into a stop string: it is not
    sent yet, since a match would cut it from the answer."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def _parsed_delta(req: P.GenerationRequest, i: int, text: str, final: bool,
                  finish_reason: str | None) -> dict:
    """A chat delta's fields where the reply is parsed: thinking apart (serving/reasoning.py),
    then tool calls out of what is content (serving/tools.py)."""
    fields: dict = {}
    if req.reasoning is not None:
        fields = req.reasoning[i].delta(text, final)
        if req.tools is None:
            return fields
        fields.pop("content", None)
        if not req.tools[i].reads_messages:  # (harmony's parser reads the channels itself)
            text = req.reasoning[i].split(text, final)[1] or ""
    fields.update(req.tools[i].delta(text, final, finish_reason))
    return fields


@dataclass
class _Sent:
    """What a choice's stream has sent."""

    chars: int = 0  # characters of its text
    logprobs: int = 0  # tokens whose logprobs went out
    tokens: int = 0  # tokens whose ids went out (return_token_ids)
    opened: bool = False  # its first chunk went out: that one carries the prompt's ids
    echoed: bool = True  # False: its echo waits for the prompt's logprobs


def _ids(req: P.GenerationRequest, i: int, s: _Sent, out=None) -> dict:
    """A chunk's token ids (vLLM's return_token_ids): the prompt's on a choice's first chunk,
    then the reply's since the last chunk that carried them (`out` None: none in this one;
    a completions chunk says so with [])."""
    kw: dict = {}
    if req.return_token_ids:
        if not s.opened:
            kw["prompt_ids"] = req.prompts[i]
        if out is not None and req.reply_ids_shown:
            kw["token_ids"] = out.token_ids[s.tokens:]
            s.tokens = len(out.token_ids)
        elif not req.chat:
            kw["token_ids"] = []
    s.opened = True
    return kw


async def stream(req: P.GenerationRequest, handle: Handle, rid: str, created: int):
    n = len(req.prompts)
    done, completion_tokens = 0, 0
    sent = [_Sent(echoed=not req.echo_logprobs) for _ in range(n)]
    chunk = functools.partial(R.chunk_body, req, rid, created)
    if req.chat:
        for i in range(n):
            yield R.sse(chunk(i, None, None, first=True, **_ids(req, i, sent[i])))
    elif req.echo is not None and not req.echo_logprobs:  # the prompt's text first (vLLM's)
        for i in range(n):
            yield R.sse(chunk(i, req.echo[i], None, **_ids(req, i, sent[i])))
    while done < n:
        ev = await handle.queue.get()
        if ev.error is not None:
            yield R.sse(P.APIError(500, ev.error).body())
            return
        out, i = req.view(ev.output), ev.index
        s = sent[i]
        if not s.echoed:  # echo with logprobs: the prompt once all its logprobs are in
            if not out.finished and len(out.prompt_logprobs) < len(out.prompt_token_ids):
                continue  # (a prefill chunk; the next output is cumulative)
            yield R.sse(chunk(i, req.echo[i], None, logprobs=req.echo_logprobs_alone(i, out),
                              **_ids(req, i, s)))
            s.echoed = True
        # NOTE: the cumulative text, not `delta_text`: a stop string cuts the final text, and
        # what may become one is held back, so a stream always spells the non-streamed answer.
        end = len(out.text) if out.finished else (
            len(out.text) - _held_back(out.text, req.params[i].stop))
        # NOTE: a chunk carries the logprobs of every token since the last one that did
        lp = None
        if out.logprobs is not None and (end > s.chars or out.finished):
            lp = req.logprobs(i, out.token_ids[s.logprobs:], out.logprobs[s.logprobs:],
                              s.chars + req.echo_chars(i))
            s.logprobs = len(out.logprobs)
        if req.reasoning is not None or req.tools is not None:
            fields = _parsed_delta(req, i, out.text[:end], out.finished, out.finish_reason)
            if fields or lp is not None and not out.finished:
                yield R.sse(chunk(i, None, None, logprobs=lp, fields=fields,
                                  **_ids(req, i, s, out)))
                lp = None
            s.chars = end
        elif end > s.chars:
            yield R.sse(chunk(i, out.text[s.chars:end], None, logprobs=lp,
                              **_ids(req, i, s, out)))
            s.chars, lp = end, None
        if out.finished:
            done += 1
            completion_tokens += len(out.token_ids)
            reason = out.finish_reason if req.tools is None else \
                req.tools[i].finish(out.finish_reason)
            yield R.sse(chunk(i, None, reason, logprobs=lp, **_ids(req, i, s, out)))
    if req.include_usage:
        prompt_tokens = req.prompt_tokens
        yield R.sse(R.usage_chunk(req, rid, created, R.usage(prompt_tokens, completion_tokens)))
    yield R.sse("[DONE]")


async def collect(request: Request, req: P.GenerationRequest, handle: Handle, rid: str,
                  created: int, loop: EngineLoop, render=None):
    """Wait for every prompt's output; a client that leaves aborts its requests. `render`:
    the body from `R.response_body`'s arguments (default: it; /v1/responses has its own)."""
    n = len(req.prompts)
    texts, reasons, toks, lps, plps = [""] * n, [None] * n, [[]] * n, [None] * n, [None] * n
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done = 0
        while done < n:
            get = asyncio.ensure_future(handle.queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                loop.abort(handle)
                return Response(status_code=499)  # nobody reads it
            ev = get.result()
            if ev.error is not None:  # this request's failure alone: stop its other prompts
                loop.abort(handle)
                raise P.APIError(500, ev.error)
            out, i = req.view(ev.output), ev.index
            if out.finished:
                done += 1
                texts[i], reasons[i], toks[i] = out.text, out.finish_reason, out.token_ids
                lps[i] = req.final_logprobs(i, out)
                plps[i] = req.prompt_logprobs(i, out)
    finally:
        gone.cancel()
    use = R.usage(req.prompt_tokens, sum(map(len, toks)))
    return JSONResponse((render or R.response_body)(req, rid, created, texts, reasons, use, lps,
                                                    plps, toks))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
