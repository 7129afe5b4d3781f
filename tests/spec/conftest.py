"""Session fixture: one tiny target (+ drafter) per architecture."""
from __future__ import annotations

import pytest

from tests.spec.tiny_targets import METHODS, Target


@pytest.fixture(scope="session", params=sorted(METHODS))
def target(request, tmp_path_factory) -> Target:
    return Target(request.param, tmp_path_factory.mktemp("spec"))
