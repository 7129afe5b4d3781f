"""Gemma 3's vision tower (SigLIP) and multimodal projector (`Gemma3ForConditionalGeneration`'s
`vision_tower.vision_model.*` and `multi_modal_projector.*`), run eagerly by deploy/vlm.py.

SigLIP: a 14 x 14 patch convolution, learned position embeddings (one per patch of the fixed
`image_size` grid: no resampling), pre-LN encoder layers (LayerNorm, full attention with biases,
LayerNorm, GELU-tanh MLP), `post_layernorm`. The projector average-pools the P x P patch grid to
`mm_tokens_per_image` tokens (a sqrt(N)-side grid, kernel = stride = P / side), applies the
Gemma RMSNorm `mm_soft_emb_norm` (x / rms(x) * (1 + w), in fp32) and multiplies by
`mm_input_projection_weight` [vision hidden, text hidden]. Names and math follow transformers'
`modeling_siglip.py` / `modeling_gemma3.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 896
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    mm_tokens_per_image: int = 256
    text_hidden_size: int = 2560
    spatial_merge_size: int = 1  # (deploy/vlm.py reads it: no merge here)

    @classmethod
    def from_hf(cls, hf: dict) -> VisionConfig:
        v = hf["vision_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 vision: hidden_act {act!r} is not supported")
        if v.get("vision_use_head"):
            raise ValueError("Gemma 3 vision: vision_use_head=true is not supported (the "
                             "releases use the encoder's patch states)")
        text = hf.get("text_config") or {}
        cfg = cls(hidden_size=int(v.get("hidden_size", 1152)),
                  intermediate_size=int(v.get("intermediate_size", 4304)),
                  num_layers=int(v.get("num_hidden_layers", 27)),
                  num_heads=int(v.get("num_attention_heads", 16)),
                  image_size=int(v.get("image_size", 896)),
                  patch_size=int(v.get("patch_size", 14)),
                  num_channels=int(v.get("num_channels", 3)),
                  layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
                  mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
                  text_hidden_size=int(text.get("hidden_size", 2560)))
        side = math.isqrt(cfg.mm_tokens_per_image)
        grid = cfg.image_size // cfg.patch_size
        if side * side != cfg.mm_tokens_per_image or grid % side or cfg.image_size % cfg.patch_size:
            raise ValueError(f"Gemma 3 vision: mm_tokens_per_image {cfg.mm_tokens_per_image} "
                             f"does not pool the {grid} x {grid} patch grid (image_size "
                             f"{cfg.image_size}, patch_size {cfg.patch_size}) evenly")
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"Gemma 3 vision: hidden_size {cfg.hidden_size} is not a multiple "
                             f"of num_attention_heads {cfg.num_heads}")
        return cfg

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.grid ** 2, d)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(p):
            return p(x).view(b, t, self.num_heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj),
                                           heads(self.v_proj))
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionTransformer(nn.Module):
    """`vision_tower.vision_model`: pixels [N, C, S, S] -> patch states [N, P*P, D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class GemmaRMSNorm(nn.Module):
    """Stored as transformers stores it: `w` (applied as 1 + w, in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class Projector(nn.Module):
    """`multi_modal_projector`: patch states [N, P*P, D] -> image tokens [N, side^2, H]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.grid = cfg.grid
        self.kernel = cfg.grid // math.isqrt(cfg.mm_tokens_per_image)
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(cfg.hidden_size, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.grid, self.grid)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class VisionModel(nn.Module):
    """Tower + projector: `forward(pixels [N, C, S, S]) -> [N * mm_tokens_per_image, H]`, the
    image tokens' embeddings in prompt order (deploy/vlm.py's `visual`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = VisionTransformer(cfg)
        self.multi_modal_projector = Projector(cfg)

    @property
    def feature_width(self) -> int:
        return self.cfg.text_hidden_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        feats = self.multi_modal_projector(self.vision_tower.vision_model(pixels))
        return feats.reshape(-1, feats.shape[-1])

    def forward_chunked(self, pixels: torch.Tensor, grid_thw, max_patches: int) -> torch.Tensor:
        """`forward` a few images at a time (at most `max_patches` patches a call, at least
        one image); `grid_thw` is unused (every image is the same size)."""
        per = max(1, max_patches // self.cfg.grid ** 2)
        return torch.cat([self(pixels[i:i + per]) for i in range(0, pixels.shape[0], per)])


TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
                  "vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def checkpoint_names(reader, names: list[str]) -> dict[str, str]:
    """Our tensor name -> the checkpoint's: the released layout (`vision_tower.vision_model.*`,
    `multi_modal_projector.*`), transformers v5's `save_pretrained` (`vision_tower.*`) or its
    in-memory names (`model.` in front)."""
    out = {}
    for name in names:
        group, rest = name.split(".", 1)
        if group == "vision_tower":
            rest = rest.removeprefix("vision_model.")
            prefixes = TOWER_PREFIXES
        else:
            rest = rest.removeprefix("multi_modal_projector.")
            prefixes = PROJECTOR_PREFIXES
        found = next((p + rest for p in prefixes if p + rest in reader), None)
        out[name] = found or prefixes[0] + rest
    return out


def load_vision(reader, dtype: torch.dtype) -> VisionModel:
    """The tower and projector of a `Gemma3ForConditionalGeneration` checkpoint; raises naming
    the missing tensors."""
    from specdeploy.checkpoint import CheckpointError

    cfg = VisionConfig.from_hf(reader.config)
    with torch.device("meta"):
        model = VisionModel(cfg)
    names = checkpoint_names(reader, list(model.state_dict()))
    missing = [src for src in names.values() if src not in reader]
    if missing:
        raise CheckpointError(f"{reader.path}: Gemma 3 vision tensors are missing: "
                              f"{', '.join(missing[:8])}")
    model.load_state_dict({n: reader.get(src).to(dtype) for n, src in names.items()},
                          assign=True)
    return model.eval().requires_grad_(False)


__all__ = ["VisionConfig", "VisionModel", "checkpoint_names", "load_vision"]
