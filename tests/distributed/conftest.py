"""Fixtures for the sharding tests: tiny checkpoints (one per family) and a tolerance check."""
from __future__ import annotations

import pytest

from tests.deploy.conftest import assert_close


@pytest.fixture
def close():
    return assert_close


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """family → path of a tiny random checkpoint (written once per session)."""
    from specdeploy.models.registry import family_module

    root = tmp_path_factory.mktemp("dist_ckpt")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = family_module(family).make_tiny(root / family, seed=0)
        return cache[family]

    return get
