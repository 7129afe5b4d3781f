"""Suite-wide test settings.

NOTE: tiny models are dominated by per-op overhead; OpenMP threads only add spin-wait cost (and
collapse when other processes share the two cores). Tests that time or run the real default model
raise the thread count themselves.
"""
from __future__ import annotations

import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`cuda` tests run where a CUDA device is; elsewhere they are skipped with one reason."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="no CUDA device here (cuda tests run in bench/gpu_check.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
