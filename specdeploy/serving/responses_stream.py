"""/v1/responses replies (responses_api.py): the whole response, and the stream of typed
events. The reply's text is the chat path's (the same held-back stop strings, the same
reasoning split), so a stream's deltas always spell the unstreamed response's text."""
from __future__ import annotations

import json

from specdeploy.serving import responses_api as RA
from specdeploy.serving.engine_loop import Handle
from specdeploy.serving.replies import _held_back
from specdeploy.serving.responses_store import assistant_turn


def finish(req, body: dict, ids: dict, items: list, reason, completion_tokens: int,
           store) -> dict:
    """The final Responses object; stored (with its conversation) where the server keeps
    responses and the request did not say `store: false`."""
    keep = store is not None and body.get("store") is not False
    resp = RA.response_object(req, body, ids, items, reason, RA.usage(req, completion_tokens),
                              stored=keep)
    if keep:
        store.put(resp, (req.history or []) + assistant_turn(items))
    return resp


def render(body: dict, ids: dict, store=None):
    """A `replies.collect` renderer: the Responses object of the one choice."""
    def run(req, rid, created, texts, reasons, use, lps, plps, toks):
        items = RA.output_items(req, ids, texts[0], lps[0], reasons[0])
        return finish(req, body, ids, items, reasons[0], use["completion_tokens"], store)
    return run


class _Events:
    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


async def stream(req, body: dict, handle: Handle, ids: dict, store=None):
    ev, out = _Events(), None
    start = RA.response_object(req, body, ids, [], None, None, status="in_progress")
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    items: list[dict] = []  # finished items
    open_kind, texts, sent, sent_lp = None, {"reasoning": "", "message": ""}, 0, 0
    rs, msg = {"item_id": ids["rs"]}, {"item_id": ids["msg"]}

    def close_reasoning():
        item = RA.reasoning_item(ids, texts["reasoning"])
        items.append(item)
        at = {**rs, "output_index": len(items) - 1, "content_index": 0}
        return [ev("response.reasoning_text.done", **at, text=texts["reasoning"]),
                ev("response.output_item.done", output_index=len(items) - 1, item=item)]

    def open_message():
        at = len(items)
        return [ev("response.output_item.added", output_index=at,
                   item=RA.message_item(ids, "", [], "in_progress")),
                ev("response.content_part.added", **msg, output_index=at, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": [],
                         "logprobs": []})]

    while True:
        e = await handle.queue.get()
        if e.error is not None:
            yield ev("error", code="server_error", message=e.error, param=None)
            return
        out = req.view(e.output)
        end = len(out.text) if out.finished else (
            len(out.text) - _held_back(out.text, req.params[0].stop))
        if req.reasoning is not None:
            fields = req.reasoning[0].delta(out.text[:end], out.finished)
        else:
            fields = {"content": out.text[sent:end]} if end > sent else {}
            sent = max(sent, end)
        r, c = fields.get("reasoning"), fields.get("content")
        if req.tools is not None:  # content and calls parsed once the reply is whole
            c = None
        lp = []
        if out.logprobs is not None and (c or out.finished):
            lp = RA._logprobs(req.logprobs(0, out.token_ids[sent_lp:], out.logprobs[sent_lp:]))
            sent_lp = len(out.logprobs)
        if r:
            if open_kind is None:
                open_kind = "reasoning"
                yield ev("response.output_item.added", output_index=0,
                         item=RA.reasoning_item(ids, "", "in_progress"))
            texts["reasoning"] += r
            yield ev("response.reasoning_text.delta", **rs, output_index=0, content_index=0,
                     delta=r)
        if c:
            if open_kind == "reasoning":
                for x in close_reasoning():
                    yield x
            if open_kind != "message":
                open_kind = "message"
                for x in open_message():
                    yield x
            texts["message"] += c
            yield ev("response.output_text.delta", **msg, output_index=len(items),
                     content_index=0, delta=c, logprobs=lp)
        if out.finished:
            break
    if open_kind == "reasoning":
        for x in close_reasoning():
            yield x
    final = RA.output_items(req, ids, out.text, req.final_logprobs(0, out), out.finish_reason)
    for at, item in enumerate(final):
        if item["type"] == "reasoning":
            continue  # streamed and closed above
        if item["type"] == "function_call":
            fc = {"item_id": item["id"], "output_index": at}
            yield ev("response.output_item.added", output_index=at,
                     item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", **fc, delta=item["arguments"])
            yield ev("response.function_call_arguments.done", **fc, arguments=item["arguments"])
            yield ev("response.output_item.done", output_index=at, item=item)
            continue
        part = item["content"][0]
        if open_kind != "message":
            open_kind = "message"
            for x in open_message():
                yield x
            if part["text"]:  # (with tools: the content, whole)
                yield ev("response.output_text.delta", **msg, output_index=at, content_index=0,
                         delta=part["text"], logprobs=part["logprobs"])
        yield ev("response.output_text.done", **msg, output_index=at, content_index=0,
                 text=part["text"], logprobs=part["logprobs"])
        yield ev("response.content_part.done", **msg, output_index=at, content_index=0,
                 part=part)
        yield ev("response.output_item.done", output_index=at, item=item)
    resp = finish(req, body, ids, final, out.finish_reason, len(out.token_ids), store)
    yield ev("response.completed" if resp["status"] == "completed" else "response.incomplete",
             response=resp)
