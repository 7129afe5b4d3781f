"""Shared fixtures for the deploy tests: tiny checkpoints (one per family) and a tolerance check."""
from __future__ import annotations

import pytest
import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """Max abs error relative to the expected tensor's scale (elementwise rtol fails near 0)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.double().abs().max().item() if expected.numel() else 0.0, 1e-6)
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * scale {scale:.3g}"


@pytest.fixture
def close():
    return assert_close


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """family → path of a tiny random checkpoint (written once per session)."""
    from specdeploy.models.registry import family_module

    root = tmp_path_factory.mktemp("deploy_ckpt")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = family_module(family).make_tiny(root / family, seed=0)
        return cache[family]

    return get
