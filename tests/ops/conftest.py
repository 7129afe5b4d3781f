from __future__ import annotations

import pytest
import torch


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """Max error relative to the expected tensor's scale (elementwise rtol fails near 0)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.double().abs().max().item() if expected.numel() else 0.0, 1e-6)
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * scale {scale:.3g}"

@pytest.fixture
def close():
    return _assert_close

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
