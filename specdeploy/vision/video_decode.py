"""Video files → RGB frames (PyAV, optional: `pip install av` or `specdeploy[video]`).

A file is read from bytes, a `data:video/...;base64,` URL, a `file://` URL or a local path
(remote URLs are refused: nothing is fetched). Only the frames `pick(total, fps)` chooses are
converted to RGB, so a long video costs decoding time but not memory.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from specdeploy.vision.image import ImageError, data_url_bytes


class VideoError(ImageError):
    """A video input we cannot use; the message names the video and the problem."""


def is_video_file(src) -> bool:
    """Whether `src` names a video file (path, URL or bytes) rather than decoded frames."""
    return isinstance(src, (str, os.PathLike, bytes, bytearray))


def _source(src, what: str):
    """A path or a file-like object for PyAV."""
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(bytes(src))
    s = os.fspath(src)
    if s.startswith(("http://", "https://")):
        raise VideoError(f"{what}: remote URLs are not fetched ({s[:60]}); send the video as a "
                         "data URL (data:video/mp4;base64,...)")
    if s.startswith("data:"):
        return io.BytesIO(data_url_bytes(s, "video", what, VideoError))
    path = Path(s[len("file://"):] if s.startswith("file://") else s)
    if not path.is_file():
        raise VideoError(f"{what}: no such file {str(path)!r}")
    return str(path)


def _av(what: str):
    try:
        import av
    except ImportError:
        raise VideoError(f"{what}: decoding a video file needs PyAV (pip install av, or "
                         "specdeploy[video]); or pass the decoded frames (a uint8 array "
                         "[frames, height, width, 3] or a list of images)") from None
    return av


def decode_video(src, what: str, pick, max_frame_pixels: int
                 ) -> tuple[np.ndarray, float | None, list[int]]:
    """(frames [n, H, W, 3] uint8, the file's frame rate or None, their frame indices) of the
    frames `pick(total_frames, fps) -> indices` chooses."""
    av = _av(what)
    source = _source(src, what)
    errors = (av.FFmpegError, ValueError, OSError)

    def open_stream():
        if isinstance(source, io.BytesIO):
            source.seek(0)
        try:
            container = av.open(source)
        except errors as e:
            raise VideoError(f"{what}: not a video ({e})") from None
        if not container.streams.video:
            container.close()
            raise VideoError(f"{what}: the file has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame and slice threads in the codec
        return container, stream

    container, stream = open_stream()
    try:
        w, h = stream.codec_context.width, stream.codec_context.height
        if w * h > max_frame_pixels:
            raise VideoError(f"{what}: frames too large ({w}x{h} > {max_frame_pixels} pixels)")
        fps = float(stream.average_rate) if stream.average_rate else None
        total = int(stream.frames or 0)
        if total <= 0:  # the container does not say: count them (a first decoding pass)
            try:
                total = sum(1 for _ in container.decode(stream))
            except errors as e:
                raise VideoError(f"{what}: cannot decode the video ({e})") from None
            container.close()
            container, stream = open_stream()
        if total <= 0:
            raise VideoError(f"{what}: the video has no frames")
        wanted = [int(i) for i in pick(total, fps)]
        keep = set(wanted)
        last = max(wanted)
        frames: dict[int, np.ndarray] = {}
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in keep:
                    frames[i] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
        except errors as e:
            raise VideoError(f"{what}: cannot decode the video ({e})") from None
    finally:
        container.close()
    if not frames:
        raise VideoError(f"{what}: no frame could be decoded")
    # a container may announce more frames than it holds: keep the ones that exist
    got = [i for i in wanted if i in frames]
    return np.stack([frames[i] for i in got]), fps, got
