"""Hugging Face model ids (`org/name`) → a checkpoint in the local Hugging Face cache.

Nothing is ever downloaded: an id resolves only to a snapshot already in the cache
(`huggingface-cli download org/name` puts it there), otherwise the error names the id and the
cache directory that was searched. A path that exists always wins over an id.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from specdeploy.checkpoint.errors import CheckpointError

# owner/name as the Hub spells them (no leading dot or slash: those are paths)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads, from the environment at call time (not import time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"


def is_repo_id(model: str | os.PathLike) -> bool:
    return isinstance(model, str) and bool(_REPO_ID.match(model)) and not Path(model).exists()


def resolve_model_path(model: str | os.PathLike) -> Path:
    """`model` as a local path: itself if it exists, else the cached snapshot of a Hub id (a
    snapshot holding no config.json but one .gguf file resolves to that file); a shipped
    model's name (`hybrid-demo`) is its directory in the package."""
    from specdeploy.checkpoint.shipped import resolve_model_name

    model = resolve_model_name(model)
    if not is_repo_id(model):
        return Path(model)
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download

        snap = Path(snapshot_download(repo_id=model, cache_dir=str(cache),
                                      local_files_only=True))
    except ImportError:
        raise CheckpointError(f"{model}: not a local path; resolving Hugging Face ids needs "
                              "huggingface_hub (pip install huggingface_hub)") from None
    except Exception as e:  # LocalEntryNotFoundError and friends: not in the cache
        raise CheckpointError(
            f"{model}: not a local path and not in the Hugging Face cache at {cache} "
            f"(specdeploy never downloads; fetch it first with `huggingface-cli download "
            f"{model}`, or set HF_HOME / HF_HUB_CACHE) [{type(e).__name__}]") from None
    if not (snap / "config.json").is_file():
        ggufs = sorted(snap.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return snap
