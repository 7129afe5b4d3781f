"""OpenAI request parsing and response bodies.

Requests are parsed by hand from the JSON body (not with pydantic models) so every rejection is a
400 with an OpenAI-style body that names the offending field, and nothing invalid reaches the
engine: the limits the engine would enforce (`max_seq_len`, KV capacity, vocabulary) are checked
here first.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specdeploy.engine import SamplingParams
from specdeploy.engine.params_check import check_for_model
from specdeploy.serving import sampling_fields as F
from specdeploy.serving.logprobs_format import format_logprobs
from specdeploy.serving.responses import (  # noqa: F401  (the app reads them as P.*)
    chunk_body,
    new_id,
    now,
    response_body,
    sse,
    usage,
    usage_chunk,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is one engine request)
MAX_JSON_DEPTH = 32  # no request needs more; deeper is an attack on the parser's recursion
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


class APIError(Exception):
    """An HTTP error with an OpenAI-style body `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param, code)


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
    grammar: Any = None  # schema (None: any object) → compiled grammar; raises ValueError

    @property
    def max_prompt_chars(self) -> int | None:
        if self.max_token_chars is None:
            return None
        return min(self.max_seq_len, self.kv_capacity) * self.max_token_chars


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request: one engine request per prompt."""

    chat: bool
    model: str
    prompts: list[list[int]]  # per choice: prompt i's n choices are i * n .. i * n + n - 1
    params: list[SamplingParams]  # per choice (chat's default max_tokens depends on its length)
    stream: bool
    include_usage: bool
    mm: list | None = None  # per choice: its images (vision/prompt.py MultimodalPrompt) or None
    n: int = 1
    tokenizer: Any = None  # spells the tokens of logprobs

    @property
    def prompt_tokens(self) -> int:
        """Usage counts each prompt once, however many choices it has (as OpenAI, vLLM)."""
        return sum(len(p) for p in self.prompts[::self.n])

    def logprobs(self, index: int, token_ids: list[int], logprobs, offset: int = 0):
        return format_logprobs(self.chat, self.tokenizer, token_ids, logprobs,
                               self.params[index].logprobs, offset)


# ---- parsing ------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> dict:
    """The body as a dict; 400 for invalid UTF-8 or JSON, nesting deeper than MAX_JSON_DEPTH
    and lone surrogates (`"\\ud800"` is valid JSON but no text: tokenizers and the UTF-8
    encoder of our own error bodies fail on it)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(None, f"could not parse the JSON body of the request ({e})",
                  "invalid_json") from None
    except RecursionError:
        raise bad(None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                  "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str) and not _is_text(k):  # name the parent: the key is not text
                raise bad(path or None, "has a key with a lone surrogate (not valid Unicode "
                          "text)", "invalid_value")
            where = f"{path}.{k}".lstrip(".") if isinstance(k, str) else f"{path}[{k}]"
            if isinstance(v, str) and not _is_text(v):
                raise bad(where, "contains a lone surrogate (not valid Unicode text)",
                          "invalid_value")
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, where))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def _common(body: dict) -> tuple[bool, bool]:
    """Checks shared by both endpoints; returns (stream, include_usage)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string", "invalid_type")
    _unsupported(body, "logit_bias")
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
    default is 1. A structured-output schema is compiled here, so a bad one is a 400."""
    top_k = body.get("top_k")
    try:
        n, extra = F.num_choices(body), F.sampling_kwargs(body, chat)
        params = [SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            top_k=0 if top_k is None or (top_k == -1 and _is_int(top_k)) else top_k,
            seed=F.choice_seed(body.get("seed"), j), stop=body.get("stop"),
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=False if body.get("ignore_eos") is None else body["ignore_eos"], **extra)
            for j in range(n)]
        check_for_model(params[0], limits.vocab_size)
    except F.FieldError as e:
        raise bad(e.param, e.message, e.code) from None
    except ValueError as e:  # messages start with the field's name
        raise bad(F.field_of(e), str(e).split(": ", 1)[-1], "invalid_value") from None
    if params[0].structured and limits.grammar is not None:
        try:
            limits.grammar(params[0].guided_json)
        except ValueError as e:
            raise bad("response_format", str(e).split(": ", 1)[-1], "invalid_value") from None
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
    return min(limits.max_seq_len, limits.kv_capacity) - n


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
    stream, include_usage = _common(body)
    model = _model(body, limits)
    for name in ("echo",):
        _unsupported(body, name, (None, False))
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
    prompts = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "must not be empty", "invalid_value")
            _check_chars(len(p), limits, "prompt")
            p = list(tokenizer.encode(p))
        elif not (isinstance(p, list) and all(_is_int(t) for t in p)):
            raise bad("prompt", "must be a string, a list of token ids or a list of those",
                      "invalid_type")
        _check_prompt(p, limits, "prompt")
        prompts.append(p)
    choices = [_sampling(body, _max_tokens(body, "max_tokens", len(p), limits, 16), limits,
                         False) for p in prompts]
    n = len(choices[0])
    if n * len(prompts) > MAX_PROMPTS:
        raise bad("n", f"at most {MAX_PROMPTS} choices (prompts x n) per request",
                  "invalid_value")
    return GenerationRequest(False, model, [p for p in prompts for _ in range(n)],
                             [sp for c in choices for sp in c], stream, include_usage, None, n,
                             tokenizer)


def _message(i: int, m: Any, images: list | None = None, vision: Any = None) -> dict:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(field, "must be an object with `role` and `content`", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{field}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                  "invalid_value")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text, and image_url on a VLM
        texts, parts = [], []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url" and images is not None:
                from specdeploy.vision.chat import served_image_url

                if vision is None:
                    raise bad(f"{field}.content[{j}]", "this model takes no images (text parts "
                              "only)", "unsupported")
                images.append(served_image_url(part, bad, f"{field}.content[{j}].image_url.url"))
                parts.append({"type": "image"})
                continue
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"{field}.content[{j}]", "only {\"type\": \"text\", \"text\": ...} "
                          "parts are supported", "unsupported")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        content = parts if len(parts) > len(texts) else "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise bad(f"{field}.content", "must be a string or a list of text parts",
                  "invalid_type")
    return {"role": role, "content": content}


def _text_chars(content: str | list) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def parse_chat(body: dict, tokenizer, limits: Limits) -> GenerationRequest:
    stream, include_usage = _common(body)
    model = _model(body, limits)
    _unsupported(body, "tools")
    _unsupported(body, "tool_choice", (None, "none"))
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages", "invalid_type")
    images: list = []
    conversation = [_message(i, m, images, limits.vision) for i, m in enumerate(msgs)]
    _check_chars(sum(_text_chars(m["content"]) for m in conversation), limits, "messages")
    try:
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except Exception as e:  # the template may reject a conversation (roles, order)
        raise bad("messages", f"the chat template rejected the conversation: {e}",
                  "invalid_value") from None
    ids = list(tokenizer.encode(rendered)) if isinstance(rendered, str) else list(rendered)
    mm = None
    if images:
        from specdeploy.vision import ImageError
        from specdeploy.vision.chat import build_prompt

        try:
            mm = build_prompt(limits.vision, ids, images, "messages")
        except ImageError as e:
            raise APIError(400, str(e), "messages", "invalid_image") from None
        ids = mm.ids
    _check_prompt(ids, limits, "messages")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    params = _sampling(body, _max_tokens(body, field, len(ids), limits, None), limits, True)
    n = len(params)
    return GenerationRequest(True, model, [ids] * n, params, stream, include_usage,
                             None if mm is None else [mm] * n, n, tokenizer)
