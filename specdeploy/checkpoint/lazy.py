"""Per-rank loading: parameters that stay unread until the `shard` transform has chosen a
rank's slice of each (deploy/passes/shard.py), so a rank never holds the whole model.

A lazy parameter is a placeholder of the right shape and dtype that costs one element: a NaN
scalar expanded (stride 0), so torch.export traces it like the real tensor and anything that
reads its values before loading computes NaN, which `check_loaded` refuses. The shard transform
reads each sharded parameter whole (one tensor at a time, from the memory-mapped checkpoint),
keeps the rank's slice and drops the rest; every other parameter is read whole afterwards
(`materialize`). Bookkeeping (`resident`, `peak`) counts the bytes a rank holds in weights:
what it kept plus the one full tensor being sliced.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LazyWeights:
    """Placeholder → its loader; one per build (the target's and drafters' programs share it)."""

    def __init__(self):
        # NOTE: holds the placeholder too, so its address is never reused by a real tensor
        self._loaders: dict[int, tuple[str, Callable[[], torch.Tensor], torch.Tensor]] = {}
        self._full: dict[int, torch.Tensor] = {}  # materialized whole (shared by programs)
        self.resident = 0  # bytes kept: slices and whole tensors
        self.peak = 0  # the most held at once, counting the tensor being sliced
        self.read = 0  # bytes read from the checkpoint (tied tensors may be read twice)

    def placeholder(self, name: str, shape, dtype: torch.dtype,
                    load: Callable[[], torch.Tensor]) -> torch.Tensor:
        fill = float("nan") if dtype.is_floating_point else 0
        t = torch.full((), fill, dtype=dtype).expand(tuple(shape))
        self._loaders[t.data_ptr()] = (name, load, t)
        return t

    def is_lazy(self, t: torch.Tensor) -> bool:
        """Whether `t` is a placeholder (materialized or not, it holds no values)."""
        return t.data_ptr() in self._loaders

    def name_of(self, t: torch.Tensor) -> str | None:
        hit = self._loaders.get(t.data_ptr())
        return hit[0] if hit else None

    def _load(self, t: torch.Tensor) -> torch.Tensor:
        name, load, _ = self._loaders[t.data_ptr()]
        full = load()
        if tuple(full.shape) != tuple(t.shape):  # the loader checked against the model's shape
            raise RuntimeError(f"lazy weight {name}: loaded {tuple(full.shape)}, expected "
                               f"{tuple(t.shape)}")
        self.read += _nbytes(full)
        self.peak = max(self.peak, self.resident + _nbytes(full))
        return full

    def slice(self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        """`fn(whole tensor)` for a lazy `t`: the whole one is read, sliced and dropped."""
        if t.data_ptr() in self._full:
            return fn(self._full[t.data_ptr()])
        out = fn(self._load(t)).contiguous()
        self.resident += _nbytes(out)
        return out

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a lazy `t` (read once, then shared by every program)."""
        key = t.data_ptr()
        if key not in self._full:
            self._full[key] = self._load(t)
            self.resident += _nbytes(self._full[key])
        return self._full[key]

    def materialize_module(self, module: torch.nn.Module) -> None:
        """Every lazy parameter / buffer of `module` read whole, in place (a drafter that
        copies or casts the target's weights before the shard transform runs)."""
        for mod in module.modules():
            for store in (mod._parameters, mod._buffers):
                for leaf, t in list(store.items()):
                    if t is not None and self.is_lazy(t):
                        full = self.materialize(t)
                        store[leaf] = torch.nn.Parameter(full, requires_grad=False) if \
                            store is mod._parameters else full

    def stats(self) -> dict:
        return {"load_peak_bytes": self.peak, "load_resident_bytes": self.resident,
                "load_read_bytes": self.read}


def check_loaded(named: list[tuple[str, torch.Tensor]], lazy: LazyWeights) -> None:
    """Refuse a weight computed from a placeholder before its load (NaN where a loaded weight
    is finite: the loader checked every tensor) or a placeholder left unread."""
    for name, t in named:
        if lazy.is_lazy(t):
            raise RuntimeError(f"per-rank loading: {name} was never loaded "
                               f"({lazy.name_of(t)})")
        if t.is_floating_point() and t.numel() and bool(t.reshape(-1)[0].isnan()):
            raise RuntimeError(f"per-rank loading: {name} was computed from a weight before it "
                               "was loaded (NaN); load this model with tensor_parallel_size=1 "
                               "or report the transform that read it")
