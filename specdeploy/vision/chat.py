"""Images in requests: OpenAI-style content parts → (template-ready messages, image sources), and
prompt ids + images → the request's `MultimodalPrompt` (used by the LLM API, CLI and server)."""
from __future__ import annotations

from specdeploy.vision.image import ImageError
from specdeploy.vision.prompt import MultimodalPrompt

_VIDEO = ("video", "video_url", "input_video")


def split_images(conversation: list[dict]) -> tuple[list[dict], list]:
    """Replace every image part ({"type": "image_url", "image_url": {"url": ...}} or
    {"type": "image", "image": <PIL / path / bytes>}) by {"type": "image"} (what chat templates
    render as the image placeholder) and collect the sources in order."""
    images: list = []
    out: list[dict] = []
    for m, msg in enumerate(conversation):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{m}].content[{p}]"
            if kind in _VIDEO:
                raise ImageError(f"{where}: video inputs are not supported (images only: "
                                 "image_url parts or images=)")
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ImageError(f"{where}: image_url needs a url")
                images.append(url)
                parts.append({"type": "image"})
            elif kind == "image":
                src = part.get("image", part.get("url"))
                if src is None:
                    raise ImageError(f"{where}: an image part needs `image` (PIL, path, bytes)")
                images.append(src)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, images


def served_image_url(part: dict, bad, field: str) -> str:
    """The data URL of an `image_url` part sent to the server: nothing is fetched and no local
    file is read for a client, so any other URL is refused with `bad(field, message, code)`."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise bad(field, "is required", "invalid_value")
    if url.startswith(("http://", "https://")):
        raise bad(field, "remote image URLs are not fetched; send the image as a data URL "
                  "(data:image/png;base64,...)", "unsupported")
    if not url.startswith("data:"):
        raise bad(field, "must be a data URL (data:image/<type>;base64,...)", "invalid_value")
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


def build_prompt(deployed, ids: list[int], images: list, what: str = "prompt"
                 ) -> MultimodalPrompt:
    """Preprocess `images` with the deployment's processor and expand their placeholders."""
    if not hasattr(deployed, "image_features"):
        raise ImageError(f"{what}: this model has no vision tower; images are not accepted")
    processed = deployed.processor.preprocess(list(images), what=f"{what} image")
    return MultimodalPrompt.build(list(ids), processed, deployed.image_token_id,
                                  deployed.merge_size, what)
