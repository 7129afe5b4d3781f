"""Chat templates: the sandboxed Jinja environment transformers renders them in, and the one
function that turns a conversation into prompt ids (LLM.chat, the CLI and the server share it).

Templates written for transformers use a few things plain Jinja lacks: `raise_exception`,
`strftime_now`, a `tojson` that keeps HTML characters, and the `{% generation %}` block (it marks
the assistant's tokens for training masks; rendering only needs its body). Variables beyond
`messages` (`tools`, `documents`, `enable_thinking`, ...) are passed through to the template.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

# Render variables a caller's template kwargs may not replace: they have their own arguments.
RESERVED = ("messages", "add_generation_prompt", "continue_final_message")


class ChatTemplateError(ValueError):
    """The template itself failed (it does not parse, or an expression in it raised), as
    opposed to a conversation it refuses with raise_exception."""


def _template_line(e: BaseException) -> int | None:
    """The template line an error was raised at (jinja maps its frames to `<template>`)."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@lru_cache(maxsize=16)
def compile_template(template: str):
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which changes the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, variables: dict | None = None) -> str:
    """The rendered prompt. `continue_final_message`: the last message (an assistant's start)
    is left open so the model continues it: the text after its content (end-of-turn tokens)
    is cut, as transformers does."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with "
                         "add_generation_prompt (the final message is continued, no new turn "
                         "is opened)")
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    try:
        compiled = compile_template(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: line {e.lineno}: "
                                f"{e.message}") from None
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **(variables or {}))
    except TemplateError:
        raise  # the template's own raise_exception(...): its message names the problem
    except Exception as e:  # e.g. a message field the template writes is missing or None
        raise ChatTemplateError(f"the chat template failed at line {_template_line(e)}: "
                                f"{type(e).__name__}: {e}") from None
    if not continue_final_message:
        return text
    final = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    if isinstance(final, list):  # text parts: the template wrote them one after the other
        final = "".join(p.get("text", "") for p in final if isinstance(p, dict))
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message: the final message needs text content to "
                         "continue")
    # NOTE: stripped, as templates often trim the content they write
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the final "
                         "message's content verbatim, so it cannot be continued")
    return text[:at + len(final.strip())]


def chat_ids(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids of a conversation. The template writes BOS and any other special tokens as
    text, so the text is encoded without adding them again (a tokenizer that adds BOS would
    otherwise give it twice)."""
    kwargs = dict(template_kwargs or {})
    bad = [k for k in kwargs if k in RESERVED or not isinstance(k, str)]
    if bad:
        raise ValueError(f"chat_template_kwargs: {bad[0]!r} cannot be set there")
    out = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt,
        **({"continue_final_message": True} if continue_final_message else {}),
        **({"chat_template": chat_template} if chat_template is not None else {}), **kwargs)
    if not isinstance(out, str):
        return list(out)
    return list(tokenizer.encode(out, add_special_tokens=False))
