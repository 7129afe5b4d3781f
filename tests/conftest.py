"""Suite-wide test settings.

NOTE: tiny models are dominated by per-op overhead; OpenMP threads only add spin-wait cost (and
collapse when other processes share the two cores). Tests that time or run the real default model
raise the thread count themselves.
Under pytest-xdist (`make test` runs `-n 2`) each worker holds one core: the processes its tests
start (TP ranks, servers, torchrun) get one OpenMP thread too, or they would oversubscribe it.
"""
from __future__ import annotations

import os

import torch

torch.set_num_threads(1)
# transformers (5.25+) requires the `kernels` package, and with it would fetch "hub kernels"
# (fla's gated delta rule, causal_conv1d) from the Hub for Qwen3.5 / NemotronH: the oracles
# must be transformers' own torch code, and tests never reach the network.
os.environ["USE_HUB_KERNELS"] = "0"
# the same tiny architectures are built hundreds of times: reuse torch.export's graph of a model
# whose structure was exported before in this process (deploy/export_cache.py; the first build
# of each structure, and tests/deploy/test_export_cache.py, run torch.export itself)
os.environ.setdefault("SPECDEPLOY_EXPORT_CACHE", "1")
# 2-rank tests: reuse worker processes (distributed/pool.py: no ~3 s of imports per deployment,
# warm export caches); tests/distributed/test_tp_lifecycle.py runs the spawned default
os.environ.setdefault("SPECDEPLOY_WORKER_POOL", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """`cuda` tests run where a CUDA device is; elsewhere they are skipped with one reason."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="no CUDA device here (cuda tests run in bench/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker (not the tests/cuda name)
            item.add_marker(skip)
