"""A request's images and videos as the engine carries them: `MultimodalPrompt`.

Built once per request (`MultimodalPrompt.build`): each image placeholder token of the prompt is
expanded to the image's token count (a video's into its timestamped frame steps), the 3-D mRoPE
positions of the whole prompt are computed, and the pixel patches wait for the vision tower. The
engine attaches it to the sequence's segments; deploy/vlm.py runs the tower on the first chunk
that needs it (once per request: the features stay here, so later chunks and preemption
recomputes only slice them) and merges the rows of the vision tokens a chunk feeds. Positions
past the prompt (decode, verify, drafts) are text: index + delta on all three axes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.models.qwen3_5_mrope import image_num_tokens, mrope_positions
from specdeploy.vision.image import ImageError, ProcessedImages
from specdeploy.vision.video import ProcessedVideo


@dataclass(frozen=True)
class VisionTokens:
    """The token ids a Qwen3-VL-family prompt marks its images and videos with."""
    image: int
    video: int = -1
    start: int = -1  # <|vision_start|>
    end: int = -1  # <|vision_end|>


class MultimodalPrompt:
    """`ids`: the expanded prompt; `pixel_values` / `grid_thw`: the tower's input, images and
    videos in prompt order (a video's grid has its temporal patches); `runs`: the (t, h, w) grid
    of each run of vision tokens, in order (a video contributes one per temporal patch: its
    timestamps separate them), which the 3-D positions follow."""

    def __init__(self, ids: list[int], pixel_values: torch.Tensor,
                 grid_thw: list[tuple[int, int, int]], runs: list[tuple[int, int, int]],
                 vision_ids: tuple[int, ...], merge: int):
        self.ids = ids
        self.pixel_values = pixel_values
        self.grid_thw = grid_thw
        pos, self.delta = mrope_positions(ids, vision_ids, runs, merge)
        self.prompt_positions = pos  # [3, len(ids)]
        mask = torch.isin(torch.tensor(ids, dtype=torch.long),
                          torch.tensor(vision_ids, dtype=torch.long))
        # feature row of each prompt token (-1: text), for slicing per chunk
        self.feature_row = torch.where(mask, mask.long().cumsum(0) - 1, -1)
        self.features: torch.Tensor | None = None  # [vision tokens, H] once the tower ran

    @classmethod
    def build(cls, ids: list[int], images: ProcessedImages | None, tokens: VisionTokens | int,
              merge: int, what: str = "prompt", videos: list[ProcessedVideo] | None = None,
              encode=None) -> MultimodalPrompt:
        """Expand each image placeholder into its tokens, and each video placeholder (with
        the `<|vision_start|>`, `<|vision_end|>` around it) into, per temporal patch,
        `encode("<t.t seconds>")`, start, its tokens, end; errors name the mismatch."""
        if isinstance(tokens, int):
            tokens = VisionTokens(tokens)
        grids = list(images.grid_thw) if images is not None else []
        videos = list(videos or ())
        for kind, tok, n in (("image", tokens.image, len(grids)),
                             ("video", tokens.video, len(videos))):
            slots = sum(t == tok for t in ids)
            if slots != n:
                raise ImageError(f"{what}: {n} {kind}(s) but {slots} {kind} placeholder "
                                 f"token(s) (id {tok})")
        if videos and encode is None:
            raise ValueError(f"{what}: videos need the tokenizer (their timestamps are text)")
        rows = [g[0] * g[1] * g[2] for g in grids]
        image_pix = list(images.pixel_values.split(rows)) if grids else []
        out: list[int] = []
        pix, tower, runs = [], [], []
        i = 0
        while i < len(ids):
            t = ids[i]
            if t == tokens.image:
                g = grids.pop(0)
                out += [t] * image_num_tokens(g, merge)
                pix.append(image_pix.pop(0))
                tower.append(g)
                runs.append(g)
            elif t == tokens.video:
                v = videos.pop(0)
                if out and out[-1] == tokens.start and i + 1 < len(ids) \
                        and ids[i + 1] == tokens.end:  # the template's wrapper: one per step
                    out.pop()
                    i += 1
                gt, gh, gw = v.grid_thw
                for ts in v.timestamps:
                    out += list(encode(f"<{ts:.1f} seconds>")) + [tokens.start]
                    out += [t] * image_num_tokens((1, gh, gw), merge) + [tokens.end]
                    runs.append((1, gh, gw))
                pix.append(v.pixel_values)
                tower.append(v.grid_thw)
            else:
                out.append(t)
            i += 1
        vision_ids = (tokens.image,) if tokens.video < 0 else (tokens.image, tokens.video)
        return cls(out, torch.cat(pix), tower, runs, vision_ids, merge)

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

    def key_extents(self, start: int, n: int) -> torch.Tensor | None:
        """Per token of start..start+n-1, the end of the bidirectional block it sees (ops/
        cached_attention.py `widen_rows`); None: causal throughout (Qwen's vision tokens)."""
        return None

    def chunk_tokens(self, start: int, n: int) -> int:
        """How many of the n tokens from `start` one prefill chunk may take (a chunk never
        ends inside a bidirectional block); causal prompts: all n."""
        return n

    def image_rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(offsets within the chunk, feature rows) of the image tokens among start..start+n-1,
        or None when the chunk has none."""
        rows = self.feature_row[start:min(start + n, self.num_prompt)]
        where = (rows >= 0).nonzero().flatten()
        if where.numel() == 0:
            return None
        return where, rows[where]
