"""The one set of rules for sampling parameters, shared by `SamplingParams` and the HTTP server.

Every rule raises `ValueError("<field>: ...")` (the server turns it into a 400 naming the field).
Types are strict: a bool is not an int, a string is not a number, and nothing is converted
silently; numpy/torch scalars pass through `numbers` and are normalized to Python types.
The bounds keep every value the sampler can see finite and representable: `top_k` fits an int64
(and the engine refuses it above the vocabulary), a temperature is 0 (greedy) or at least
`MIN_TEMPERATURE`, below which `logits / t` overflows to inf/NaN in fp32.
"""
from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from typing import Any

MIN_TEMPERATURE = 1e-5  # vLLM clamps at 1e-5 too; 0 means greedy
MAX_TEMPERATURE = 100.0  # sampling is uniform long before this; bounds logits / t below too
MAX_TOKENS_LIMIT = 2**31 - 1  # the engine then checks the real context room
MAX_TOP_K = 2**31 - 1  # int64-safe; the vocabulary bound is `check_for_model`'s
MAX_STOP = 16  # stop strings per request: each one is scanned on every new token
MAX_STOP_CHARS = 512  # per stop string: the server's hold-back scan is quadratic in it
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # top-N per token (OpenAI's top_logprobs bound; vLLM's default max_logprobs)
MAX_REPETITION_PENALTY = 100.0  # beyond it every seen token is already out of reach
MAX_SCHEMA_CHARS = 64 * 1024
MAX_CHOICES = 1024  # guided_choice's strings
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS = 1024  # ids a request biases (OpenAI takes 300)
MAX_BIAS = 100.0  # OpenAI's and vLLM's bound: +-100 bans or forces a token
MAX_ALLOWED_TOKEN_IDS = 1 << 20


def _fail(name: str, expect: str, v: Any) -> ValueError:
    shown = repr(v)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"{name}: must be {expect}, got {shown}")


def as_int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise _fail(name, f"an integer in [{lo}, {hi}]", v)
    if not lo <= v <= hi:
        raise _fail(name, f"an integer in [{lo}, {hi}]", v)
    return int(v)


def as_float(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _fail(name, f"a number in [{lo}, {hi}]", v)
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise _fail(name, f"a finite number in [{lo}, {hi}]", v)
    return f


def as_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(name, "true or false", v)
    return v


def temperature(v: Any) -> float:
    t = as_float("temperature", v, 0.0, MAX_TEMPERATURE)
    if 0.0 < t < MIN_TEMPERATURE:
        raise ValueError(f"temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {v!r}")
    return t


def top_p(v: Any) -> float:
    p = as_float("top_p", v, 0.0, 1.0)
    if p == 0.0:
        raise _fail("top_p", "in (0, 1]", v)
    return p


def stop_strings(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = (v,) if isinstance(v, str) else v
    if not isinstance(stops, Sequence) or isinstance(stops, (bytes, bytearray)):
        raise _fail("stop", "a string or a list of strings", v)
    if len(stops) > MAX_STOP:
        raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise _fail("stop", f"non-empty strings of at most {MAX_STOP_CHARS} characters", s)
    return tuple(stops)


def stop_token_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise _fail("stop_token_ids", "a list of token ids", v)
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}")
    return tuple(as_int("stop_token_ids", t, 0, MAX_TOP_K) for t in v)


def repetition_penalty(v: Any) -> float:
    r = as_float("repetition_penalty", v, 0.0, MAX_REPETITION_PENALTY)
    if r == 0.0:
        raise _fail("repetition_penalty", f"in (0, {MAX_REPETITION_PENALTY}]", v)
    return r


def guided_json(v: Any) -> str | None:
    """A JSON schema (object or its JSON text) → compact JSON text (hashable, a cache key)."""
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise _fail("guided_json", "a JSON schema (an object or its JSON text)", v) from None
    if not isinstance(v, dict):
        raise _fail("guided_json", "a JSON schema (an object or its JSON text)", v)
    text = json.dumps(v, separators=(",", ":"))  # key order kept: it orders the output
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"guided_json: schema over {MAX_SCHEMA_CHARS} characters")
    return text


def guided_regex(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_SCHEMA_CHARS:
        raise _fail("guided_regex", f"a non-empty regular expression of at most "
                    f"{MAX_SCHEMA_CHARS} characters", v)
    return v


def guided_grammar(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip() or len(v) > MAX_SCHEMA_CHARS:
        raise _fail("guided_grammar", f"a non-empty grammar of at most {MAX_SCHEMA_CHARS} "
                    "characters", v)
    return v


def guided_choice(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v \
            or len(v) > MAX_CHOICES:
        raise _fail("guided_choice", f"a list of 1 to {MAX_CHOICES} strings", v)
    if not all(isinstance(c, str) and c for c in v):
        raise _fail("guided_choice", "non-empty strings", v)
    if sum(len(c) for c in v) > MAX_SCHEMA_CHARS:
        raise ValueError(f"guided_choice: over {MAX_SCHEMA_CHARS} characters in all")
    return tuple(v)


def bad_words(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) > MAX_BAD_WORDS:
        raise _fail("bad_words", f"a list of at most {MAX_BAD_WORDS} strings", v)
    if not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in v):
        raise _fail("bad_words", f"non-blank strings of at most {MAX_STOP_CHARS} characters", v)
    return tuple(v) or None


def logit_bias(v: Any) -> tuple[tuple[int, float], ...] | None:
    """{id: bias} (or (id, bias) pairs) -> sorted pairs; None or empty: none."""
    if v is None:
        return None
    items = v.items() if isinstance(v, dict) else v
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, type({}.items()))):
        raise _fail("logit_bias", "a map of token ids to numbers", v)
    pairs = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise _fail("logit_bias", "a map of token ids to numbers", v)
        pairs[as_int("logit_bias", item[0], 0, MAX_TOP_K)] = as_float(
            "logit_bias", item[1], -MAX_BIAS, MAX_BIAS)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(pairs)}")
    return tuple(sorted(pairs.items())) or None


def allowed_token_ids(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v:
        raise _fail("allowed_token_ids", "a non-empty list of token ids", v)
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(v)}")
    return tuple(sorted({as_int("allowed_token_ids", t, 0, MAX_TOP_K) for t in v}))


def check_sampling(p) -> dict[str, Any]:
    """The normalized fields of a `SamplingParams` (raises ValueError naming the first bad one)."""
    max_tokens = as_int("max_tokens", p.max_tokens, 1, MAX_TOKENS_LIMIT)
    return {
        "max_tokens": max_tokens,
        "temperature": temperature(p.temperature),
        "top_p": top_p(p.top_p),
        "top_k": as_int("top_k", p.top_k, 0, MAX_TOP_K),
        "seed": None if p.seed is None else as_int("seed", p.seed, 0, MAX_SEED),
        "stop": stop_strings(p.stop),
        "stop_token_ids": stop_token_ids(p.stop_token_ids),
        "ignore_eos": as_bool("ignore_eos", p.ignore_eos),
        "min_p": as_float("min_p", p.min_p, 0.0, 1.0),
        "min_tokens": as_int("min_tokens", p.min_tokens, 0, max_tokens),
        "presence_penalty": as_float("presence_penalty", p.presence_penalty, -2.0, 2.0),
        "frequency_penalty": as_float("frequency_penalty", p.frequency_penalty, -2.0, 2.0),
        "repetition_penalty": repetition_penalty(p.repetition_penalty),
        "logprobs": None if p.logprobs is None else as_int("logprobs", p.logprobs, 0,
                                                           MAX_LOGPROBS),
        "prompt_logprobs": None if p.prompt_logprobs is None else as_int(
            "prompt_logprobs", p.prompt_logprobs, 0, MAX_LOGPROBS),
        "guided_json": guided_json(p.guided_json),
        "json_object": as_bool("json_object", p.json_object),
        "guided_regex": guided_regex(p.guided_regex),
        "guided_choice": guided_choice(p.guided_choice),
        "guided_grammar": guided_grammar(p.guided_grammar),
        "logit_bias": logit_bias(p.logit_bias),
        "allowed_token_ids": allowed_token_ids(p.allowed_token_ids),
        "bad_words": bad_words(p.bad_words),
        "skip_special_tokens": as_bool("skip_special_tokens", p.skip_special_tokens),
        "include_stop_str_in_output": as_bool("include_stop_str_in_output",
                                              p.include_stop_str_in_output),
    }


def check_for_model(p, vocab_size: int) -> None:
    """Rules that need the model: ids and top_k within the vocabulary."""
    if p.top_k > vocab_size:
        raise ValueError(f"top_k: must be at most the vocabulary size ({vocab_size}), "
                         f"got {p.top_k}")
    for name, ids in (("stop_token_ids", p.stop_token_ids),
                      ("logit_bias", [t for t, _ in p.logit_bias or ()]),
                      ("allowed_token_ids", p.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[0]}")


def check_request(engine, prompt_ids, params, priority: int, mm) -> list[int]:
    """A request's prompt (as ints) if `engine` (engine/engine.py) can ever run it, else
    ValueError naming the parameter: the priority and its policy, images against the prompt and
    the model, the prompt's length against max_seq_len and with max_tokens against the whole KV
    cache, token ids within the vocabulary, and the sampling parameters the model allows."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority and engine.scheduler.policy != "priority":
        raise ValueError(f"priority: {priority} needs the \"priority\" scheduling policy "
                         "(this engine schedules first come, first served)")
    if mm is not None and list(prompt_ids) != mm.ids:
        raise ValueError("images: prompt_ids must be the multimodal prompt's expanded ids")
    if mm is not None and not hasattr(engine.deployed, "image_features"):
        raise ValueError("images: this model has no vision tower")
    for kind in ("image", "video"):
        tok = getattr(engine.deployed, f"{kind}_token_id", None)
        if mm is None and tok is not None and tok >= 0 and tok in prompt_ids:
            raise ValueError(f"prompt: has {kind} placeholder tokens (id {tok}) but no "
                             f"{kind}s were given")
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt: empty prompt")
    n = len(prompt_ids)
    if n > engine.max_seq_len:
        hint = "" if mm is None else (" (with its images / videos: fewer pixels or frames fit, "
                                      "e.g. mm_processor_kwargs max_pixels, fps, max_frames)")
        raise ValueError(f"prompt: {n} tokens is longer than max_seq_len={engine.max_seq_len}"
                         + hint)
    if n + params.max_tokens > engine.max_seq_len:
        raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_seq_len={engine.max_seq_len}")
    cap = engine.blocks.num_pages * engine.blocks.page_size - engine.scheduler.lookahead
    # (a model without attention, Mamba2 / MLP only, has no KV pages: nothing to cap)
    if engine.blocks.num_pages and n + params.max_tokens > cap:
        raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds "
                         f"the whole KV cache ({cap} tokens); raise max_cache_gib")
    vocab = engine.deployed.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt: token ids must be in [0, {vocab})")
    check_for_model(params, vocab)
    return prompt_ids
