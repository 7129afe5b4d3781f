"""`LLM.generate`'s prompts → one list of prompts and per-prompt media lists.

A call gives one prompt (a string, token ids, or vLLM's dict) or a list of them, and `images` /
`videos` as one list for one prompt or one list per prompt. vLLM's prompt dict,
{"prompt": str} or {"prompt_token_ids": [...]} with "multi_modal_data": {"image": one or a
list, "video": one or a list}, carries its own media, and "mm_processor_kwargs" its own
preprocessing (over the deployment's: vision/image.py `check_processor_kwargs`).
"""
from __future__ import annotations


def prompt_batch(prompts, images, videos
                 ) -> tuple[bool, list, list | None, list | None, list | None]:
    """(a single prompt was given, prompts, per-prompt images or None, per-prompt videos or
    None, per-prompt mm_processor_kwargs or None); errors name the argument."""
    single = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts
        and all(isinstance(t, int) for t in prompts))
    if single:
        prompts = [prompts]
        images = None if images is None else [images]
        videos = None if videos is None else [videos]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: no prompts given")
    prompts, images, videos, kwargs = _split_dicts(prompts, images, videos)
    for name, media in (("images", images), ("videos", videos)):
        if media is not None and not all(isinstance(x, (list, tuple)) for x in media):
            raise ValueError(f"{name}: give one list of {name} per prompt")
    return single, prompts, images, videos, kwargs


def _split_dicts(prompts: list, images, videos):
    if not any(isinstance(p, dict) for p in prompts):
        return prompts, images, videos, None
    if images is not None or videos is not None:
        raise ValueError("images= / videos= cannot be combined with prompt dicts (give "
                         "their multi_modal_data instead)")
    from specdeploy.vision.image import check_processor_kwargs

    out, imgs, clips, kwargs = [], [], [], []
    for i, p in enumerate(prompts):
        if not isinstance(p, dict):
            out.append(p)
            imgs.append([])
            clips.append([])
            kwargs.append(None)
            continue
        extra = set(p) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        if extra or ("prompt" in p) == ("prompt_token_ids" in p):
            raise ValueError(f"prompt {i}: a prompt dict has one of `prompt` / "
                             f"`prompt_token_ids` and optionally `multi_modal_data`"
                             f"{f' (unknown: {sorted(extra)})' if extra else ''}")
        out.append(p.get("prompt", p.get("prompt_token_ids")))
        mmd = p.get("multi_modal_data") or {}
        if not isinstance(mmd, dict) or set(mmd) - {"image", "video"}:
            raise ValueError(f"prompt {i}: multi_modal_data takes `image` and `video`")
        for key, dst in (("image", imgs), ("video", clips)):
            v = mmd.get(key)
            dst.append([] if v is None else list(v) if isinstance(v, list) else [v])
        kw = p.get("mm_processor_kwargs")
        if kw is not None:
            try:
                check_processor_kwargs(kw)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        kwargs.append(kw)
    return (out, imgs if any(imgs) else None, clips if any(clips) else None,
            kwargs if any(k is not None for k in kwargs) else None)
