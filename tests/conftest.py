"""Suite-wide test settings.

NOTE: tiny models are dominated by per-op overhead; OpenMP threads only add spin-wait cost (and
collapse when other processes share the two cores). Tests that time or run the real default model
raise the thread count themselves.
"""
from __future__ import annotations

import torch

torch.set_num_threads(1)
