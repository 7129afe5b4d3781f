"""The multimodal RoPE positions of a Qwen3.5 / Qwen3-VL prompt with images and videos
(transformers' `get_rope_index`): the language model's 3-D positions, computed once per request
(vision/prompt.py) beside the vision tower (models/qwen3_5_vision.py) whose tokens they place."""
from __future__ import annotations

import torch


def image_num_tokens(grid_thw: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid_thw
    return t * h * w // merge ** 2


def mrope_positions(input_ids: list[int], vision_ids: int | tuple[int, ...],
                    grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, int]:
    """3-D (temporal, height, width) positions [3, T] of a prompt whose vision tokens (ids in
    `vision_ids`) are already expanded (one run of `image_num_tokens` per grid, in order: an
    image, or one temporal step of a video), and the delta that later text positions add to
    their index (transformers' `get_rope_index`). Text advances all axes by one; a run occupies
    its (t, h/merge, w/merge) grid offset by the current position, after which text resumes at
    that position + max(h, w) / merge."""
    vision = {vision_ids} if isinstance(vision_ids, int) else set(vision_ids)
    out: list[torch.Tensor] = []
    pos, i, n, img = 0, 0, len(input_ids), 0
    while i < n:
        j = i
        if input_ids[i] not in vision:
            while j < n and input_ids[j] not in vision:
                j += 1
            out.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            if img >= len(grids):
                raise ValueError(f"prompt: more vision tokens than images / video steps "
                                 f"({len(grids)})")
            t, h, w = grids[img]
            gh, gw = h // merge, w // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw),
                                        indexing="ij")
            run = torch.stack((tt, hh, ww)).reshape(3, -1) + pos
            j = i + run.shape[1]
            if j > n or any(x != input_ids[i] for x in input_ids[i:j]):
                raise ValueError(f"prompt: image / video step {img} needs {run.shape[1]} vision "
                                 "tokens in a row")
            out.append(run)
            pos += max(gh, gw)
            img += 1
        i = j
    if img != len(grids):
        raise ValueError(f"prompt: {len(grids)} images / video steps but vision tokens for {img}")
    positions = torch.cat(out, 1) if out else torch.zeros(3, 0, dtype=torch.long)
    return positions, int(positions.max()) + 1 - n if n else 0
