"""OpenAI request parsing: the fields both endpoints share, and `/v1/completions`.

Requests are parsed by hand from the JSON body (not with pydantic models) so every rejection is a
400 with an OpenAI-style body that names the offending field, and nothing invalid reaches the
engine: the limits the engine would enforce (`max_seq_len`, KV capacity, vocabulary) are checked
here first. Chat requests: chat.py; the body's JSON: body.py; response bodies: responses.py;
which fields are known: fields.py.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from specdeploy.engine import SamplingParams
from specdeploy.engine.params_check import check_for_model
from specdeploy.serving import sampling_fields as F
from specdeploy.serving.errors import APIError, bad
from specdeploy.serving.fields import check_fields
from specdeploy.serving.logprobs_format import (
    echo_logprobs,
    format_logprobs,
    prompt_logprobs_json,
)
from specdeploy.serving.token_fields import token_ids_flags, truncation

__all__ = ["APIError", "GenerationRequest", "Limits", "bad", "parse_completion"]
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is one engine request)


@dataclass(frozen=True)
class Limits:
    """What the served engine accepts (checked before a request reaches it)."""

    model_name: str
    max_seq_len: int
    kv_capacity: int  # tokens one sequence may hold in the whole KV cache
    vocab_size: int
    # Characters one token covers at most (the longest vocabulary entry): a prompt longer than
    # context * this cannot fit, so it is refused before the tokenizer spends seconds on it.
    max_token_chars: int | None = None
    vision: Any = None  # a vision-language deployment (deploy/vlm.py): image parts accepted
    grammar: Any = None  # SamplingParams.grammar_key → compiled grammar; raises ValueError
    # generation_config.json's sampling defaults (model_defaults.py): used where a request
    # leaves a field unset, before OpenAI's own defaults
    sampling_defaults: dict = field(default_factory=dict)
    reasoning_parser: str | None = None  # serving/reasoning.py: chat replies' thinking split
    tool_parser: str | None = None  # serving/tools.py: tool_choice "auto" parses calls
    return_tokens_as_token_ids: bool = False  # the default of the request field (token_fields)
    priority_scheduling: bool = False  # the engine schedules by `priority` (else only 0)

    @property
    def context(self) -> int:
        """Tokens one sequence may hold: prompt and reply."""
        return min(self.max_seq_len, self.kv_capacity)

    @property
    def max_prompt_chars(self) -> int | None:
        if self.max_token_chars is None:
            return None
        return min(self.max_seq_len, self.kv_capacity) * self.max_token_chars


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request: one engine request per choice (`n` per prompt)."""

    chat: bool
    model: str
    prompts: list[list[int]]  # per choice: prompt i's n choices are i * n .. i * n + n - 1
    params: list[SamplingParams]  # per choice (chat's default max_tokens depends on its length)
    stream: bool
    include_usage: bool
    mm: list | None = None  # per choice: its images (vision/prompt.py MultimodalPrompt) or None
    n: int = 1
    tokenizer: Any = None  # spells the tokens of logprobs
    reasoning: list | None = None  # per choice: its serving/reasoning.py `Reasoning` (chat)
    tools: list | None = None  # per choice: its serving/tools.py `ToolReply` (chat with tools)
    echo: list | None = None  # per choice: the prompt's text, before the reply (completions)
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens lead them
    prompt_logprobs_asked: bool = False  # vLLM's `prompt_logprobs` field was sent
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids in the response
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name "token_id:<id>"
    priority: int = 0  # vLLM's: lower runs first (the "priority" scheduling policy)
    history: list | None = None  # /v1/responses: the conversation sent, to store with the reply
    # max_tokens 0 with echo (scoring a prompt: its logprobs, OpenAI's legacy use): the engine
    # makes one token, which the response leaves out
    drop_reply: bool = False

    @property
    def reply_ids_shown(self) -> bool:
        """`return_token_ids`' reply ids, but not where they would show dropped reasoning
        (`include_reasoning` false; as vLLM)."""
        return self.return_token_ids and not (self.reasoning and not self.reasoning[0].include)

    def view(self, out):
        """The output as the client sees it: without its one token where `drop_reply`."""
        if not self.drop_reply:
            return out
        return dataclasses.replace(out, text="", token_ids=[], delta_text="", delta_token_ids=[],
                                   logprobs=None if out.logprobs is None else [],
                                   finish_reason=out.finish_reason and "length")

    @property
    def prompt_tokens(self) -> int:
        """Usage counts each prompt once, however many choices it has (as OpenAI, vLLM)."""
        return sum(len(p) for p in self.prompts[::self.n])

    def logprobs(self, index: int, token_ids: list[int], logprobs, offset: int = 0):
        return format_logprobs(self.chat, self.tokenizer, token_ids, logprobs,
                               self.params[index].logprobs, offset, self.as_ids)

    def final_logprobs(self, index: int, out) -> dict | None:
        """A whole choice's logprobs (`out`: its finished RequestOutput): with echo, the
        prompt's tokens' first."""
        lp = self.logprobs(index, out.token_ids, out.logprobs)
        if not self.echo_logprobs:
            return lp
        return echo_logprobs(self.tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                             self.params[index].logprobs, lp, len(self.echo[index]), self.as_ids)

    def echo_chars(self, index: int) -> int:
        """Characters the reply's text_offset counts from: the echo's, where its logprobs
        lead."""
        return len(self.echo[index]) if self.echo_logprobs else 0

    def echo_logprobs_alone(self, index: int, out) -> dict:
        """The prompt's tokens' logprobs in completions' shape (a stream's echo chunk)."""
        return echo_logprobs(self.tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                             self.params[index].logprobs, None, 0, self.as_ids)

    def prompt_logprobs(self, index: int, out) -> list | None:
        """vLLM's `prompt_logprobs` of a choice (None unless the request asked for them)."""
        n = self.params[index].prompt_logprobs
        if n is None or not self.prompt_logprobs_asked:  # (echo's own are in its logprobs)
            return None
        return prompt_logprobs_json(self.tokenizer, out.prompt_logprobs,
                                    out.prompt_logprob_ranks, out.prompt_token_ids, n)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {json.dumps(v)}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"must be in [{lo}, {hi}], got {v}" if hi is not None
                  else f"must be >= {lo}, got {v}", "invalid_value")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {json.dumps(v)}", "invalid_type")
    return v


def _unsupported(body: dict, name: str, ok: tuple = (None,)) -> None:
    v = body.get(name)
    if v not in ok and not (isinstance(v, (list, dict)) and not v):
        raise bad(name, f"{json.dumps(v)} is not supported by this server", "unsupported")


def priority(body: dict, limits: Limits) -> int:
    """vLLM's `priority` (lower first): anything but 0 needs the priority policy."""
    v = _int(body, "priority", 0)
    if v and not limits.priority_scheduling:
        raise bad("priority", f"{v} needs a server started with --scheduling-policy priority",
                  "unsupported")
    return v


def _common(body: dict) -> tuple[bool, bool]:
    """Checks shared by both endpoints; returns (stream, include_usage)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string", "invalid_type")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true", "invalid_value")
        if not isinstance(opts, dict):
            raise bad("stream_options", "must be an object", "invalid_type")
        include_usage = _bool(opts, "include_usage", False)
    return stream, include_usage


def _sampling(body: dict, max_tokens: int, limits: Limits, chat: bool) -> list[SamplingParams]:
    """One SamplingParams per choice (`n`; choice j seeded with seed + j). The rules are
    SamplingParams' own (engine/params_check.py); only the API's spellings are translated here
    (and in sampling_fields.py): top_k -1 (vLLM) means off, like 0, and OpenAI's temperature
    default is 1. A field the request leaves unset takes the checkpoint's generation_config
    default first. A structured-output schema is compiled here, so a bad one is a 400."""
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **limits.sampling_defaults}
    sampled = {k: defaults[k] if body.get(k) is None else body[k] for k in defaults}
    top_k = sampled["top_k"]
    sampled["top_k"] = 0 if top_k == -1 and _is_int(top_k) else top_k
    try:
        n, extra = F.num_choices(body), F.sampling_kwargs(body, chat)
        params = [SamplingParams(
            max_tokens=max_tokens, **{**sampled, **extra},
            seed=F.choice_seed(body.get("seed"), j), stop=body.get("stop"),
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=False if body.get("ignore_eos") is None else body["ignore_eos"])
            for j in range(n)]
        check_for_model(params[0], limits.vocab_size)
    except F.FieldError as e:
        raise bad(e.param, e.message, e.code) from None
    except ValueError as e:  # messages start with the field's name
        raise bad(F.field_of(e), str(e).split(": ", 1)[-1], "invalid_value") from None
    if params[0].structured and limits.grammar is not None:
        try:
            limits.grammar(params[0].grammar_key)
        except ValueError as e:
            p = params[0]
            field = ("guided_regex" if p.guided_regex is not None else
                     "guided_choice" if p.guided_choice is not None else
                     "guided_grammar" if p.guided_grammar is not None
                     and body.get("response_format") is None else "response_format")
            raise bad(F.structured_field(body, field), str(e).split(": ", 1)[-1],
                      "invalid_value") from None
    return params


def _check_prompt(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise bad(field, "must not be empty", "invalid_value")
    if _room(len(ids), limits) < 1:
        raise bad(field, f"{len(ids)} tokens leave no room to generate: this model's maximum "
                  f"context length is {min(limits.max_seq_len, limits.kv_capacity)} tokens",
                  "context_length_exceeded")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        raise bad(field, f"token ids must be in [0, {limits.vocab_size})", "invalid_value")


def _check_chars(n: int, limits: Limits, field: str) -> None:
    bound = limits.max_prompt_chars
    if bound is not None and n > bound:
        raise bad(field, f"{n} characters cannot fit this model's maximum context length of "
                  f"{min(limits.max_seq_len, limits.kv_capacity)} tokens",
                  "context_length_exceeded")


def _room(n: int, limits: Limits) -> int:
    return limits.context - n


def _max_tokens(body: dict, field: str, n: int, limits: Limits, default: int | None) -> int:
    """Validate `max_tokens` against the prompt of n tokens; None (chat) = all the room left."""
    room = _room(n, limits)
    value = _int(body, field, None, 1)
    if value is None:
        return room if default is None else min(default, room)
    if value > room:
        raise bad(field, f"{value} is too large: the prompt has {n} tokens and this model's "
                  f"maximum context length is {min(limits.max_seq_len, limits.kv_capacity)} "
                  f"tokens (at most {room} more)", "context_length_exceeded")
    return value


def _model(body: dict, limits: Limits) -> str:
    name = body.get("model")
    if name is not None and name != limits.model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves "
                       f"`{limits.model_name}`)", "model", "model_not_found")
    return limits.model_name


def parse_completion(body: dict, tokenizer, limits: Limits) -> GenerationRequest:
    check_fields(body, "completion", bad)
    stream, include_usage = _common(body)
    specials = _bool(body, "add_special_tokens", True)
    model = _model(body, limits)
    echo = _bool(body, "echo", False)
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "suffix", (None, ""))
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required", "missing_required_parameter")
    raw = body["prompt"]
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_int(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad("prompt", "must be a string, a list of token ids or a list of those",
                  "invalid_type")
    if len(raw) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request", "invalid_value")
    trunc = truncation(body)  # (serving/token_fields.py)
    zero = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    prompts, texts = [], []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "must not be empty", "invalid_value")
            if trunc.keep is None:  # (a prompt to truncate may be longer than the context)
                _check_chars(len(p), limits, "prompt")
            texts.append(p)
            p = list(tokenizer.encode(p, add_special_tokens=specials))
        elif not (isinstance(p, list) and all(_is_int(t) for t in p)):
            raise bad("prompt", "must be a string, a list of token ids or a list of those",
                      "invalid_type")
        else:
            texts.append(None)
        cut = trunc.apply(p, limits.context, body.get("max_tokens", 16))
        if len(cut) < len(p):
            p, texts[-1] = cut, None  # (echo shows the prompt as the model saw it)
        _check_prompt(p, limits, "prompt")
        prompts.append(p)
    choices = [_sampling(body, 1 if zero else _max_tokens(body, "max_tokens", len(p), limits, 16),
                         limits, False) for p in prompts]
    n = len(choices[0])
    if n * len(prompts) > MAX_PROMPTS:
        raise bad("n", f"at most {MAX_PROMPTS} choices (prompts x n) per request",
                  "invalid_value")
    shown = None
    if echo:  # the prompt as sent, or its ids' text (vLLM's echo)
        shown = [t if t is not None else tokenizer.decode(p) for t, p in zip(texts, prompts)
                 for _ in range(n)]
    params = [sp for c in choices for sp in c]
    echo_lp = echo and params[0].logprobs is not None
    if echo_lp:  # the prompt's tokens lead the logprobs: the engine computes theirs too
        want = max(params[0].logprobs, params[0].prompt_logprobs or 0)
        params = [dataclasses.replace(sp, prompt_logprobs=want) for sp in params]
    if stream and body.get("prompt_logprobs") is not None:  # (vLLM: not with stream either)
        raise bad("prompt_logprobs", "the prompt's logprobs are not streamed; send the request "
                  "without stream (or use echo with logprobs)", "unsupported")
    ret_ids, as_ids = token_ids_flags(body, limits.return_tokens_as_token_ids)
    return GenerationRequest(False, model, [p for p in prompts for _ in range(n)], params,
                             stream, include_usage, None, n, tokenizer, echo=shown,
                             echo_logprobs=echo_lp,
                             prompt_logprobs_asked=body.get("prompt_logprobs") is not None,
                             return_token_ids=ret_ids, as_ids=as_ids, drop_reply=zero,
                             priority=priority(body, limits))
