"""A request's images as the engine carries them: `MultimodalPrompt`.

Built once per request (`MultimodalPrompt.build`): each image placeholder token of the prompt is
expanded to the image's token count, the 3-D mRoPE positions of the whole prompt are computed, and
the pixel patches wait for the vision tower. The engine attaches it to the sequence's segments;
deploy/vlm.py runs the tower on the first chunk that needs it (once per request: the features
stay here, so later chunks and preemption recomputes only slice them) and merges the rows of the
image tokens a chunk feeds. Positions past the prompt (decode, verify, drafts) are text: index +
delta on all three axes.
"""
from __future__ import annotations

import torch

from specdeploy.models.qwen3_5_vision import image_num_tokens, mrope_positions
from specdeploy.vision.image import ImageError, ProcessedImages


class MultimodalPrompt:
    def __init__(self, ids: list[int], images: ProcessedImages, image_token_id: int,
                 merge: int):
        self.ids = ids
        self.pixel_values = images.pixel_values
        self.grid_thw = images.grid_thw
        self.image_token_id = image_token_id
        pos, self.delta = mrope_positions(ids, image_token_id, images.grid_thw, merge)
        self.prompt_positions = pos  # [3, len(ids)]
        mask = torch.tensor(ids) == image_token_id
        # feature row of each prompt token (-1: text), for slicing per chunk
        self.feature_row = torch.where(mask, mask.long().cumsum(0) - 1, -1)
        self.features: torch.Tensor | None = None  # [image tokens, H] once the tower ran

    @classmethod
    def build(cls, ids: list[int], images: ProcessedImages, image_token_id: int, merge: int,
              what: str = "prompt") -> MultimodalPrompt:
        """Expand one placeholder per image into its tokens; errors name the mismatch."""
        slots = [i for i, t in enumerate(ids) if t == image_token_id]
        n = len(images.grid_thw)
        if len(slots) != n:
            raise ImageError(f"{what}: {n} image(s) but {len(slots)} image placeholder token(s) "
                             f"(id {image_token_id})")
        out: list[int] = []
        prev = 0
        for s, g in zip(slots, images.grid_thw):
            out += ids[prev:s] + [image_token_id] * image_num_tokens(g, merge)
            prev = s + 1
        out += ids[prev:]
        return cls(out, images, image_token_id, merge)

    @property
    def num_prompt(self) -> int:
        return len(self.ids)

    def positions(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of tokens start..start+n-1 (prompt rows, then text past it)."""
        p = self.num_prompt
        head = self.prompt_positions[:, start:min(start + n, p)]
        first = max(start, p)
        tail = torch.arange(first, max(first, start + n)).add(self.delta).expand(3, -1)
        return torch.cat((head, tail), 1) if head.shape[1] else tail

    def image_rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(offsets within the chunk, feature rows) of the image tokens among start..start+n-1,
        or None when the chunk has none."""
        rows = self.feature_row[start:min(start + n, self.num_prompt)]
        where = (rows >= 0).nonzero().flatten()
        if where.numel() == 0:
            return None
        return where, rows[where]
