"""`DistConfig`: the sharding one rank applies (read by the `shard` transform)."""
from __future__ import annotations

from dataclasses import dataclass

from specdeploy.ops.shard import LAYER_TYPES


@dataclass(frozen=True)
class DistConfig:
    """`tp_size` ranks in all (the world); MoE experts are split over `ep_size` groups of ranks
    and each expert's width over the `tp_size // ep_size` ranks of a group. `shard_layers` names
    the layer types that are sharded (the rest are replicated on every rank)."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    shard_layers: tuple[str, ...] = LAYER_TYPES

    def __post_init__(self):
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"expert_parallel_size={self.ep_size} must divide "
                             f"tensor_parallel_size={self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} not in 0..{self.tp_size - 1}")
        object.__setattr__(self, "shard_layers", tuple(self.shard_layers))
        bad = set(self.shard_layers) - set(LAYER_TYPES)
        if bad:
            raise ValueError(f"shard_layers: unknown layer types {sorted(bad)}; known: "
                             f"{', '.join(LAYER_TYPES)}")

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def moe_tp(self) -> int:
        """Ranks sharing one expert group (each expert's width splits over them)."""
        return self.tp_size // self.ep_size

    def for_rank(self, rank: int) -> DistConfig:
        return DistConfig(self.tp_size, self.ep_size, rank, self.shard_layers)


def dist_config(tp: int, ep: int, shard_layers=None) -> DistConfig | None:
    """The `DistConfig` of `LLM(tensor_parallel_size=tp, expert_parallel_size=ep,
    shard_layers=...)` and the CLI's flags; None on one process."""
    if tp == 1 and ep == 1:
        return None
    return DistConfig(tp, ep, **({} if shard_layers is None else {"shard_layers": shard_layers}))
