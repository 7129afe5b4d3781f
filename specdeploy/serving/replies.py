"""A generation request's replies: the streamed chunks (`stream`, server-sent events) and the
whole response (`collect`), from the engine loop's events (engine_loop.py)."""
from __future__ import annotations

import asyncio

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
        text = req.reasoning[i].split(text, final)[1] or ""
    fields.update(req.tools[i].delta(text, final, finish_reason))
    return fields


async def stream(req: P.GenerationRequest, handle: Handle, rid: str, created: int):
    n = len(req.prompts)
    done, completion_tokens = 0, 0
    sent = [0] * n  # characters of each choice's text already streamed
    sent_lp = [0] * n  # tokens whose logprobs were streamed
    if req.chat:
        for i in range(n):
            yield R.sse(R.chunk_body(req, rid, created, i, None, None, first=True))
    elif req.echo is not None:  # the prompt's text first (vLLM's echo)
        for i in range(n):
            yield R.sse(R.chunk_body(req, rid, created, i, req.echo[i], None))
    while done < n:
        ev = await handle.queue.get()
        if ev.error is not None:
            yield R.sse(P.APIError(500, ev.error).body())
            return
        out, i = ev.output, ev.index
        # NOTE: the cumulative text, not `delta_text`: a stop string cuts the final text, and
        # what may become one is held back, so a stream always spells the non-streamed answer.
        end = len(out.text) if out.finished else (
            len(out.text) - _held_back(out.text, req.params[i].stop))
        # NOTE: a chunk carries the logprobs of every token since the last one that did
        lp = None
        if out.logprobs is not None and (end > sent[i] or out.finished):
            lp = req.logprobs(i, out.token_ids[sent_lp[i]:], out.logprobs[sent_lp[i]:], sent[i])
            sent_lp[i] = len(out.logprobs)
        if req.reasoning is not None or req.tools is not None:
            fields = _parsed_delta(req, i, out.text[:end], out.finished, out.finish_reason)
            if fields or lp is not None and not out.finished:
                yield R.sse(R.chunk_body(req, rid, created, i, None, None, logprobs=lp,
                                         fields=fields))
                lp = None
            sent[i] = end
        elif end > sent[i]:
            yield R.sse(R.chunk_body(req, rid, created, i, out.text[sent[i]:end], None,
                                     logprobs=lp))
            sent[i], lp = end, None
        if out.finished:
            done += 1
            completion_tokens += len(out.token_ids)
            reason = out.finish_reason if req.tools is None else \
                req.tools[i].finish(out.finish_reason)
            yield R.sse(R.chunk_body(req, rid, created, i, None, reason, logprobs=lp))
    if req.include_usage:
        prompt_tokens = req.prompt_tokens
        yield R.sse(R.usage_chunk(req, rid, created, R.usage(prompt_tokens, completion_tokens)))
    yield R.sse("[DONE]")


async def collect(request: Request, req: P.GenerationRequest, handle: Handle, rid: str,
                   created: int, loop: EngineLoop):
    """Wait for every prompt's output; a client that leaves aborts its requests."""
    n = len(req.prompts)
    texts, reasons, ntok, lps, plps = [""] * n, [None] * n, [0] * n, [None] * n, [None] * n
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
            if ev.output.finished:
                done += 1
                texts[ev.index] = ev.output.text
                reasons[ev.index] = ev.output.finish_reason
                ntok[ev.index] = len(ev.output.token_ids)
                lps[ev.index] = req.final_logprobs(ev.index, ev.output)
                plps[ev.index] = req.prompt_logprobs(ev.index, ev.output)
    finally:
        gone.cancel()
    use = R.usage(req.prompt_tokens, sum(ntok))
    return JSONResponse(R.response_body(req, rid, created, texts, reasons, use, lps, plps))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
