"""Image decoding (Pillow) and the Qwen2-VL-family preprocessing of `preprocessor_config.json`.

`ImageProcessor.preprocess` reproduces transformers' `Qwen2VLImageProcessorPil` (what
`AutoProcessor` picks without torchvision): convert to RGB (alpha composited on white), resize
with PIL bicubic to the nearest multiple of patch·merge whose area is within [min, max] pixels
(`smart_resize`), rescale by 1/255, normalize, then cut into flattened
[C, temporal_patch, patch, patch] patches in merge-block order (a still image repeats itself
over the temporal patch).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

MAX_INPUT_PIXELS = 8192 * 8192  # refuse decoding beyond this (decompression bombs)


class ImageError(ValueError):
    """An image input we cannot use; the message names the image and the problem."""


def load_image(src, what: str = "image", max_pixels: int = MAX_INPUT_PIXELS):
    """A PIL image from a PIL image, bytes, a `data:image/...;base64,` URL, a `file://` URL or a
    local path. Remote URLs are refused (nothing is fetched)."""
    from PIL import Image

    if isinstance(src, Image.Image):
        img = src
    elif isinstance(src, (bytes, bytearray)):
        img = _open(io.BytesIO(bytes(src)), what)
    elif isinstance(src, (str, os.PathLike)):
        s = os.fspath(src)
        if s.startswith(("http://", "https://")):
            raise ImageError(f"{what}: remote URLs are not fetched ({s[:60]}); send the image "
                             "as a data URL (data:image/png;base64,...)")
        if s.startswith("data:"):
            img = _open(io.BytesIO(data_url_bytes(s, "image", what)), what)
        else:
            path = Path(s[len("file://"):] if s.startswith("file://") else s)
            if not path.is_file():
                raise ImageError(f"{what}: no such file {str(path)!r}")
            img = _open(path, what)
    else:
        raise ImageError(f"{what}: expected a PIL image, bytes, a data URL or a path, got "
                         f"{type(src).__name__}")
    w, h = img.size
    if w == 0 or h == 0:
        raise ImageError(f"{what}: zero-sized image ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(f"{what}: too many pixels ({w}x{h} > {max_pixels})")
    try:
        img.load()  # decode now: truncated data fails here, not later in the engine
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{what}: cannot decode the image ({e})") from None
    return img


def data_url_bytes(url: str, kind: str, what: str, error=ImageError) -> bytes:
    """The bytes of a `data:<kind>/<type>;base64,<data>` URL; `error` names what is wrong."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith(f"data:{kind}/") or ";base64" not in head:
        raise error(f"{what}: a data URL must look like data:{kind}/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise error(f"{what}: invalid base64 in the data URL ({e})") from None


def _open(fp, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(fp)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{what}: not an image ({e})") from None


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """The (height, width), multiples of `factor`, nearest to (h, w) with an area in range."""
    if max(h, w) / min(h, w) > 200:
        raise ImageError(f"image: aspect ratio {max(h, w) / min(h, w):.0f} is over 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


@dataclass(frozen=True)
class ProcessedImages:
    pixel_values: torch.Tensor  # [P, C * temporal_patch * patch * patch] fp32
    grid_thw: list[tuple[int, int, int]]  # per image: (t, patch rows, patch cols)


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    max_input_pixels: int = MAX_INPUT_PIXELS

    @classmethod
    def from_config(cls, c: dict) -> ImageProcessor:
        """From a GGUF mmproj's preprocessing fields (checkpoint/gguf_mmproj.py)."""
        keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels")
        kw = {k: int(c[k]) for k in keys if k in c}
        for k in ("image_mean", "image_std"):
            if k in c:
                kw[k] = tuple(float(x) for x in c[k])
        return cls(**kw)

    def with_kwargs(self, kwargs: dict | None) -> ImageProcessor:
        """`mm_processor_kwargs` (vLLM's) applied: the resize's pixel limits (the video keys
        are the video processor's)."""
        if not kwargs:
            return self
        check_processor_kwargs(kwargs)
        out = replace(self, **{k: int(v) for k, v in kwargs.items() if k in IMAGE_KWARGS})
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"mm_processor_kwargs: min_pixels {out.min_pixels} is above "
                             f"max_pixels {out.max_pixels}")
        return out

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ImageProcessor:
        f = Path(path) / "preprocessor_config.json"
        if not f.is_file():
            raise ImageError(f"{path}: no preprocessor_config.json (needed for image inputs)")
        c = json.loads(f.read_text())
        size = c.get("size") or {}
        kw = {k: c[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                                "rescale_factor") if k in c}
        kw["min_pixels"] = int(c.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels)
        kw["max_pixels"] = int(c.get("max_pixels") or size.get("longest_edge") or cls.max_pixels)
        for k in ("image_mean", "image_std"):
            if k in c:
                kw[k] = tuple(float(x) for x in c[k])
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if c.get(k, True) is not True:
                raise ImageError(f"{f}: {k}=false is not supported")
        return cls(**kw)

    def preprocess(self, images: list, what: str = "image") -> ProcessedImages:
        """Decode (see `load_image`) and patchify `images`, in order."""
        from PIL import Image

        patches, grids = [], []
        factor = self.patch_size * self.merge_size
        for i, src in enumerate(images):
            name = f"{what} {i}"
            img = load_image(src, name, self.max_input_pixels)
            img = _to_rgb(img)
            try:
                h, w = smart_resize(img.height, img.width, factor, self.min_pixels,
                                    self.max_pixels)
            except ImageError as e:
                raise ImageError(f"{name}: {str(e).removeprefix('image: ')}") from None
            img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
            x = np.asarray(img).astype(np.float64) * self.rescale_factor
            x = x.astype(np.float32)
            mean, std = np.array(self.image_mean, np.float32), np.array(self.image_std, np.float32)
            x = ((x - mean) / std).transpose(2, 0, 1)  # [C, H, W]
            p, m = self.patch_size, self.merge_size
            gh, gw = h // p, w // p
            t = torch.from_numpy(np.ascontiguousarray(x))
            t = t.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
            t = t[:, :, :, :, :, None].expand(*t.shape[:5], self.temporal_patch_size, p, p)
            patches.append(t.reshape(gh * gw, -1))
            grids.append((1, gh, gw))
        return ProcessedImages(torch.cat(patches), grids)


IMAGE_KWARGS = ("min_pixels", "max_pixels")  # the image resize's pixel limits
# the video processor's (vision/video.py VIDEO_KWARGS): sampling rate and frame bounds
PROCESSOR_KWARGS = IMAGE_KWARGS + ("fps", "min_frames", "max_frames", "do_sample_frames")


def check_processor_kwargs(kwargs) -> None:
    """`mm_processor_kwargs`: a dict of the image resize's pixel limits (positive integers) and
    the video sampling's `fps` (a positive number), `min_frames` / `max_frames` (positive
    integers), `do_sample_frames` (a boolean)."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs: must be a dict, got {type(kwargs).__name__}")
    for k, v in kwargs.items():
        if k not in PROCESSOR_KWARGS:
            raise ValueError(f"mm_processor_kwargs: {k!r} is not supported; supported: "
                             f"{', '.join(PROCESSOR_KWARGS)}")
        if k == "do_sample_frames":
            if not isinstance(v, bool):
                raise ValueError(f"mm_processor_kwargs: {k} must be a boolean, got {v!r}")
        elif k == "fps":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e4:
                raise ValueError(f"mm_processor_kwargs: fps must be a positive number, got "
                                 f"{v!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"mm_processor_kwargs: {k} must be a positive integer, got {v!r}")


def _to_rgb(img):
    from PIL import Image

    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img).convert("RGB")
    return img.convert("RGB")
