"""Request fields that reach the engine's logits: `n`, logprobs, penalties, `min_p`,
`min_tokens`, `logit_bias`, `allowed_token_ids`, `bad_words` and structured output (OpenAI's
names and vLLM's extensions).

Only the API's spellings are translated here; the value rules are `SamplingParams`' own
(engine/params_check.py), so a bad value is a 400 naming its field either way.
"""
from __future__ import annotations

import json
from typing import Any

from specdeploy.engine.params_check import MAX_LOGPROBS, MAX_SEED

MAX_N = 16  # choices per prompt (each one is an engine request and holds a batch slot)
_PASS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
         "bad_words", "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs")


class FieldError(ValueError):
    """`ValueError("<field>: message")` whose field is the API's name, not the engine's."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.code = param, message, code


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def num_choices(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise FieldError("n", f"must be an integer in [1, {MAX_N}], got {json.dumps(n)}")
    return n


def choice_seed(seed: Any, j: int) -> Any:
    """Choice j of a seeded request draws from seed + j (vLLM's convention for n > 1): the
    choices differ and each is reproducible. An invalid seed is left for the rules to refuse."""
    if j == 0 or not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        return seed
    return (seed + j) % (MAX_SEED + 1)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top-N logprobs per token: chat `logprobs: true` + `top_logprobs: N`; completions
    `logprobs: N` (an integer). None: no logprobs."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise FieldError("logprobs", f"must be a boolean, got {json.dumps(lp)}",
                             "invalid_type")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
                raise FieldError("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {json.dumps(top)}")
            if not lp:
                raise FieldError("top_logprobs", "needs logprobs: true")
        return (top or 0) if lp else None
    if lp is None:
        return None
    if not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS:
        raise FieldError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got "
                         f"{json.dumps(lp)}")
    return lp


def _structured(body: dict) -> dict:
    """`response_format` (OpenAI), vLLM's older `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar`, or its `structured_outputs: {"json" | "json_object" |
    "regex" | "choice" | "grammar": ...}` → SamplingParams' guided_json / json_object /
    guided_regex / guided_choice / guided_grammar."""
    found: dict = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise FieldError("response_format", "json_schema needs `json_schema.schema`, "
                                 "a JSON schema object")
            found = {"guided_json": schema}
        elif kind == "structural_tag":
            found = {"guided_grammar": structural_tag(fmt, "response_format")}
        elif kind != "text":
            raise FieldError("response_format", "must be {\"type\": \"text\"}, "
                             "{\"type\": \"json_object\"}, {\"type\": \"json_schema\", ...} "
                             "or {\"type\": \"structural_tag\", ...}", "unsupported")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs"):
        value = body.get(name)
        if value is None:
            continue
        if found:
            raise FieldError(name, "give one of response_format, guided_json, guided_regex, "
                             "guided_choice, guided_grammar and structured_outputs")
        if name != "structured_outputs":
            found = {name: value}
            continue
        if not isinstance(value, dict):
            raise FieldError(name, "must be an object", "invalid_type")
        given = sorted(k for k, v in value.items() if v is not None and v is not False)
        extra = [k for k in given if k not in _STRUCTURED]
        if extra:
            raise FieldError(f"{name}.{extra[0]}", "is not supported (json, json_object, "
                             "regex, choice, grammar and structural_tag are)", "unsupported")
        if len(given) > 1:
            raise FieldError(name, f"give one of {', '.join(given)}")
        if given and given[0] == "structural_tag":
            found = {"guided_grammar": structural_tag(value["structural_tag"],
                                                      f"{name}.structural_tag")}
        elif given:
            found = {_STRUCTURED[given[0]]: value[given[0]]}
    return found


def structural_tag(value: Any, field: str) -> str:
    """vLLM's (xgrammar's) structural tag: `{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}` (as an object or JSON text): free text, in which every trigger must
    go on as one of the structures that begin with it, `begin` + a JSON value of `schema` +
    `end` (a tool call in the middle of a reply). Compiled to a context-free grammar for
    `guided_grammar` (llguidance's StructTag: the trigger is a lazy lexeme)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise FieldError(field, "must be a structural tag object or its JSON text") from None
    if not isinstance(value, dict):
        raise FieldError(field, "must be a structural tag object", "invalid_type")
    if "format" in value and "structures" not in value:
        raise FieldError(field, "the {\"format\": ...} form is not supported; give "
                         "\"structures\" and \"triggers\"", "unsupported")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures or len(structures) > 64:
        raise FieldError(field, "needs \"structures\": a list of 1 to 64 {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise FieldError(field, "needs \"triggers\": a list of non-empty strings")
    try:
        from llguidance import StructTag
    except ImportError:  # pragma: no cover (an install without the serve extra)
        raise FieldError(field, "needs llguidance (pip install llguidance)",
                         "unsupported") from None
    tags = []
    for i, s in enumerate(structures):
        begin, schema, end = (s.get(k) for k in ("begin", "schema", "end")) \
            if isinstance(s, dict) else (None, None, None)
        if not isinstance(begin, str) or not begin or not isinstance(end, str) \
                or not isinstance(schema, dict):
            raise FieldError(field, f"structures[{i}] needs \"begin\" (a non-empty string), "
                             "\"schema\" (a JSON schema object) and \"end\" (a string)")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise FieldError(field, f"structures[{i}].begin {json.dumps(begin)[:60]} starts "
                             "with none of the triggers")
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    # NOTE: assume_special=False: a "<...>" trigger is text here, not a special token
    return StructTag.to_grammar(tags, assume_special=False)


# vLLM's structured_outputs keys -> SamplingParams' fields
_STRUCTURED = {"json": "guided_json", "json_object": "json_object", "regex": "guided_regex",
               "choice": "guided_choice", "grammar": "guided_grammar",
               "structural_tag": "guided_grammar"}


def structured_field(body: dict, field: str) -> str:
    """The API field a structured-output value came from, for a compile error's `param`."""
    return "structured_outputs" if body.get("structured_outputs") is not None \
        and field != "response_format" else field


def _logit_bias(body: dict) -> dict[int, Any] | None:
    """OpenAI's `logit_bias`: a JSON object whose keys are token ids as strings ("50256")."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError("logit_bias", f"must be an object of token ids to numbers, got "
                         f"{json.dumps(v)[:80]}", "invalid_type")
    out = {}
    for k, b in v.items():
        key = k.strip() if isinstance(k, str) else None
        if not key or not key.isdigit():
            raise FieldError("logit_bias", f"keys must be token ids, got {json.dumps(k)}")
        out[int(key)] = b
    return out


def sampling_kwargs(body: dict, chat: bool) -> dict:
    """SamplingParams keyword arguments for the fields this module owns."""
    kw = {name: body[name] for name in _PASS if body.get(name) is not None}
    bias = _logit_bias(body)
    if bias:
        kw["logit_bias"] = bias
    if body.get("allowed_token_ids") is not None:
        kw["allowed_token_ids"] = body["allowed_token_ids"]
    lp = _logprobs(body, chat)
    if lp is not None:
        kw["logprobs"] = lp
    kw.update(_structured(body))
    return kw


def field_of(error: ValueError) -> str:
    """The API field a SamplingParams error names (its own names, but guided_json)."""
    name = str(error).split(":", 1)[0]
    return "response_format" if name in ("guided_json", "json_object") else name
