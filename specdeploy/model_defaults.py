"""What a checkpoint says about serving it: its context length (`max_position_embeddings`) and
its sampling defaults (`generation_config.json`), applied as vLLM does.

- The context (`max_model_len`, vLLM's name; `max_seq_len` here) defaults to the model's own
  limit, capped at `DEFAULT_MAX_LEN` so the cache plan stays small on a CPU. Asking for more than
  the model's limit is refused (positions past it were never trained) unless
  `SPECDEPLOY_ALLOW_LONG_MAX_MODEL_LEN=1`, which only warns.
- `generation_config`: "auto" reads the checkpoint's generation_config.json, "vllm" ignores it,
  a directory reads that directory's. Its sampling keys become the defaults of requests that do
  not set them (only keys `SamplingParams` has: an engine without penalties takes none).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("specdeploy")
DEFAULT_MAX_LEN = 2048
ALLOW_LONG_ENV = "SPECDEPLOY_ALLOW_LONG_MAX_MODEL_LEN"
# generation_config.json keys that are sampling defaults (same spellings in SamplingParams)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_max_len(hf_config: dict) -> int | None:
    cfg = hf_config.get("text_config", hf_config)
    v = cfg.get("max_position_embeddings")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def resolve_max_len(hf_config: dict, max_model_len: int | None = None,
                    max_seq_len: int | None = None) -> int:
    """The context length to deploy with (prompt + output tokens per sequence)."""
    if max_model_len is not None and max_seq_len is not None and max_model_len != max_seq_len:
        raise ValueError(f"max_model_len: {max_model_len} and max_seq_len {max_seq_len} are the "
                         "same setting; give one")
    asked = max_model_len if max_model_len is not None else max_seq_len
    limit = model_max_len(hf_config)
    if asked is None:
        return DEFAULT_MAX_LEN if limit is None else min(DEFAULT_MAX_LEN, limit)
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise ValueError(f"max_model_len: must be a positive integer, got {asked!r}")
    if limit is not None and asked > limit:
        msg = (f"max_model_len: {asked} is longer than the model's max_position_embeddings "
               f"({limit})")
        if os.environ.get(ALLOW_LONG_ENV) != "1":
            raise ValueError(f"{msg}; set {ALLOW_LONG_ENV}=1 to deploy it anyway (output past "
                             f"{limit} tokens may be garbage)")
        log.warning("%s: deploying it anyway (%s=1)", msg, ALLOW_LONG_ENV)
    return asked


def generation_defaults(model_path: Path, mode: str | os.PathLike | None = "auto",
                        allowed: tuple[str, ...] | None = None) -> dict:
    """Sampling defaults from generation_config.json (see the module docstring)."""
    if mode in (None, "vllm"):
        return {}
    if mode == "auto":
        folder = model_path if model_path.is_dir() else None
    else:
        folder = Path(mode)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {folder} has no generation_config.json "
                             "(use auto, vllm or a directory holding one)")
    if folder is None or not (folder / "generation_config.json").is_file():
        return {}
    f = folder / "generation_config.json"
    try:
        gen = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: malformed JSON ({e})") from None
    from specdeploy.engine import SamplingParams

    fields = {x.name for x in dataclasses.fields(SamplingParams)}
    keys = [k for k in (allowed or SAMPLING_KEYS) if k in fields]
    out = {k: gen[k] for k in keys if gen.get(k) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None
    if out:
        log.info("sampling defaults from %s: %s", f, out)
    return out
