"""vLLM's token-level request fields: `truncate_prompt_tokens` / `truncation_side` (cut a prompt
to fit before it is checked), `return_token_ids` (the prompt's and the reply's token ids in the
response) and `return_tokens_as_token_ids` (logprobs name tokens "token_id:<id>", for tokens
whose text is not valid UTF-8 on its own; the server's `--return-tokens-as-token-ids` sets the
default a request may override).

As vLLM: `truncate_prompt_tokens` k >= 1 keeps k tokens of the prompt (its last k: truncation
on the left, unless `truncation_side` is "right"), -1 as many as `max_tokens` leaves room for;
a k above max_model_len - max_tokens is refused. It applies to the final prompt (a chat's
rendered template), and usage counts the prompt as truncated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from specdeploy.serving.errors import bad

FIELDS = ("truncate_prompt_tokens", "truncation_side", "return_token_ids",
          "return_tokens_as_token_ids")


@dataclass(frozen=True)
class Truncation:
    keep: int | None  # None: not asked; -1: what max_tokens leaves room for
    left: bool = True

    def apply(self, ids: list[int], context: int, max_tokens, images: bool = False) -> list[int]:
        """`ids` cut to fit: `context` is the model's usable length, `max_tokens` the request's
        (unchecked yet: a non-integer counts as 0, and its own check refuses it later)."""
        if self.keep is None:
            return ids
        want = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) \
            and max_tokens > 0 else 0
        room = context - want
        keep = room if self.keep == -1 else self.keep
        if keep > room:
            raise bad("truncate_prompt_tokens", f"{keep} cannot be greater than max_model_len - "
                      f"max_tokens = {room}: request a smaller truncation size",
                      "invalid_value")
        if keep < 1:
            raise bad("truncate_prompt_tokens", f"max_tokens ({want}) leaves no room for the "
                      f"prompt: this model's maximum context length is {context} tokens",
                      "context_length_exceeded")
        if len(ids) <= keep:
            return ids
        if images:  # a cut would split an image's placeholder run from its features
            raise bad("truncate_prompt_tokens", f"cannot cut a prompt with images ({len(ids)} "
                      f"tokens, {keep} kept)", "unsupported")
        return ids[-keep:] if self.left else ids[:keep]


def truncation(body: dict) -> Truncation:
    k = body.get("truncate_prompt_tokens")
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise bad("truncation_side", f"must be \"left\" or \"right\", got {_show(side)}",
                  "invalid_value")
    if k is None:
        return Truncation(None)
    if not isinstance(k, int) or isinstance(k, bool):
        raise bad("truncate_prompt_tokens", f"must be an integer, got {_show(k)}",
                  "invalid_type")
    if k < -1 or k == 0:
        raise bad("truncate_prompt_tokens", f"must be -1 or >= 1, got {k}", "invalid_value")
    return Truncation(k, side != "right")


def token_ids_flags(body: dict, default_as_ids: bool) -> tuple[bool, bool]:
    """(return_token_ids, return_tokens_as_token_ids), the latter's unset value the server's."""
    out = []
    for name, default in (("return_token_ids", False),
                          ("return_tokens_as_token_ids", default_as_ids)):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise bad(name, f"must be a boolean, got {_show(v)}", "invalid_type")
        out.append(default if v is None else v)
    return out[0], out[1]


def _show(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."
