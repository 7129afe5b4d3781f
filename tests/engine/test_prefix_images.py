"""Prefix-cache keys of a prompt with images chain from the images' pixels: every image is the
same run of placeholder tokens, so two different images must never share cached KV."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from specdeploy.cache.prefix import ROOT, page_key, root_key


def _seq(pixels=None, grid=((1, 4, 4),)):
    mm = None if pixels is None else SimpleNamespace(pixel_values=pixels,
                                                     grid_thw=torch.tensor(grid))
    return SimpleNamespace(mm=mm)


def test_images_key_the_prefix():
    a, b = torch.zeros(16, 12), torch.zeros(16, 12)
    b[3, 5] = 1e-3
    assert root_key(_seq()) == ROOT
    assert root_key(_seq(a)) == root_key(_seq(a.clone())) != ROOT
    assert root_key(_seq(a)) != root_key(_seq(b))  # one pixel apart
    assert root_key(_seq(a)) != root_key(_seq(a, grid=((1, 2, 8),)))  # same pixels, other grid
    ids = list(range(16))
    assert page_key(root_key(_seq(a)), ids) != page_key(root_key(_seq(b)), ids)
