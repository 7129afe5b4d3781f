"""Drafter heads shipped with the package, found by target: (loaded model, method) → directory.

A target is recognised by its architecture and sizes plus a fingerprint of its weights (the sum
of the final norm's weights, unquantized in GGUF files too), so a fine-tune or the base model
with the same shapes does not silently pick up heads trained for another model.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from torch import nn


@dataclass(frozen=True)
class ShippedHeads:
    name: str  # directory under specdeploy/data/drafters/
    config: dict  # HF config fields that must match
    norm_sum: float  # sum of model.norm.weight
    methods: tuple[str, ...]


SHIPPED = (
    ShippedHeads(
        name="smollm2-135m-instruct",
        config={"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                "num_hidden_layers": 30, "intermediate_size": 1536},
        norm_sum=1038.332, methods=("eagle3", "mtp", "suffix")),
    # the embedded hybrid-demo was distilled from the default model's own greedy replies, so
    # the default model's store of replies drafts its text too (held-out replay, K=3: 3.10
    # tokens per step against lookup's 2.07; docs/benchmarks.md, "Suffix drafts")
    ShippedHeads(
        name="smollm2-135m-instruct",
        config={"architectures": ["NemotronHForCausalLM"], "vocab_size": 49152,
                "hidden_size": 256, "num_hidden_layers": 8},
        norm_sum=296.28125, methods=("suffix",)),
)


def drafters_dir() -> Path:
    return Path(str(resources.files("specdeploy").joinpath("data", "drafters")))


def _norm_sum(model: nn.Module) -> float | None:
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None) or getattr(inner, "norm_f", None)  # Llama / NemotronH
    w = getattr(norm, "weight", None)
    return None if w is None or w.is_meta else float(w.detach().double().sum())


def shipped_drafter(model: nn.Module, method: str) -> Path | None:
    """The shipped head directory for this target and method, or None."""
    hf = getattr(model, "hf_config", None) or {}
    hf = hf.get("text_config", hf)
    for entry in SHIPPED:
        if method not in entry.methods:
            continue
        if any(hf.get(k) != v for k, v in entry.config.items()):
            continue
        s = _norm_sum(model)
        if s is None or abs(s - entry.norm_sum) > 1e-3 * abs(entry.norm_sum):
            continue
        path = drafters_dir() / entry.name / method
        if (path / "config.json").is_file():
            return path
    return None
