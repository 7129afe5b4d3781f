"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat reply's thinking, between `<think>`
and `</think>`, goes to the message's `reasoning` (and its older name `reasoning_content`), the
rest to `content`, in whole responses and in streamed deltas alike.

- `deepseek_r1`: the reply thinks from its start (a leading `<think>` is dropped) until
  `</think>`; a reply cut before it is all reasoning.
- `qwen3`: the reply thinks when it starts with `<think>` or when the prompt ends with it (the
  templates of Qwen3 thinking models and Qwen3.5 open the block themselves); otherwise (e.g.
  `enable_thinking: false`, whose template closes an empty block) it is all content. A
  `<tool_call>` inside the thinking ends it as `</think>` does (Qwen3.5 calls tools from
  there; the call stays in the content, for the tool parser, as vLLM does). NOTE:
  vLLM's parser reports a thinking reply cut before `</think>` as content; here it is reasoning,
  so that a stream, which must decide as the tokens come, spells the same as the response.

- `nemotron_v3` (Nemotron 3, NemotronH: the Qwen3 format, with tools as `qwen3_coder` XML):
  `qwen3`'s split, the reasoning's trailing whitespace dropped; and where the request's
  `chat_template_kwargs` turn thinking off (`enable_thinking: false`) or ask for
  `force_nonempty_content: true`, a reply whose content is empty gives its reasoning as the
  content instead (vLLM's rule). A stream cannot know that before the end: its reasoning deltas
  go out as they come, and the final delta sends the reasoning as content, as vLLM's does.

- `glm45` (GLM-4.5 / 4.6 / 4.7): `qwen3`'s split. GLM's template closes an empty block itself
  when thinking is off, and the reply opens `<think>` when it thinks.

- `openai_gptoss` (gpt-oss, OpenAI's harmony format): the `analysis` channel's messages are the
  reasoning, the `final` channel's (and preambles) the content (serving/harmony.py).

A stream holds back what could still become a tag (a `<thi` at the start, a `</th` at the end
of the reasoning), so the concatenated deltas always equal the whole response's fields.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdeploy.serving import harmony

PARSERS = ("deepseek_r1", "qwen3", "nemotron_v3", "glm45", "openai_gptoss")
QWEN3_LIKE = ("qwen3", "nemotron_v3", "glm45")  # a <tool_call> ends the thinking
START, END = "<think>", "</think>"
TOOL = "<tool_call>"  # qwen3: Qwen3.5 may call a tool from inside its thinking
# chat_template_kwargs under which nemotron_v3 gives an empty-content reply's reasoning as content
THINKING_OFF = (("enable_thinking", False), ("thinking", False), ("force_nonempty_content", True))


def held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (a stream holds it
    back: it may still become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class Reasoning:
    """One choice's split. `inside`: the prompt opened the thinking block (or the parser
    assumes it); `include`: the request's `include_reasoning` (False: reasoning dropped);
    `force_content`: nemotron_v3 gives an empty-content reply's reasoning as its content
    (`forces_content` of the request's chat_template_kwargs); `head`: openai_gptoss, the
    message the prompt leaves open (harmony.prompt_head)."""

    parser: str
    inside: bool = False
    include: bool = True
    force_content: bool = False
    head: str | None = None
    _sent_r: int = 0
    _sent_c: int = 0
    _forced: bool = False

    def __post_init__(self):
        if self.parser not in PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {', '.join(PARSERS)}, got "
                             f"{self.parser!r}")

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`; not `final`: what may still become a tag is left
        out of both (neither ever shrinks as text grows)."""
        r, c = self._split(text, final)
        if r and self.parser == "nemotron_v3":  # NOTE: a prefix of any later split's, too
            r = r.rstrip()
        return r, c

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self.parser == "openai_gptoss":
            return harmony.split(text, final, self.head)
        thinking = self.parser == "deepseek_r1" or self.inside
        if text.startswith(START):
            thinking, text = True, text[len(START):]
        elif not final and START.startswith(text):  # "" or "<thi": may still open the block
            return ("", None) if thinking else (None, None)
        if not thinking:
            return None, text
        i = text.find(END)
        t = text.find(TOOL) if self.parser in QWEN3_LIKE else -1
        if t >= 0 and (i < 0 or t < i):  # a call ends the thinking too (content from it on)
            return text[:t], text[t:]
        if i >= 0:
            return text[:i], text[i + len(END):]
        if final:
            return text, None
        keep = max(held(text, END), held(text, TOOL) if self.parser in QWEN3_LIKE else 0)
        return text[:len(text) - keep], None

    def _swapped(self, r: str | None, c: str | None) -> bool:
        return (bool(r) and self.force_content and self.parser == "nemotron_v3"
                and not (c or "").strip())

    def message(self, text: str) -> dict:
        """The response message's fields for the whole reply."""
        r, c = self.split(text)
        if self._swapped(r, c):
            r, c = c, r
        out = {"content": c if (c or r is None) else None}
        if self.include:
            out["reasoning"] = out["reasoning_content"] = r or None
        return out

    def delta(self, text: str, final: bool) -> dict:
        """The delta fields for the reply's text so far (cumulative), those not sent before."""
        r, c = self.split(text, final)
        out = {}
        if r is not None and len(r) > self._sent_r:
            if self.include:
                out["reasoning"] = out["reasoning_content"] = r[self._sent_r:]
            self._sent_r = len(r)
        # NOTE: content that is all whitespace so far may still be swapped for the reasoning
        hold = (self.force_content and self.parser == "nemotron_v3" and not self._sent_c
                and c is not None and not c.strip() and (not final or self._swapped(r, c)))
        if c is not None and len(c) > self._sent_c and not hold:
            out["content"] = c[self._sent_c:]
            self._sent_c = len(c)
        if final and r and not self._forced and self._swapped(r, c):
            out["content"] = out.get("content", "") + r  # the whole reasoning, at the end
            self._forced = True
        return out


def prompt_opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside a thinking block (its last `<think>`)."""
    tail = tokenizer.decode(prompt_ids[-16:]).rstrip()
    return tail.endswith(START)


def forces_content(template_kwargs: dict | None) -> bool:
    """Whether a request's chat_template_kwargs make nemotron_v3 give an empty-content reply's
    reasoning as its content (thinking turned off, or force_nonempty_content)."""
    kw = template_kwargs or {}
    return any(k in kw and kw[k] is v for k, v in THINKING_OFF)
