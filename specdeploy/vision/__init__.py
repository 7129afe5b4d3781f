"""Images for vision-language targets: decoding and preprocessing (`image.py`), and the
per-request multimodal prompt (`prompt.py`: expanded image tokens, mRoPE positions, features)."""
from __future__ import annotations

from specdeploy.vision.image import ImageError, ImageProcessor, load_image
from specdeploy.vision.prompt import MultimodalPrompt

__all__ = ["ImageError", "ImageProcessor", "MultimodalPrompt", "load_image"]
