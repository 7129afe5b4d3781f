"""Video inputs: the Qwen3-VL-family video preprocessing of `video_preprocessor_config.json`.

`VideoProcessor.preprocess` reproduces transformers' `Qwen3VLVideoProcessor` (with torchvision,
what vLLM runs): frames sampled uniformly at `fps` per second of the source (at least
`min_frames`, at most `max_frames`), every frame resized to one size, the nearest multiple of
patch·merge whose total over the frames is within [min, max] pixels (`smart_resize` with the
temporal patch), torch's antialiased bicubic resize of uint8 frames, then normalized and cut into
[C, temporal_patch, patch, patch] patches, merge blocks in order, temporal_patch frames per grid
step (the last frame repeated to fill the last step). Each step's timestamp (the mean of its
first and last frames' times) becomes the text `<t.t seconds>` before that step's tokens
(vision/prompt.py), as the Qwen3-VL processor writes it.

A video is a video file (path, file:// or data URL, bytes; decoded with PyAV) or its frames: a
uint8 array [frames, height, width, 3] or a list of images, optionally as `(frames, metadata)`
with vLLM's / transformers' metadata keys `fps` (the frames' rate) and `frames_indices`. Frames
with an `fps` but no `frames_indices` are the whole video and get sampled like a file; otherwise
they are used as given (already sampled), at `fps` (default: the processor's sampling rate).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdeploy.vision.image import MAX_INPUT_PIXELS, ImageProcessor, _to_rgb, load_image
from specdeploy.vision.video_decode import VideoError, decode_video, is_video_file

# the released Qwen3.5 video_preprocessor_config.json (also what GGUF mmproj files imply)
RELEASED = {"min_pixels": 4096, "max_pixels": 25165824, "fps": 2.0, "min_frames": 4,
            "max_frames": 768}
# transformers' Qwen3VLVideoProcessor class defaults (a checkpoint without the file)
CLASS_DEFAULTS = {"min_pixels": 128 * 32 * 32, "max_pixels": 32 * 32 * 768, "fps": 2.0,
                  "min_frames": 4, "max_frames": 768}
VIDEO_KWARGS = ("fps", "min_frames", "max_frames", "do_sample_frames")


def smart_resize(frames: int, h: int, w: int, temporal: int, factor: int, min_pixels: int,
                 max_pixels: int, what: str = "video") -> tuple[int, int]:
    """The frames' (height, width): multiples of `factor` nearest to (h, w) with the total
    over the frames (rounded to whole temporal patches) in [min_pixels, max_pixels]."""
    if frames < temporal:
        raise VideoError(f"{what}: {frames} frame(s); a video needs at least {temporal} (send a "
                         "single frame as an image)")
    if h < factor or w < factor:
        scale = max(factor / h, factor / w)
        h, w = int(h * scale), int(w * scale)
    if max(h, w) / min(h, w) > 200:
        raise VideoError(f"{what}: aspect ratio {max(h, w) / min(h, w):.0f} is over 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    tb = round(frames / temporal) * temporal
    if tb * hb * wb > max_pixels:
        beta = math.sqrt(frames * h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif tb * hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (frames * h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def step_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frames' times (the last
    index repeated to fill the last patch)."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    t = [i / fps for i in idx]
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: torch.Tensor  # [t * h * w, C * temporal_patch * patch * patch] fp32
    grid_thw: tuple[int, int, int]  # (temporal patches, patch rows, patch cols)
    timestamps: list[float]  # seconds, one per temporal patch


@dataclass(frozen=True)
class VideoProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = CLASS_DEFAULTS["min_pixels"]
    max_pixels: int = CLASS_DEFAULTS["max_pixels"]
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    max_input_pixels: int = MAX_INPUT_PIXELS  # per frame

    @classmethod
    def like(cls, image: ImageProcessor, values: dict) -> VideoProcessor:
        """The video processor sharing the image processor's patching and normalization."""
        return cls(patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size,
                   merge_size=image.merge_size, image_mean=image.image_mean,
                   image_std=image.image_std, rescale_factor=image.rescale_factor,
                   max_input_pixels=image.max_input_pixels, **values)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, image: ImageProcessor) -> VideoProcessor:
        """From `video_preprocessor_config.json`; without it, transformers' class defaults
        around the image processor's patching."""
        f = Path(path) / "video_preprocessor_config.json"
        if not f.is_file():
            return cls.like(image, CLASS_DEFAULTS)
        c = json.loads(f.read_text())
        size = c.get("size") or {}
        kw: dict = {k: c[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                                      "rescale_factor", "min_frames", "max_frames") if k in c}
        kw["min_pixels"] = int(size.get("shortest_edge") or c.get("min_pixels")
                               or CLASS_DEFAULTS["min_pixels"])
        kw["max_pixels"] = int(size.get("longest_edge") or c.get("max_pixels")
                               or CLASS_DEFAULTS["max_pixels"])
        if c.get("fps") is not None:
            kw["fps"] = float(c["fps"])
        if "do_sample_frames" in c:
            kw["do_sample_frames"] = bool(c["do_sample_frames"])
        for k in ("image_mean", "image_std"):
            if k in c:
                kw[k] = tuple(float(x) for x in c[k])
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if c.get(k, True) is not True:
                raise VideoError(f"{f}: {k}=false is not supported")
        if c.get("cap_pixels_per_frame"):
            raise VideoError(f"{f}: cap_pixels_per_frame=true is not supported")
        return cls(max_input_pixels=image.max_input_pixels, **kw)

    def with_kwargs(self, kwargs: dict | None) -> VideoProcessor:
        """`mm_processor_kwargs`' video keys (fps, min_frames, max_frames, do_sample_frames)."""
        kw = {k: v for k, v in (kwargs or {}).items() if k in VIDEO_KWARGS}
        if not kw:
            return self
        if "fps" in kw:
            kw["fps"] = float(kw["fps"])
        out = replace(self, **kw)
        if out.min_frames > out.max_frames:
            raise ValueError(f"mm_processor_kwargs: min_frames {out.min_frames} is above "
                             f"max_frames {out.max_frames}")
        return out

    def sample(self, total: int, fps: float | None) -> list[int]:
        """transformers' `sample_frames`: `self.fps` frames a second of the source (24 when
        the source does not say), within [min_frames, max_frames] and the frames there are,
        spread evenly from the first frame to the last."""
        n = int(total / (fps or 24.0) * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def _every_frame(self, what: str):
        def pick(total: int, fps) -> list[int]:
            if total > self.max_frames:
                raise VideoError(f"{what}: {total} frames and do_sample_frames is off; at most "
                                 f"max_frames ({self.max_frames}) are taken whole")
            return list(range(total))
        return pick

    def preprocess(self, videos: list, what: str = "video") -> list[ProcessedVideo]:
        return [self.preprocess_one(v, f"{what} {i}") for i, v in enumerate(videos)]

    def preprocess_one(self, src, what: str = "video") -> ProcessedVideo:
        frames, fps, indices = self._frames(src, what)  # [T, 3, H, W] uint8
        return self.patchify(self.resize(frames, what), indices, fps)

    def resize(self, frames: torch.Tensor, what: str = "video") -> torch.Tensor:
        """[T, 3, H, W] uint8 → the size `smart_resize` picks (torchvision's resize of uint8
        frames on the CPU: antialiased bicubic, uint8 out)."""
        t, _, h, w = frames.shape
        rh, rw = smart_resize(t, h, w, self.temporal_patch_size,
                              self.patch_size * self.merge_size, self.min_pixels,
                              self.max_pixels, what)
        if (rh, rw) == (h, w):
            return frames
        return F.interpolate(frames, size=[rh, rw], mode="bicubic", align_corners=False,
                             antialias=True)

    def patchify(self, frames: torch.Tensor, indices: list[int], fps: float) -> ProcessedVideo:
        """Resized [T, 3, h, w] uint8 frames → normalized patches, grid and timestamps."""
        scale = 1.0 / self.rescale_factor  # the rescale folded into the normalization
        mean = torch.tensor(self.image_mean, dtype=torch.float32).mul(scale).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).mul(scale).view(1, 3, 1, 1)
        x = (frames.float() - mean) / std
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -x.shape[0] % tp:
            x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)))
        gt, gh, gw = x.shape[0] // tp, x.shape[2] // p, x.shape[3] // p
        x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return ProcessedVideo(x.reshape(gt * gh * gw, -1).contiguous(), (gt, gh, gw),
                              step_timestamps(indices, fps, tp))

    def _frames(self, src, what: str) -> tuple[torch.Tensor, float, list[int]]:
        """([T, 3, H, W] uint8 frames, their rate, their indices in the source)."""
        if is_video_file(src):
            pick = self.sample if self.do_sample_frames else self._every_frame(what)
            arr, fps, indices = decode_video(src, what, pick, self.max_input_pixels)
            return _chw(arr), fps or 24.0, indices
        meta: dict = {}
        if isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], dict):
            src, meta = src
        arr = frames_array(src, what, self.max_input_pixels)
        t = arr.shape[0]
        fps = meta.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                                or not fps > 0):
            raise VideoError(f"{what}: metadata fps must be a positive number, got {fps!r}")
        indices = meta.get("frames_indices")
        if indices is not None:
            indices = [int(i) for i in indices]
            if len(indices) != t:
                raise VideoError(f"{what}: {len(indices)} frames_indices for {t} frames")
        elif fps is not None and self.do_sample_frames:  # the whole video: sample it
            indices = self.sample(t, float(fps))
            arr = arr[indices]
        else:
            indices = list(range(t))
        return _chw(arr), float(fps or self.fps), indices


def frames_array(src, what: str, max_frame_pixels: int) -> np.ndarray:
    """Decoded frames → [T, H, W, 3] uint8 (an array, a tensor, or a list of images/arrays)."""
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    if isinstance(src, np.ndarray):
        arr = src
    elif isinstance(src, (list, tuple)) and src:
        arr = [_frame(f, f"{what} frame {i}") for i, f in enumerate(src)]
        if len({a.shape for a in arr}) != 1:
            raise VideoError(f"{what}: frames of different sizes "
                             f"({sorted({a.shape for a in arr})[:2]})")
        arr = np.stack(arr)
    else:
        raise VideoError(f"{what}: expected a video file (path, file:// or data URL, bytes) or "
                         "its frames (uint8 [frames, height, width, 3], or a list of images), got "
                         f"{type(src).__name__}")
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise VideoError(f"{what}: frames must be uint8 [frames, height, width, 3], got "
                         f"{arr.dtype} {list(arr.shape)}")
    t, h, w, _ = arr.shape
    if t == 0 or h == 0 or w == 0:
        raise VideoError(f"{what}: empty video {list(arr.shape)}")
    if h * w > max_frame_pixels:
        raise VideoError(f"{what}: frames too large ({w}x{h} > {max_frame_pixels} pixels)")
    return arr


def _frame(f, what: str) -> np.ndarray:
    """One frame: an image (PIL, or a path / URL / bytes `load_image` reads) or an array."""
    if isinstance(f, (np.ndarray, torch.Tensor)):
        return np.asarray(f)
    return np.asarray(_to_rgb(load_image(f, what)))


def _chw(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2).contiguous()
