"""OpenAI's harmony format (gpt-oss): vLLM's `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`, over the reply's text (the server keeps special tokens in it).

A reply is messages `[<|start|>ROLE]HEADER<|message|>BODY` ended by `<|end|>` (or by the stop
tokens `<|return|>` / `<|call|>`, which the engine strips: a body that runs to the end of a
whole reply is complete). The header holds `<|channel|>CHANNEL`, a recipient ` to=NAME` (in the
role or the channel part) and a content type (`<|constrain|>json` or a bare `json`).

- `analysis` → reasoning (every such message, "\n" between them, as vLLM joins them);
- `final`, `commentary` without a recipient (a preamble), and a message with no or another
  channel → content (joined the same way);
- a message with a recipient on any channel but `analysis` → a tool call: `functions.NAME`
  with a JSON object body is a call to NAME (arguments the body re-serialized); any other
  (another recipient, a body that is not a JSON object, e.g. one cut by max_tokens) is content
  as written (its header and body), the fallback the other tool parsers use for a block that
  does not parse. Without the tool parser, calls are neither reasoning nor content (vLLM).
- text that does not follow the format (a reply that does not open with a header, a header
  that meets `<|end|>` before `<|message|>` or never ends, anything but `<|start|>` after an
  `<|end|>`) is content as written from there on.

Streams: what may still become a marker (`<|en`) or a header is held back, and a call goes out
when its message ends, so the deltas always join to the whole reply's fields.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)  # a body ends at these (or at a <|start|> that opens the next)
HEADER_OPENS = (START, CHANNEL, " to=", CONSTRAIN, MESSAGE)  # how a reply's first header begins
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")


@dataclass
class Part:
    """One message of the reply (or text outside the format). `kind`: "analysis", "content",
    "call" or "text" (as written); `done`: it ended (or the reply is whole)."""

    kind: str
    text: str
    done: bool
    recipient: str | None = None
    raw: str = ""  # a call as written (header and body): content where it does not parse


def _held(text: str) -> int:
    """Length of the longest end of `text` that may still grow into a marker."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return k
    return 0


def _first(text: str, marks: tuple[str, ...], at: int) -> tuple[int, str]:
    """(index, marker) of the first of `marks` in `text` from `at`, or (-1, "")."""
    best = (-1, "")
    for m in marks:
        i = text.find(m, at)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, m)
    return best


def parse(text: str, final: bool, head: str | None = None) -> list[Part]:
    """The reply's parts. `head`: the open message the prompt ends in, after its `<|start|>`
    ("assistant" from the generation prompt; "...<|message|>" when the prompt opened a body).
    Not `final`: what may still change is left out."""
    src = (head or "") + text
    base, pos, parts = len(head or ""), 0, []

    def as_written(at: int) -> list[Part]:
        return parts + [Part("text", src[max(at, base):], final)]

    first = True
    while pos < len(src) or first:
        rest = src[max(pos, base):]
        if first and not (head or "").endswith(MESSAGE):  # the reply's first header
            if not any(rest.startswith(o) or (not final and o.startswith(rest))
                       for o in HEADER_OPENS) and (rest or final):
                return as_written(pos) if rest else parts
        elif not first:  # between messages: only <|start|> (whitespace around it skipped)
            pos += len(rest) - len(rest.lstrip())
            tail = rest.lstrip()
            if not tail:
                return parts
            if not tail.startswith(START):
                return parts if not final and START.startswith(tail) else as_written(pos)
        first = False
        j = src.find(MESSAGE, pos)
        bad, _ = _first(src, ENDS, pos)
        restart = src.find(START, pos + 1)
        stop = min((i for i in (bad, restart) if i >= 0), default=-1)
        if j < 0 or 0 <= stop < j:  # the header never reaches <|message|>
            if stop < 0 and not final:
                return parts  # it may still
            return as_written(pos)
        header, body_at = src[pos:j], j + len(MESSAGE)
        k, mark = _first(src, ENDS + (START,), body_at)
        if k < 0:
            end = len(src) if final else len(src) - _held(src[body_at:])
            done, nxt = final, len(src)
        else:
            end, done, nxt = k, True, k if mark == START else k + len(mark)
        m = _RECIPIENT.search(header)
        c = _CHANNEL.search(header)
        channel = c.group(1) if c else None
        body = src[body_at:end]
        if channel == "analysis":
            parts.append(Part("analysis", body, done))
        elif m:
            parts.append(Part("call", body, done, m.group(1), src[max(pos, base):end]))
        else:
            parts.append(Part("content", body, done))
        if not done:
            return parts
        pos = nxt
        if pos >= len(src):
            return parts
    return parts


def _join(texts: list[str]) -> str | None:
    kept = [t for t in texts if t]
    return "\n".join(kept) if texts else None


def split(text: str, final: bool, head: str | None = None) -> tuple[str | None, str | None]:
    """(reasoning, content) of the reply (None: no such message); calls are in neither."""
    parts = parse(text, final, head)
    reasoning = _join([p.text for p in parts if p.kind == "analysis"])
    content = _join([p.text for p in parts if p.kind in ("content", "text")])
    return reasoning, content


def _call(part: Part) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call message, or None (not a function's, not a JSON
    object)."""
    if not part.recipient.startswith("functions.") or part.recipient == "functions.":
        return None
    try:
        args = json.loads(part.text)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return part.recipient[len("functions."):], json.dumps(args, ensure_ascii=False)


def calls(text: str, final: bool, head: str | None = None
          ) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of the reply for the tool parser: calls that ended and
    parse; the content of `split`, with the calls that do not parse as written in it."""
    pieces, out = [], []
    for p in parse(text, final, head):
        if p.kind in ("content", "text"):
            pieces.append(p.text)
        elif p.kind == "call" and p.done:
            call = _call(p)
            if call is None:
                pieces.append(p.raw)
            else:
                out.append(call)
    return _join(pieces), out


def prompt_head(tokenizer, prompt_ids: list[int]) -> str | None:
    """The message the rendered prompt leaves open, after its `<|start|>` ("assistant" for the
    generation prompt), or None (it ends no message open)."""
    tail = tokenizer.decode(prompt_ids[-32:])
    i = tail.rfind(START)
    if i < 0:
        return None
    head = tail[i + len(START):]
    if any(e in head for e in ENDS):
        return None
    j = head.find(MESSAGE)
    return head if j < 0 else head[:j + len(MESSAGE)]
