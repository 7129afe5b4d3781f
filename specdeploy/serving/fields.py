"""Which request fields the server knows, and what it does with each (invariant: never silently
wrong). A field we know but do not implement is refused with a 400 naming it, unless its value
is the one that changes nothing; a field nobody documents is logged once and ignored (clients
send vendor extras, and OpenAI adds fields).

The tables list OpenAI's fields and vLLM's extensions of the two endpoints.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

log = logging.getLogger("specdeploy.serving")

# Read by the parsers (protocol.py, chat.py; the sampling and structured-output fields by
# sampling_fields.py: n, logprobs, penalties, min_p / min_tokens, response_format, ...).
PARSED_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "stream", "stream_options",
                 "add_special_tokens", "n", "logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "response_format", "guided_json", "structured_outputs", "prompt_logprobs",
                 "guided_regex", "guided_choice", "guided_grammar", "logit_bias",
                 "allowed_token_ids", "bad_words", "skip_special_tokens",
                 "include_stop_str_in_output", "truncate_prompt_tokens", "truncation_side",
                 "return_token_ids", "return_tokens_as_token_ids", "priority")
PARSED = {
    "completion": PARSED_COMMON + ("prompt", "echo", "suffix", "best_of"),
    "chat": PARSED_COMMON + ("messages", "max_completion_tokens", "add_generation_prompt",
                             "continue_final_message", "chat_template", "chat_template_kwargs",
                             "documents", "tools", "tool_choice", "parallel_tool_calls",
                             "echo", "top_logprobs", "include_reasoning",
                             "mm_processor_kwargs"),
}

# Informational: no effect on the answer whatever their value.
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key", "request_id", "cache_salt",
           "guided_decoding_backend")  # outlines-core (regular), llguidance (guided_grammar)

# Known, not implemented: refused unless the value is one of these (a harmless default).
# An empty list / object counts as unset.
UNSUPPORTED: dict[str, tuple] = {
    "functions": (None,),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "thinking_token_budget": (None,),
    # structured outputs other than JSON, regex and choice (parsed: sampling_fields.py)
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
}

_seen_unknown: set[str] = set()
_seen_lock = threading.Lock()


def check_fields(body: dict, endpoint: str, bad) -> None:
    """Refuse known-but-unsupported fields (`bad(param, message, code)` builds the 400) and
    log each unknown field name once per process."""
    parsed = PARSED[endpoint]
    for name, value in body.items():
        if name in parsed or name in IGNORED:
            continue
        if name in UNSUPPORTED:
            if not _is_default(value, UNSUPPORTED[name]):
                raise bad(name, f"{_show(value)} is not supported by this server",
                          "unsupported")
            continue
        _log_unknown(name, endpoint)


def _is_default(value: Any, ok: tuple) -> bool:
    if isinstance(value, (list, dict)) and not value:
        return True
    for o in ok:
        if isinstance(value, bool) or isinstance(o, bool):  # 0 is not False here
            if value is o:
                return True
        elif value == o:
            return True
    return False


def _show(value: Any) -> str:
    s = json.dumps(value)
    return s if len(s) <= 80 else s[:77] + "..."


def _log_unknown(name: str, endpoint: str) -> None:
    with _seen_lock:
        if name in _seen_unknown:
            return
        _seen_unknown.add(name)
    log.warning("ignoring unknown request field %r (first seen on the %s endpoint; logged "
                "once)", name, endpoint)
