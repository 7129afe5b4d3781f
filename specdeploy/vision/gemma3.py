"""Gemma 3 images: preprocessing (`Gemma3ImageProcessor`) and the prompt (`Gemma3Prompt`).

Preprocessing reproduces transformers' `Gemma3ImageProcessorPil`: RGB (alpha on white), a PIL
resize to the fixed `size` (896 x 896 in the releases; `resample` from the config, bilinear by
default), rescale by 1/255, normalize (mean = std = 0.5); pan-and-scan crops are refused.

The prompt: each `<start_of_image>` (boi) becomes `\\n\\n`, boi, `mm_tokens_per_image` image
tokens, `<end_of_image>`, `\\n\\n` (processing_gemma3.py's `full_image_sequence`; expanded here
on token ids, the `\\n\\n` encoded alone). Positions are 1-D. The image tokens of one image form
a bidirectional block: each attends to the whole image (`key_extents`), and a prefill chunk
never ends inside one (`chunk_tokens`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdeploy.vision.image import (
    MAX_INPUT_PIXELS,
    ImageError,
    ProcessedImages,
    _to_rgb,
    load_image,
)
from specdeploy.vision.prompt import MultimodalPrompt

_UNSUPPORTED = ("do_pan_and_scan",)


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    height: int = 896
    width: int = 896
    resample: int = 2  # PIL's BILINEAR
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    max_input_pixels: int = MAX_INPUT_PIXELS

    @property
    def max_pixels(self) -> int:
        return self.height * self.width

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Gemma3ImageProcessor:
        f = Path(path) / "preprocessor_config.json"
        if not f.is_file():
            raise ImageError(f"{path}: no preprocessor_config.json (needed for image inputs)")
        return cls.from_config(json.loads(f.read_text()), f)

    @classmethod
    def from_config(cls, c: dict, f="preprocessor") -> Gemma3ImageProcessor:
        """From preprocessor_config.json's fields (or a GGUF mmproj's: checkpoint/
        gguf_mmproj_gemma3.py)."""
        for k in _UNSUPPORTED:
            if c.get(k):
                raise ImageError(f"{f}: {k}=true is not supported")
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if c.get(k, True) is False:
                raise ImageError(f"{f}: {k}=false is not supported")
        size = c.get("size") or {}
        if set(size) - {"height", "width"}:
            raise ImageError(f"{f}: size {size} is not supported (Gemma 3 takes height/width)")
        kw: dict = {k: int(size[k]) for k in ("height", "width") if k in size}
        if c.get("resample") is not None:
            kw["resample"] = int(c["resample"])
        if "rescale_factor" in c:
            kw["rescale_factor"] = float(c["rescale_factor"])
        for k in ("image_mean", "image_std"):
            if k in c:
                v = c[k] if isinstance(c[k], list) else [c[k]] * 3
                kw[k] = tuple(float(x) for x in v)
        return cls(**kw)

    def with_kwargs(self, kwargs: dict | None) -> Gemma3ImageProcessor:
        if kwargs:
            raise ValueError(f"mm_processor_kwargs: {', '.join(map(repr, kwargs))} not "
                             "supported by Gemma 3 (its images are resized to "
                             f"{self.height} x {self.width})")
        return self

    def preprocess(self, images: list, what: str = "image") -> ProcessedImages:
        """pixel_values [N, 3, height, width] fp32; one grid (1, height, width) per image."""
        out = []
        mean = np.array(self.image_mean, np.float32)
        std = np.array(self.image_std, np.float32)
        for i, src in enumerate(images):
            img = _to_rgb(load_image(src, f"{what} {i}", self.max_input_pixels))
            img = img.resize((self.width, self.height), resample=self.resample)
            x = (np.asarray(img).astype(np.float64) * self.rescale_factor).astype(np.float32)
            x = ((x - mean) / std).transpose(2, 0, 1)
            out.append(torch.from_numpy(np.ascontiguousarray(x)))
        return ProcessedImages(torch.stack(out), [(1, self.height, self.width)] * len(out))


@dataclass(frozen=True)
class Gemma3Tokens:
    boi: int  # <start_of_image>: the placeholder a prompt carries per image
    eoi: int  # <end_of_image>
    image: int  # <image_soft_token>: the rows image features replace
    per_image: int  # mm_tokens_per_image
    newlines: tuple[int, ...]  # "\n\n" encoded


class Gemma3Prompt(MultimodalPrompt):
    """`MultimodalPrompt`'s interface with 1-D positions and bidirectional image blocks."""

    def __init__(self, ids: list[int], pixel_values: torch.Tensor, grids: list, image: int):
        self.ids = ids
        self.pixel_values = pixel_values
        self.grid_thw = grids
        self.delta = 0
        t = torch.tensor(ids, dtype=torch.long)
        mask = t == image
        self.feature_row = torch.where(mask, mask.long().cumsum(0) - 1, -1)
        # per prompt token, the end of its image block (0: text)
        end = torch.zeros(len(ids), dtype=torch.long)
        i = 0
        while i < len(ids):
            if ids[i] != image:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == image:
                j += 1
            end[i:j] = j
            i = j
        self.block_end = end
        self.features: torch.Tensor | None = None

    @classmethod
    def expand(cls, ids: list[int], images: ProcessedImages | None, tokens: Gemma3Tokens,
               what: str = "prompt") -> Gemma3Prompt:
        n = 0 if images is None else len(images.grid_thw)
        slots = sum(t == tokens.boi for t in ids)
        if slots != n:
            raise ImageError(f"{what}: {n} image(s) but {slots} image placeholder token(s) "
                             f"(<start_of_image>, id {tokens.boi})")
        if tokens.image in ids:
            raise ImageError(f"{what}: image tokens (id {tokens.image}) must not be in the "
                             "prompt: each <start_of_image> is expanded to them")
        out: list[int] = []
        nl = list(tokens.newlines)
        for t in ids:
            if t == tokens.boi:
                out += [*nl, t, *([tokens.image] * tokens.per_image), tokens.eoi, *nl]
            else:
                out.append(t)
        return cls(out, images.pixel_values, list(images.grid_thw), tokens.image)

    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n).expand(3, n)

    def key_extents(self, start: int, n: int) -> torch.Tensor | None:
        end = self.block_end[start:start + n]
        if end.shape[0] < n:
            end = torch.cat((end, end.new_zeros(n - end.shape[0])))
        return end

    def chunk_tokens(self, start: int, n: int) -> int:
        cut = start + n
        if cut >= self.num_prompt or cut <= 0:
            return n
        end = int(self.block_end[cut - 1])
        if end <= cut:  # the chunk's last token is text or ends its block
            return n
        first = cut - 1
        while first > start and int(self.block_end[first - 1]) == end:
            first -= 1
        return first - start if first > start else end - start


__all__ = ["Gemma3ImageProcessor", "Gemma3Prompt", "Gemma3Tokens"]
