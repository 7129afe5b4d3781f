"""Qwen3.5(-MoE) vision tower (the multimodal RoPE positions of a prompt: qwen3_5_mrope.py).

The tower (`model.visual.*` in released checkpoints, transformers' `Qwen3_5MoeVisionModel`):
patch embedding (a Conv3d whose kernel equals its stride, i.e. a linear map of each flattened
[C, temporal_patch, patch, patch] patch), a learned square position table resampled bilinearly
(align_corners) to each image's patch grid, 2-D rotary attention over each image's own patches
(bidirectional: images never attend to each other), and a merger that folds every
spatial_merge² neighbouring patches into one token of the text hidden size.

Patches arrive in the processor's order: merge-block major (block row, block col, row in block,
col in block), which is also the order the merger folds. It runs eagerly (deploy/vlm.py): its
shapes change per image, and it runs once per request, so exporting it would buy nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import specdeploy.ops  # noqa: F401  (registers torch.ops.specdeploy.*)

_ops = torch.ops.specdeploy


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    # Qwen3-VL's DeepStack: after these blocks a merger of its own (normed after the merge)
    # projects the patches to the text width; the language model adds them to its first
    # len(...) layers' outputs at the vision tokens (models/qwen3_vl.py)
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, hf: dict) -> VisionConfig:
        v = hf["vision_config"]
        if v.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"Qwen3.5 vision: hidden_act {v['hidden_act']!r} is not supported")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Qwen3.5 vision: rope_type {rope['rope_type']!r} is not supported")
        keys = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                "num_position_embeddings", "in_channels", "patch_size", "temporal_patch_size",
                "spatial_merge_size", "hidden_act")
        deep = tuple(int(i) for i in v.get("deepstack_visual_indexes") or ())
        if any(not 0 <= i < int(v["depth"]) for i in deep):
            raise ValueError(f"vision: deepstack_visual_indexes {list(deep)} are not blocks of a "
                             f"{v['depth']}-block tower")
        return cls(rope_theta=float(rope.get("rope_theta", 10000.0)),
                   deepstack_visual_indexes=deep, **{k: v[k] for k in keys if k in v})


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, (tp, p, p), (tp, p, p))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # kernel == stride over exactly one patch: one output per patch. NOTE: conv3d, not the
        # equal matmul: its fp32 accumulation order is transformers', and the tiny LM amplifies a
        # 1e-6 feature difference ~200x (tests compare logits at 1e-4)
        w = self.proj.weight
        x = patches.to(w.dtype).reshape(-1, *w.shape[1:])
        return self.proj(x).reshape(-1, w.shape[0])


class MLP(nn.Module):
    def __init__(self, d: int, inter: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(d, inter)
        self.linear_fc2 = nn.Linear(inter, d)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # [N, heads, D]
        q = _ops.rope(q[None], cos[None], sin[None])[0]
        k = _ops.rope(k[None], cos[None], sin[None])[0]
        # [1, heads, n, D] per image, explicit scale: the SDPA call transformers makes (same
        # kernel, same rounding)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        out = [F.scaled_dot_product_attention(qi, ki, vi, scale=scale)
               for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        return self.proj(torch.cat(out, 2)[0].transpose(0, 1).reshape(n, -1))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """`post_norm`: the norm runs over each merged group (DeepStack's mergers) rather than over
    each patch before the merge."""

    def __init__(self, cfg: VisionConfig, post_norm: bool = False):
        super().__init__()
        m = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.post_norm = post_norm
        self.norm = nn.LayerNorm(m if post_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(m, m)
        self.linear_fc2 = nn.Linear(m, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, m)) if self.post_norm else self.norm(x).reshape(-1, m)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """`forward(pixel_values[P, patch_dim], grid_thw[n, 3]) -> features[P / merge², W]`, the
    images' tokens laid end to end in input order; W = out_hidden, or with DeepStack mergers
    (1 + len(deepstack_visual_indexes)) * out_hidden: the main merger's features, then each
    DeepStack level's, side by side (so every consumer slices rows as for one feature)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)
        if cfg.deepstack_visual_indexes:
            self.deepstack_merger_list = nn.ModuleList(
                Merger(cfg, post_norm=True) for _ in cfg.deepstack_visual_indexes)

    @property
    def feature_width(self) -> int:
        return self.cfg.out_hidden_size * (1 + len(self.cfg.deepstack_visual_indexes))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = self.patch_embed(pixel_values)
        x = x + torch.cat([self._pos_embed(h, w).repeat(t, 1) for t, h, w in grids]).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # one attention span per frame
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, lengths)
            if i in self.cfg.deepstack_visual_indexes:
                level = self.cfg.deepstack_visual_indexes.index(i)
                deep.append(self.deepstack_merger_list[level](x))
        return torch.cat([self.merger(x), *deep], -1) if deep else self.merger(x)

    def forward_chunked(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]],
                        max_patches: int) -> torch.Tensor:
        """`forward` over groups of at most `max_patches` patches: the same features (a frame
        attends only within itself, and everything else is per patch), with the activations'
        peak bounded by a group rather than by a long video. A frame is the unit (one larger
        than `max_patches` is a group alone)."""
        groups: list[list[tuple[int, int]]] = [[]]
        size = 0
        for t, h, w in grid_thw:
            for _ in range(int(t)):
                if size and size + h * w > max_patches:
                    groups.append([])
                    size = 0
                groups[-1].append((int(h), int(w)))
                size += h * w
        if len(groups) == 1:
            return self(pixel_values, torch.tensor(grid_thw, dtype=torch.long))
        out, row = [], 0
        for frames in groups:
            grids: list[list[int]] = []
            for h, w in frames:  # consecutive frames of one size: one (t, h, w) run
                if grids and grids[-1][1:] == [h, w]:
                    grids[-1][0] += 1
                else:
                    grids.append([1, h, w])
            n = sum(h * w for h, w in frames)
            out.append(self(pixel_values[row:row + n], torch.tensor(grids, dtype=torch.long)))
            row += n
        return torch.cat(out)

    def _merge_order(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] raster → [h*w, ...] in merge-block order (the processor's patch order)."""
        m = self.cfg.spatial_merge_size
        t = t.reshape(h // m, m, w // m, m, *t.shape[2:]).transpose(1, 2)
        return t.reshape(h * w, *t.shape[4:])

    def _pos_embed(self, h: int, w: int) -> torch.Tensor:
        """Bilinear (align_corners) resampling of the side x side table to h x w, as the
        weighted sum of each patch's four table rows (in the weights' dtype)."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        (r0, r1), (wr0, wr1) = _taps(h, side)
        (c0, c1), (wc0, wc1) = _taps(w, side)
        idx = torch.stack([(r[:, None] * side + c[None, :]) for r in (r0, r1) for c in (c0, c1)],
                          -1)  # [h, w, 4]
        wts = torch.stack([a[:, None] * b[None, :] for a in (wr0, wr1) for b in (wc0, wc1)], -1)
        idx, wts = self._merge_order(idx, h, w), self._merge_order(wts, h, w)
        table = self.pos_embed.weight
        return (table[idx.to(table.device)] * wts.to(table)[..., None]).sum(1)

    def _rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [P, head_dim]: the first half of the frequencies rotate by the patch row, the
        second by its column (axial 2-D RoPE), full head width."""
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        half = head_dim // 2
        inv = 1.0 / self.cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                         device=device) / half)
        freqs = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            hw = self._merge_order(torch.stack((rows, cols), -1), h, w).float()  # [h*w, 2]
            f = torch.cat((hw[:, :1] * inv, hw[:, 1:] * inv), -1)
            freqs.append(f.repeat(t, 1))
        emb = torch.cat(freqs).repeat(1, 2)
        return emb.cos(), emb.sin()


def _taps(n: int, side: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                       tuple[torch.Tensor, torch.Tensor]]:
    """For n target points over a side-long axis (align_corners): the two source rows of each
    and their weights."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    lo = src.floor()
    taps = (lo.long().clamp(0, side - 1), (lo.long() + 1).clamp(0, side - 1))
    weights = ((1 - (src - lo)).clamp(min=0), (1 - (lo + 1 - src)).clamp(min=0))
    return taps, weights
