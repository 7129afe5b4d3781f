"""Models shipped inside the package (specdeploy/data/models/NAME): a name stands for its
directory wherever a model path is taken (LLM, CLI, bench, tokenizer, reader)."""
from __future__ import annotations

from pathlib import Path

from specdeploy.checkpoint.errors import CheckpointError

SHIPPED = {
    # NemotronH-style (Mamba2 + attention + MoE, one MTP layer) distilled from the default
    # model; recipe bench/train_hybrid_demo.sh, data and steps in its training.json
    "hybrid-demo": "hybrid-demo",
}


def shipped_model_path(name: str) -> Path:
    """The directory of a shipped model; a clear error when it is missing from the install."""
    path = Path(__file__).parent.parent / "data" / "models" / SHIPPED[name]
    if not (path / "config.json").is_file():
        raise CheckpointError(f"shipped model {name!r}: {path} is missing (a broken install?)")
    return path


def resolve_model_name(model):
    """A shipped model's name → its directory; anything else unchanged (a local path of the
    same name wins)."""
    if isinstance(model, str) and model in SHIPPED and not Path(model).exists():
        return shipped_model_path(model)
    return model
