"""Stored /v1/responses (`serve --responses-store N`): the last N responses in memory, with the
conversation each ended, so `GET /v1/responses/{id}` answers them and a request's
`previous_response_id` continues one (as OpenAI's `store`, and vLLM's
VLLM_ENABLE_RESPONSES_API_STORE). Bounded: the oldest goes first; nothing survives a restart.

A continued conversation is the stored one (its input messages, then the reply as an assistant
turn: its text and its function calls; its reasoning left out, as chat templates drop earlier
turns' thinking) followed by the new input; the new request's `instructions` lead it (a stored
request's instructions are not carried over, as OpenAI does)."""
from __future__ import annotations

import threading
from collections import OrderedDict


class ResponseStore:
    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"responses_store: must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list]] = OrderedDict()
        self._lock = threading.Lock()  # parsing runs in worker threads

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list] | None:
        with self._lock:
            return self._items.get(rid)


def assistant_turn(items: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that continue its conversation."""
    text = "".join(c["text"] for it in items if it["type"] == "message" for c in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    turn = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return [turn]
