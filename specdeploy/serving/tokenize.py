"""`/tokenize` and `/detokenize`, with vLLM's request and response shapes.

/tokenize: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...]}` with the chat
options of /v1/chat/completions (rendered by the chat template, as a chat request would be);
`return_token_strs` adds each token's text. Answer: `{"count", "max_model_len", "tokens",
"token_strs"}`. /detokenize: `{"tokens": [ids]}` → `{"prompt": text}`.
"""
from __future__ import annotations

from specdeploy.serving.chat import render_messages
from specdeploy.serving.errors import bad
from specdeploy.serving.protocol import Limits, _bool, _check_chars, _is_int, _model

MAX_DETOKENIZE = 1 << 20  # ids in one /detokenize request


def tokenize(body: dict, tokenizer, limits: Limits) -> dict:
    _model(body, limits)
    strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("prompt", "give prompt or messages, not both", "invalid_value")
        ids, _, _ = render_messages(body, tokenizer, limits)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("prompt", "is required (or messages)", "missing_required_parameter")
        if not isinstance(prompt, str):
            raise bad("prompt", "must be a string", "invalid_type")
        _check_chars(len(prompt), limits, "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=_bool(
            body, "add_special_tokens", True)))
    return {"count": len(ids), "max_model_len": limits.max_seq_len, "tokens": ids,
            "token_strs": [tokenizer.decode([t]) for t in ids] if strs else None}


def detokenize(body: dict, tokenizer, limits: Limits) -> dict:
    _model(body, limits)
    ids = body.get("tokens")
    if ids is None:
        raise bad("tokens", "is required", "missing_required_parameter")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise bad("tokens", "must be a list of token ids", "invalid_type")
    if len(ids) > MAX_DETOKENIZE:
        raise bad("tokens", f"at most {MAX_DETOKENIZE} ids", "invalid_value")
    if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):
        raise bad("tokens", f"token ids must be in [0, {limits.vocab_size})", "invalid_value")
    return {"prompt": tokenizer.decode(ids)}
