"""Test videos: random frames, and files written with PyAV (lossless FFV1 in Matroska, whose
frames decode back bit for bit; MPEG-4 in MP4, whose header counts its frames)."""
from __future__ import annotations

import io

import numpy as np


def rand_frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """[t, h, w, 3] uint8 frames that change over time (a moving gradient + noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for i in range(t):
        base = (xx * 5 + yy * 3 + i * 17) % 256
        noise = rng.integers(0, 40, (h, w, 3))
        out.append(((base[..., None] + noise + np.array([0, 60, 120])) % 256).astype(np.uint8))
    return np.stack(out)


def video_bytes(frames: np.ndarray, fps: int, lossless: bool = True) -> bytes:
    import av

    buf = io.BytesIO()
    fmt, codec, pix = ("matroska", "ffv1", "bgr0") if lossless else ("mp4", "mpeg4", "yuv420p")
    c = av.open(buf, "w", format=fmt)
    s = c.add_stream(codec, rate=fps)
    s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix
    for f in frames:
        for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return buf.getvalue()
