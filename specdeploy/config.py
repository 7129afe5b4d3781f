"""Frozen, validated configuration dataclasses of the public API."""
from __future__ import annotations

import os
from dataclasses import dataclass

SPEC_METHODS = ("mtp", "eagle3", "ngram", "suffix", "auto")  # auto: spec_auto.py picks one
DRAFT_DTYPES = (None, "float32", "bfloat16", "float16")
DRAFT_QUANTIZE = (None, "int8", "q8_0", "auto")  # auto: deploy/build_policy.py draft_quantize_auto
CONTROLLERS = ("off", "cost")  # SpecConfig.controller (engine/spec_control.py)
# vLLM's `speculative_config.method` names → ours. Every "<family>_mtp" of vLLM is the
# checkpoint's own MTP head, which our "mtp" deploys for any family that ships one.
VLLM_METHODS = {"eagle3": "eagle3", "ngram": "ngram", "[ngram]": "ngram", "mtp": "mtp",
                "deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp",
                "glm4_moe_mtp": "mtp", "mimo_mtp": "mtp", "ernie_mtp": "mtp"}
# speculative_config keys we read (vLLM's names and ours); any other key is refused by name
VLLM_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                  "prompt_lookup_min", "suffix_decoding_max_cached_requests",
                  "suffix_decoding_min_token_prob")
SHIPPED_STORE = "shipped"  # SpecConfig.suffix_store: the corpus shipped for this target, if any


def spec_method(name: str) -> str:
    """Our method for one of ours or of vLLM's names (refusing the rest by name)."""
    if name in SPEC_METHODS:
        return name
    if isinstance(name, str) and (name in VLLM_METHODS or name.endswith("_mtp")):
        return VLLM_METHODS.get(name, "mtp")
    raise ValueError(f"method: must be one of {', '.join(SPEC_METHODS)} (or vLLM's "
                     f"{', '.join(k for k in VLLM_METHODS if k not in SPEC_METHODS)}), "
                     f"got {name!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `method` drafts `num_draft_tokens` (K) tokens per step.

    `method="auto"` deploys the fastest lossless configuration measured for this target
    (spec_auto.py): the checkpoint's own MTP head where it has one, the default model's
    benchmarked setting, else n-gram lookup; fields given explicitly override its choice.

    `method="ngram"` drafts by n-gram lookup alone (vLLM's "ngram"), with no drafter model: any
    target, nothing to train; a sequence whose tail did not occur before decodes plainly that
    step. It turns lookup on (`prompt_lookup_max` 4 unless given).

    `method="suffix"` (vLLM's "suffix") is n-gram lookup plus a store of replies
    (engine/suffix_store.py): where the sequence's own text has no earlier occurrence of its
    tail, the store's replies draft what most often followed it, while the chain's estimated
    probability stays at or above `suffix_decoding_min_token_prob` (vLLM's name and default,
    0.1). The store holds the replies of this deployment's last
    `suffix_decoding_max_cached_requests` finished requests and, with `suffix_store`, a corpus
    loaded at deploy time: a directory written by `specdeploy suffix-store`, or "shipped" (the
    method's default): the one shipped for this target, if any (the default model has one: its
    own replies to training-split prompts). `suffix_store` with another method adds the store
    behind that method's lookup.

    vLLM's spellings work too: `model=` is `draft_model`, `num_speculative_tokens=` is
    `num_draft_tokens`, and its method names ("deepseek_mtp", ...) map to ours;
    `SpecConfig.from_dict` reads a vLLM `speculative_config` dict.
    `draft_model` is the EAGLE-3 drafter checkpoint (MTP heads come from the target checkpoint);
    `capture_layers` overrides which target layers feed an EAGLE-3 drafter.
    `prompt_lookup_max` > 0 adds n-gram lookup drafts (vLLM's names): when the sequence's last
    n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred before, the K
    tokens that followed are drafted instead of the drafter's (engine/lookup.py).
    `prompt_lookup_num_tokens` (default K) caps how many tokens a lookup match drafts: a
    sequence's lookup runs start at K and double after each step that accepted all of its
    drafts (a loop that held tends to hold on; lookup drafts cost no drafter steps), back to K
    after a rejection. A verify step then carries up to max(K, it) drafts.
    `draft_dtype` / `draft_quantize` run the drafter at another precision than the target (None:
    the target's), e.g. "bfloat16" + "int8" on a CPU, where a draft step is bound by reading the
    drafter's weights. `draft_quantize="auto"` (the default) is "q8_0" on an fp32 CPU
    deployment with the fast kernels, a GGUF target or not (the drafter's linears on the
    integer-dot kernels: an EAGLE-3 draft forward of the default model reads 4x fewer bytes),
    else None. Lossless whatever they are: drafts are verified by the target in its own
    precision, so only how many are accepted can change.
    `draft_min_prob` > 0 lets the drafter draft fewer than K tokens: a sequence's chain stops at
    the first draft whose chain probability (the product of the drafter's top probabilities)
    is below it. Verify rows and draft steps that would rarely be accepted are skipped; with
    lookup on, K can then be set for lookup drafts (long runs) while the drafter stops early.
    `controller="cost"` (the default) chooses per step and per sequence how many of the K
    drafts to draft and verify, 0 included, from this machine's measured step costs (timed when
    the engine is built) and the sequence's recent acceptance (engine/spec_control.py), so that
    speculation is not slower than plain decoding. "off": fixed K, every step verifies K drafts,
    which can be slower than no speculation.
    `disable_by_batch_size` (vLLM's name): speculation is off in a step where more than this
    many sequences are running, prefilling ones included (no lookups, no store, no drafter
    forwards; a drafter's catch-up is deferred to its next drafting step). None (the default):
    with the cost controller, off from the calibrated batch size (8 or more) at which one draft
    for every sequence pays only at an acceptance of `OFF_BREAK_EVEN` or more, i.e. where a
    step is compute-bound (engine/spec_calibrate.py `off_batches`); with `controller="off"`,
    never.
    """

    method: str
    num_draft_tokens: int = 3
    draft_model: str | None = None
    capture_layers: tuple[int, ...] | None = None
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_num_tokens: int | None = None
    draft_dtype: str | None = None
    draft_quantize: str | None = "auto"
    draft_min_prob: float = 0.0
    controller: str = "cost"
    disable_by_batch_size: int | None = None
    suffix_store: str | None = None
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None  # vLLM's name for draft_model (folded into it)
    num_speculative_tokens: int | None = None  # vLLM's name for num_draft_tokens (folded)

    def __post_init__(self):
        object.__setattr__(self, "method", spec_method(self.method))
        for alias, name in (("model", "draft_model"), ("num_speculative_tokens",
                                                        "num_draft_tokens")):
            v = getattr(self, alias)
            if v is None:
                continue
            ours = getattr(self, name)
            default = 3 if name == "num_draft_tokens" else None
            if ours != default and ours != v:
                raise ValueError(f"{alias}: {v!r} conflicts with {name}={ours!r} (the same "
                                 "setting; give one)")
            object.__setattr__(self, name, str(v) if alias == "model" else v)
            object.__setattr__(self, alias, None)
        if self.method == "auto" and self.draft_model is not None:
            raise ValueError("draft_model: method='auto' picks the drafter itself; give a "
                             "method with a draft_model")
        if self.method in ("ngram", "suffix"):
            if self.draft_model is not None:
                raise ValueError(f"draft_model: method={self.method!r} drafts by lookup and "
                                 "takes no drafter")
            if self.prompt_lookup_max == 0:
                object.__setattr__(self, "prompt_lookup_max", 4)
        if self.method == "suffix" and self.suffix_store is None:
            object.__setattr__(self, "suffix_store", SHIPPED_STORE)
        if self.suffix_store is not None:
            if not isinstance(self.suffix_store, str | os.PathLike) or not str(self.suffix_store):
                raise ValueError(f"suffix_store: must be a directory or {SHIPPED_STORE!r}, "
                                 f"got {self.suffix_store!r}")
            object.__setattr__(self, "suffix_store", os.fspath(self.suffix_store))
            if self.prompt_lookup_max == 0:  # the store is drafted from behind lookup
                object.__setattr__(self, "prompt_lookup_max", 4)
        m = self.suffix_decoding_max_cached_requests
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests: must be a non-negative "
                             f"integer, got {m!r}")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise ValueError(f"suffix_decoding_min_token_prob: must be a number in [0, 1], "
                             f"got {p!r}")
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_draft_tokens: must be an integer in 1..16, got {k!r}")
        lmax, lmin = self.prompt_lookup_max, self.prompt_lookup_min
        for name, v in (("prompt_lookup_max", lmax), ("prompt_lookup_min", lmin)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {v!r}")
        if lmax and not 1 <= lmin <= lmax:
            raise ValueError(f"prompt_lookup_min: must be in 1..prompt_lookup_max ({lmax}), "
                             f"got {lmin!r}")
        n = self.prompt_lookup_num_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16):
            raise ValueError(f"prompt_lookup_num_tokens: must be None or an integer in 1..16, "
                             f"got {n!r}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype: must be None or one of {', '.join(DRAFT_DTYPES[1:])}, "
                             f"got {self.draft_dtype!r}")
        if self.draft_quantize not in DRAFT_QUANTIZE:
            raise ValueError(f"draft_quantize: must be None, 'int8', 'q8_0' or 'auto', got "
                             f"{self.draft_quantize!r}")
        p = self.draft_min_prob
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p < 1.0:
            raise ValueError(f"draft_min_prob: must be a number in [0, 1), got {p!r}")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"disable_by_batch_size: must be None or an integer >= 1, "
                             f"got {n!r}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller: must be one of {', '.join(CONTROLLERS)}, "
                             f"got {self.controller!r}")
        if self.capture_layers is not None:
            layers = tuple(self.capture_layers)
            if not layers or any(not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"capture_layers: must be non-negative layer indices, "
                                 f"got {self.capture_layers!r}")
            object.__setattr__(self, "capture_layers", layers)
        if self.draft_model is not None:
            object.__setattr__(self, "draft_model", str(self.draft_model))

    @classmethod
    def from_dict(cls, d: dict) -> SpecConfig:
        """From a dict of our field names or vLLM's `speculative_config` keys (`--speculative-
        config '{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}'`)."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {d!r}")
        import dataclasses

        known = {f.name for f in dataclasses.fields(cls)} | set(VLLM_SPEC_KEYS)
        unknown = sorted(k for k in d if k not in known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))})")
        if "method" not in d:
            raise ValueError("speculative_config: needs `method`")
        return cls(**d)

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts one verify step carries (sizes recurrent spec state)."""
        lookup = (self.prompt_lookup_num_tokens or 0) if self.prompt_lookup_max else 0
        return max(self.num_draft_tokens, lookup)

    @property
    def uses_store(self) -> bool:
        """Drafts from a suffix store (engine/suffix_store.py) behind lookup."""
        return self.suffix_store is not None or self.method == "suffix"
