"""Scale-out over torch.distributed: `DistConfig` (what one rank is), worker processes, the
leader's per-step broadcast (rank 0 schedules and decides tokens; the others mirror its calls)."""
from __future__ import annotations

from specdeploy.distributed.config import DistConfig, dist_config

__all__ = ["DistConfig", "dist_config"]
