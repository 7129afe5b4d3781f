"""The Llama family's configuration from a Hugging Face config.json (models/llama.py): sizes,
Qwen2 / Qwen3's q/k/v biases and q/k norms, and each layer's sliding window (Mistral, Qwen2 /
Qwen3, `layer_types`) and RoPE-less layers (SmolLM3), as transformers reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdeploy.models.layers import RopeConfig


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False  # q/k/v biases without an o_proj one (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q / k head before RoPE (Qwen3)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    windows: tuple[int, ...] = ()  # per layer: its sliding window in tokens, 0 = full (or none)
    nope: tuple[bool, ...] = ()  # per layer: no RoPE (SmolLM3's every 4th layer)

    def window(self, layer: int) -> int:
        return self.windows[layer] if layer < len(self.windows) else 0

    def rope_at(self, layer: int) -> bool:
        return not (self.nope[layer] if layer < len(self.nope) else False)

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        hf = hf.get("text_config") or hf
        heads = int(hf["num_attention_heads"])
        kind = hf.get("model_type", "llama")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=kind == "qwen2",
            qk_norm=kind == "qwen3",
            hidden_act=hf.get("hidden_act", "silu"),
            # transformers' default for Llama is untied
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            windows=_windows(hf, kind),
            nope=_nope(hf, kind),
        )


def _nope(hf: dict, kind: str) -> tuple[bool, ...]:
    """SmolLM3: `no_rope_layers[i]` 1 = RoPE, 0 = none; absent: none at every
    `no_rope_layer_interval`-th layer (transformers' default, and llama.cpp's fixed 4)."""
    if kind != "smollm3":
        return ()
    n = int(hf["num_hidden_layers"])
    flags = hf.get("no_rope_layers")
    if flags is None:
        step = int(hf.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % step != 0) for i in range(n)]
    if len(flags) < n:
        raise ValueError(f"smollm3: no_rope_layers has {len(flags)} entries for {n} layers")
    return tuple(not bool(f) for f in flags[:n])


def _windows(hf: dict, kind: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads the config:
    `layer_types` where given; Mistral: every layer, when `sliding_window` is set; Qwen2 /
    Qwen3: layers from `max_window_layers` on, when `use_sliding_window`."""
    n, window = int(hf["num_hidden_layers"]), hf.get("sliding_window")
    types = hf.get("layer_types")
    if kind == "smollm3" and not hf.get("use_sliding_window"):
        return ()  # (its layer_types may name sliding layers transformers does not window)
    if types:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"{kind}: layer_types {sorted(unknown)} are not supported")
        if "sliding_attention" in types and not window:
            raise ValueError(f"{kind}: sliding_attention layers but no sliding_window")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types[:n])
    if kind == "mistral" and window:
        return (int(window),) * n
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window:
        start = int(hf.get("max_window_layers", n) or 0)
        return tuple(int(window) if i >= start else 0 for i in range(n))
    return ()
