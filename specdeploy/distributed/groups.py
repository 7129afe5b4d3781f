"""Process groups: the default one (the graphs' collectives, under a timeout) and a gloo control
group with a long timeout for rank 0's per-step messages (an idle server's workers may wait)."""
from __future__ import annotations

import socket
import time
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
    """Join the default group (collectives) and the control group (per-step messages)."""
    backend = "nccl" if device is not None and torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    CONTROL["group"] = dist.new_group(backend="gloo", timeout=timedelta(days=7))


def send(msg) -> None:
    t0 = time.perf_counter()
    dist.broadcast_object_list([msg], src=0, group=CONTROL["group"])
    MESSAGES["seconds"] += time.perf_counter() - t0
    MESSAGES["count"] += 1


def recv():
    box = [None]
    dist.broadcast_object_list(box, src=0, group=CONTROL["group"])
    return box[0]


def agree_min(value: float) -> float:
    """The smallest `value` over the ranks (e.g. each rank's free memory for the cache budget)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=CONTROL["group"])
    return float(t.item())
