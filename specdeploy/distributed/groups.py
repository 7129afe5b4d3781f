"""Process groups: the default one (the graphs' collectives, under a timeout) and a gloo control
group with a long timeout for rank 0's per-step messages (an idle server's workers may wait)."""
from __future__ import annotations

import gc
import pickle
import socket
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

CONTROL: dict = {}
MESSAGES = {"seconds": 0.0, "count": 0}  # rank 0's per-step broadcasts (benches read it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, init_method: str, timeout: float, device=None) -> None:
    """Join the world (rendezvous under a generous timeout: ranks start at their own pace), the
    compute group (the graphs' collectives, under `timeout`) and the control group (per-step
    messages, no practical timeout)."""
    from specdeploy.ops.collectives import set_group

    backend = "nccl" if device is not None and torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(timeout, 600.0)))
    set_group(dist.new_group(backend=backend, timeout=timedelta(seconds=timeout)))
    CONTROL["group"] = dist.new_group(backend="gloo", timeout=timedelta(days=7))
    CONTROL["timeout"] = timeout


def send(msg) -> None:
    """Rank 0: `msg` to every rank, failing after the step timeout (a stopped rank never reads)."""
    t0 = time.perf_counter()
    data = pickle.dumps(msg)
    timeout = timedelta(seconds=CONTROL["timeout"])
    # NOTE: the payload is copied into memory torch owns. A tensor over a Python bytearray
    # (`frombuffer` alone) is freed by whichever thread drops gloo's work last, and freeing it
    # takes the GIL: at interpreter exit that thread is killed inside a noexcept destructor and
    # the process aborts ("terminate called without an active exception", CI of stop 40)
    for t in (torch.tensor([len(data)], dtype=torch.int64),
              torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()):
        dist.broadcast(t, src=0, group=CONTROL["group"], async_op=True).wait(timeout)
    MESSAGES["seconds"] += time.perf_counter() - t0
    MESSAGES["count"] += 1


def recv():
    """A worker: the next message from rank 0 (waits as long as rank 0 is idle)."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=0, group=CONTROL["group"])
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=CONTROL["group"])
    return pickle.loads(buf.numpy().tobytes())


def leave() -> None:
    """Tear every group down and drop this module's and the collectives' references to them, so
    their C++ objects (and gloo's worker threads) go now, while the interpreter is whole, not
    during its finalization. Safe to call twice and when no group was joined."""
    from specdeploy.ops.collectives import _GROUP, set_group

    # NOTE: a full collection takes ~0.5 s in a large process (a test suite's): only when a
    # group outlives its references here, held by a reference cycle
    groups = [weakref.ref(g) for g in (dist.group.WORLD if dist.is_initialized() else None,
                                       CONTROL.get("group"), _GROUP[0]) if g is not None]
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        CONTROL.pop("group", None)
        set_group(None)
        if any(ref() is not None for ref in groups):
            gc.collect()


def agree_min(value: float) -> float:
    """The smallest `value` over the ranks (e.g. each rank's free memory for the cache budget)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=CONTROL["group"])
    return float(t.item())
