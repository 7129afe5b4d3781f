"""`SpecConfig("auto")`: the fastest lossless speculative configuration measured for a target.

Resolved from the checkpoint alone, before loading (the loader's choices depend on the method):
- the shipped hybrid-demo: lookup + the default model's store of replies (method "suffix");
- a checkpoint that declares MTP layers: its own MTP head, with n-gram lookup;
- the embedded default model: what `bench/vs_llamacpp.py` measured fastest on a CPU
  (`DEFAULT_MODEL`: lookup + its shipped store of replies; the run that chose it is cited
  there and in docs/benchmarks.md);
- anything else: n-gram lookup, which needs no drafter and costs no draft forwards.
Every choice runs the cost controller (engine/spec_control.py, SpecConfig's default), which
drafts nothing where drafts do not pay on this machine. Fields the caller set away from their
defaults win (a field left at its default cannot be told from one not given): e.g.
`SpecConfig("auto", controller="off")` verifies K drafts every step.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from specdeploy.config import SpecConfig

_LOOKUP = dict(prompt_lookup_max=4, prompt_lookup_num_tokens=16)
# the drafter's precision on a CPU: a draft forward is bound by reading the drafter's weights;
# Q8_0 blocks on the integer-dot kernels: 0.92 ms per EAGLE-3 draft forward vs 4.1 ms in fp32
# and ~3 ms in bf16 + int8 (1 thread, AVX-512, 2026-12-02)
_CPU_DRAFTER = dict(draft_quantize="q8_0")
# bench/results/vs_llamacpp.json (2 cores, AVX-512 VNNI, batch 1, 2026-12-02, decode tokens/s
# vs plain 115.8): fixed lookup 158.9 (1.37x), lookup + controller 157.7 (1.36x), MTP + lookup
# + controller 155.5, EAGLE-3 + controller 115.8. At 16 concurrent requests fixed lookup fell to
# 0.84x plain (bench/results/vs_llamacpp_concurrent.json), where the controller cuts drafts
# that cannot pay: lookup + controller it is. (An AVX2 machine, 2026-12-03, second run,
# bench/results/vs_llamacpp_avx2.json: lookup + controller 1.11x plain, fixed lookup 1.09x,
# MTP / EAGLE-3 + lookup + controller 1.10x / 1.09x, on replies that repeat little; 16
# concurrent: auto 0.99x plain, fixed lookup 0.86x.)
# Since 2026-12-04 the default model ships a suffix store (2.42M tokens of its own replies):
# bench/results/vs_llamacpp_avx512_suffix_1204_store2.json (2 cores, AVX-512 VNNI, batch 1,
# decode tokens/s, plain 234.5): suffix + controller 290.1 (1.24x; rounds 251 / 257 / 263 end
# to end), lookup + controller 252.7 (1.08x; 235 / 227 / 222), fixed suffix 1.17x; at 16
# concurrent requests both 0.87-0.89x plain (..._concurrent_avx512_suffix_1204_store2.json).
# With the store's first half (1.15M tokens) the two were level (1.02x vs 1.08x and 1.10x vs
# 1.07x in two runs). Suffix + controller it is, on the GPU too (a verify row is nearly free
# there; offline replay: 2.06 vs 1.48 tokens per step). Later the same day (..._1204_margin.json,
# ..._1204_final.json): suffix + controller 1.23x / 1.25x plain, MTP + suffix + controller 1.21x
# / 1.28x (level, and it loads a drafter), lookup + controller 1.07x / 1.10x.
# Since 2026-12-05 the store holds 3.48M tokens (every training-split first turn): 2.03 tokens per
# step in the offline replay against 1.90 (bench/results/suffix_replay_stores_1205.json); level
# with the old store on the bench's 6 prompts (..._avx512_1205_store3.json: 1.456x / 1.455x plain).
DEFAULT_MODEL = dict(method="suffix", num_draft_tokens=3, controller="cost", **_LOOKUP)
OWN_MTP = dict(method="mtp", num_draft_tokens=3, controller="cost", **_LOOKUP)
LOOKUP_ONLY = dict(method="ngram", num_draft_tokens=3, controller="cost", **_LOOKUP)
# the shipped hybrid-demo: lookup + the default model's store of replies, from which it was
# distilled, over its own MTP head. bench/results/spec_controller_hybrid_demo_suffix.json (2 cores,
# AVX-512, batch 1, 6 held-out prompts, 128 tokens, fp32, 2026-12-04): suffix + controller
# 2.03x plain (fixed K=3 2.23x), MTP + controller 1.23x (fixed K=3 1.32x)
HYBRID_DEMO = dict(method="suffix", num_draft_tokens=3, controller="cost")


def declares_mtp(config: dict) -> bool:
    """Whether a checkpoint's config (or its text_config) declares MTP layers."""
    cfg = config.get("text_config", config)
    return any(int(cfg.get(k) or 0) > 0
               for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))


def _is_default_model(path) -> bool:
    from specdeploy.default_model import default_model_path

    if path is None:
        return True
    try:
        return Path(os.fspath(path)).resolve() == Path(default_model_path()).resolve()
    except (OSError, TypeError):
        return False


def _is_shipped(path, name: str) -> bool:
    from specdeploy.checkpoint.shipped import resolve_model_name, shipped_model_path

    if path is None:
        return False
    try:
        return (Path(os.fspath(resolve_model_name(path))).resolve()
                == shipped_model_path(name).resolve())
    except (OSError, TypeError, ValueError):
        return False


def choice_for(model_path, device: str = "cpu") -> dict:
    """The SpecConfig fields "auto" stands for on this target."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.default_model import default_model_path

    config = open_checkpoint(default_model_path() if model_path is None else model_path).config
    if _is_shipped(model_path, "hybrid-demo"):
        return dict(HYBRID_DEMO)
    if declares_mtp(config):
        return dict(OWN_MTP)
    if _is_default_model(model_path):
        return dict(DEFAULT_MODEL) if device == "cpu" else {
            k: v for k, v in DEFAULT_MODEL.items() if k not in _CPU_DRAFTER}
    return dict(LOOKUP_ONLY)


def resolve_auto(spec: SpecConfig | None, model_path, device: str = "cpu") -> SpecConfig | None:
    """`spec` itself unless its method is "auto"; then the measured choice for this target,
    with the fields the caller set (away from SpecConfig's defaults) kept."""
    if spec is None or spec.method != "auto":
        return spec
    defaults = SpecConfig("ngram")  # only its non-method fields are compared
    given = {f.name: getattr(spec, f.name) for f in dataclasses.fields(SpecConfig)
             if f.name not in ("method", "model", "num_speculative_tokens", "prompt_lookup_max")
             and getattr(spec, f.name) != getattr(defaults, f.name)}
    if spec.prompt_lookup_max:
        given["prompt_lookup_max"] = spec.prompt_lookup_max
    return SpecConfig(**{**choice_for(model_path, device), **given})
