"""Images and videos in requests: OpenAI-style content parts → (template-ready messages, image
and video sources), and prompt ids + media → the request's `MultimodalPrompt` (used by the LLM
API, CLI and server)."""
from __future__ import annotations

from specdeploy.vision.image import ImageError
from specdeploy.vision.prompt import MultimodalPrompt, VisionTokens

_MEDIA = ("image_url", "image", "video_url", "video")
_NEEDS = {"image": "an image part needs `image` (PIL, path, bytes)",
          "video": "a video part needs `video` (a file or frames)"}


def split_images(conversation: list[dict]) -> tuple[list[dict], list]:
    """`split_media` for conversations of images only (a video part is refused)."""
    out, images, videos = split_media(conversation)
    if videos:
        raise ImageError("video inputs are not accepted here (images only)")
    return out, images


def split_media(conversation: list[dict]) -> tuple[list[dict], list, list]:
    """Replace every image part ({"type": "image_url", "image_url": {"url": ...}} or
    {"type": "image", "image": <PIL / path / bytes>}) by {"type": "image"} and every video part
    ({"type": "video_url", "video_url": {"url": ...}} or {"type": "video", "video": <file or
    frames>}) by {"type": "video"} (what chat templates render as the placeholders) and collect
    the sources in order: (messages, images, videos)."""
    images: list = []
    videos: list = []
    out: list[dict] = []
    for m, msg in enumerate(conversation):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            media = kind.removesuffix("_url") if kind in _MEDIA else None
            if media is None:
                parts.append(part)
                continue
            where = f"messages[{m}].content[{p}]"
            if kind.endswith("_url"):
                src = part.get(kind)
                src = src.get("url") if isinstance(src, dict) else src
                if not isinstance(src, str) or not src:
                    raise ImageError(f"{where}: {kind} needs a url")
            else:
                src = part.get(kind, part.get("url"))
                if src is None:
                    raise ImageError(f"{where}: {_NEEDS[kind]}")
            (images if media == "image" else videos).append(src)
            parts.append({"type": media})
        out.append({**msg, "content": parts})
    return out, images, videos


def served_image_url(part: dict, bad, field: str, kind: str = "image") -> str:
    """The data URL of an `image_url` (`video_url`) part sent to the server: nothing is fetched
    and no local file is read for a client, so any other URL is refused with
    `bad(field, message, code)`."""
    url = part.get(f"{kind}_url")
    url = url.get("url") if isinstance(url, dict) else url
    example = "image/png" if kind == "image" else "video/mp4"
    if not isinstance(url, str) or not url:
        raise bad(field, "is required", "invalid_value")
    if url.startswith(("http://", "https://")):
        raise bad(field, f"remote {kind} URLs are not fetched; send the {kind} as a data URL "
                  f"(data:{example};base64,...)", "unsupported")
    if not url.startswith("data:"):
        raise bad(field, f"must be a data URL (data:{kind}/<type>;base64,...)", "invalid_value")
    return url


def text_only(conversation: list[dict]) -> list[dict]:
    """Content-part lists of text only, joined into strings (for text templates)."""
    out = []
    for msg in conversation:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             for p in content):
            msg = {**msg, "content": "".join(p.get("text", "") for p in content)}
        out.append(msg)
    return out


def build_prompt(deployed, ids: list[int], images: list, what: str = "prompt",
                 videos: list | None = None, encode=None, kwargs: dict | None = None
                 ) -> MultimodalPrompt:
    """Preprocess `images` and `videos` with the deployment's processors (`kwargs`: a request's
    `mm_processor_kwargs` over the deployment's) and expand their placeholders (`encode`: text
    → ids without special tokens, for videos' timestamps)."""
    if not hasattr(deployed, "image_features"):
        kind = "videos" if videos and not images else "images"
        raise ImageError(f"{what}: this model has no vision tower; {kind} are not accepted")
    limits = getattr(deployed, "mm_limits", None) or {}
    for kind, given in (("image", images), ("video", videos)):
        n, most = len(given or ()), limits.get(kind)
        if most is not None and n > most:
            raise ImageError(f"{what}: {n} {kind}(s), but limit_mm_per_prompt allows {most}")
    if hasattr(deployed, "build_prompt"):  # Gemma 3 (deploy/vlm.py): images only
        if videos:
            raise ImageError(f"{what}: this model takes no videos")
        processed = (deployed.processor.with_kwargs(kwargs).preprocess(list(images),
                                                                       what=f"{what} image")
                     if images else None)
        return deployed.build_prompt(list(ids), processed, what, encode)
    processed = (deployed.processor.with_kwargs(kwargs).preprocess(list(images),
                                                                   what=f"{what} image")
                 if images else None)
    clips = None
    if videos:
        clips = deployed.video_processor.with_kwargs(kwargs).preprocess(list(videos),
                                                                        what=f"{what} video")
    tokens = VisionTokens(deployed.image_token_id, deployed.video_token_id,
                          deployed.vision_start_id, deployed.vision_end_id)
    return MultimodalPrompt.build(list(ids), processed, tokens, deployed.merge_size, what,
                                  clips, encode)
