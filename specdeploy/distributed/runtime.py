"""Ranks at run time: process groups, worker processes, rank 0's mirrored calls.

Rank 0 runs the engine (scheduler, sampling, verification, HTTP server) on a `Leader`, which wraps
its deployed model: each call that runs a graph (`forward`, `draft_forward`; a vision-language
target's `forward_embeds`, whose input embeddings rank 0's tower and embedding made, the
images' pixels left behind) is sent to the other
ranks once (a `commit` of accepted drafts and prefix caching's state restores and checkpoints
ride along with the next one), with its arguments as
rank 0 computed them (batch metadata, draft ids, accepted indices), and then run locally. Tokens
are therefore decided on rank 0 alone and the workers only ever compute what rank 0 decided
(AutoDeploy #13134: argmax diverging across ranks hung a run). Workers loop on `serve_worker`
until rank 0 sends the stop message.

Groups (distributed/groups.py): a compute group (gloo on CPU, NCCL on CUDA) carries the graphs'
collectives under `timeout` seconds, so a dead or hung rank fails the step with an error naming
it; a gloo control group with a long timeout carries the per-step messages, so an idle server's
workers may wait for requests indefinitely (they exit when rank 0's process goes: its sockets
close, and spawned workers also watch their parent).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from specdeploy.distributed.config import DistConfig
from specdeploy.distributed.groups import CONTROL, free_port, init_group, leave, recv, send

# host calls that change a rank's cache state (spec commits, prefix hits' state restores and
# verified checkpoints) have no collective inside and return nothing: they ride, in order,
# ahead of the next graph call, which is the first to read what they wrote
MIRRORED = ("forward", "forward_embeds", "draft_forward", "commit", "restore_states",
            "checkpoint_spec")
DEFERRED = ("commit", "restore_states", "checkpoint_spec")


class RankFailure(RuntimeError):
    """A rank died, hung past the collective timeout, or failed its step."""


class Leader:
    """Rank 0's deployed model: mirrored calls go to every rank first; the rest is local."""

    def __init__(self, local, dist_cfg: DistConfig, workers: list | None = None):
        self._local, self.dist = local, dist_cfg
        self._workers = workers or []  # subprocess.Popen of the ranks started here (not torchrun)
        self._failed: str | None = None
        self._pending: list = []  # deferred calls, sent ahead of the next mirrored one
        self._on_failure: Callable[[], None] | None = None
        self.closed = False

    def __getattr__(self, name):
        attr = getattr(self._local, name)
        if name in MIRRORED:
            return lambda *a, **kw: self._call(name, a, kw)
        return attr

    def on_failure(self, fn: Callable[[], None]) -> None:
        """Called once when a rank fails (the server uses it to exit after failing requests)."""
        self._on_failure = fn

    def _call(self, name: str, args: tuple, kwargs: dict):
        if self._failed:
            raise RankFailure(self._failed)
        try:
            if name in DEFERRED:
                self._pending.append((name, args, kwargs))
            else:
                sent = args
                if name == "forward_embeds":  # the embeddings carry the images: not the pixels
                    sent = (dataclasses.replace(args[0], mm_rows=None), *args[1:])
                send(self._pending + [(name, sent, kwargs)])
                self._pending = []
            return getattr(self._local, name)(*args, **kwargs)
        except Exception as e:
            self._failed = f"tensor-parallel step failed: {self._diagnose()} ({e})"
            if self._on_failure is not None:
                threading.Thread(target=self._on_failure, daemon=True).start()
            raise RankFailure(self._failed) from e

    def _diagnose(self) -> str:
        time.sleep(0.2)  # a killed worker's exit code shows up a moment after its sockets close
        dead = [(i + 1, p.poll()) for i, p in enumerate(self._workers) if p.poll() is not None]
        if dead:
            return ", ".join(f"rank {r} exited (code {c})" for r, c in dead)
        return (f"a rank of {self.dist.world_size} stopped answering within the collective "
                f"timeout")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (the stop message, then terminate stragglers) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if not self._failed:
            try:
                send(None)
                _parting_barrier()
            except Exception:
                pass
        stop_workers(self._workers, 0.5 if self._failed else timeout)
        try:
            leave()
        except Exception:  # noqa: S110 - leaving anyway
            pass


def _parting_barrier(timeout: float = 10.0) -> None:
    """Rank 0's stop message is through and every rank is leaving: only then does any rank
    tear its group down (one rank destroying while a peer's gloo connection still carried the
    stop message aborted rank 0 now and then: "terminate called without an active
    exception"). Bounded: a rank that does not come is left behind."""
    try:
        dist.monitored_barrier(group=CONTROL["group"], timeout=timedelta(seconds=timeout),
                               wait_all_ranks=True)
    except Exception:  # noqa: S110 - leaving anyway; a missing rank is stopped by its parent
        pass


def _built_barrier(timeout: float = 900.0) -> None:
    """Every rank has built its program (gloo's monitored barrier names a rank that did not).
    First, freed heap pages (the full weights each rank sliced) go back to the OS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    dist.monitored_barrier(group=CONTROL["group"], timeout=timedelta(seconds=timeout),
                           wait_all_ranks=True)


def _rss() -> tuple[int, int]:
    """(resident, of which anonymous) bytes of this process (file pages: the mmap'd checkpoint)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(val.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)


def rank_memory(deployed, rss_before: int) -> list[dict]:
    """Every rank's weight memory after its build (gathered on each rank; rank 0 reports it):
    weight bytes held at load (peak) and kept by its graphs, peak / current RSS."""
    import resource

    from specdeploy.deploy.graph import weight_bytes

    gms = [g.gm for g in (getattr(deployed, "target", None), *getattr(deployed, "drafts", ()))
           if g is not None] or [deployed.gm]
    rss, anon = _rss()
    mine = {"rank": dist.get_rank(), "weight_bytes": weight_bytes(gms), "rss_bytes": rss,
            "rss_anon_bytes": anon, "rss_before_build_bytes": rss_before,
            "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **getattr(deployed, "load_stats", {})}
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine, group=CONTROL["group"])
    return out


def serve_worker(deployed) -> None:
    """A worker rank: run what rank 0 sends until it sends the stop message (None)."""
    while True:
        msg = recv()
        if msg is None:
            break
        for name, args, kwargs in msg:
            getattr(deployed, name)(*args, **kwargs)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)  # rank 0's process is gone: nobody will send the stop message


def stop_workers(procs: list, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:  # a stopped process (SIGSTOP, ^Z) acts on SIGTERM once continued, not in 2 s
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()


def worker_main(argv: list[str]) -> None:
    """`python -m specdeploy.distributed.runtime RANK WORLD INIT_METHOD TIMEOUT OPTIONS_PICKLE`:
    a worker started by `start` (a fresh interpreter: the user's main module is not re-run)."""
    rank, world, init_method, timeout, blob = argv
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(max(1, int(os.environ.get("SPECDEPLOY_WORKER_THREADS", "1"))))
    run_rank(int(rank), int(world), init_method, float(timeout), blob)


def run_rank(rank: int, world: int, init_method: str, timeout: float, blob: str) -> None:
    """Join the group, build this rank, serve rank 0 until it stops, leave the group (a spawned
    worker's life; a pooled worker's job, distributed/pool.py)."""
    with open(blob, "rb") as f:
        model_path, options = pickle.load(f)
    init_group(rank, world, init_method, timeout)
    from specdeploy.deploy.build import build

    opts = dataclasses.replace(options, dist=options.dist.for_rank(rank))
    rss_before = _rss()[0]
    deployed = build(model_path, opts)
    _built_barrier()
    rank_memory(deployed, rss_before)
    serve_worker(deployed)
    _parting_barrier()
    leave()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def start(model_path, options, timeout: float = 60.0) -> tuple[DistConfig, list]:
    """Rank 0's side of starting `options.dist.tp_size` ranks: under torchrun join env://
    (every process runs the same command; ranks > 0 turn into workers in `LLM`), else spawn the
    workers on this machine. Returns (rank 0's DistConfig, the spawned processes)."""
    d = options.dist
    if launched_by_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != d.tp_size:
            raise ValueError(f"tensor_parallel_size={d.tp_size} but torchrun started "
                             f"WORLD_SIZE={world} processes")
        init_group(rank, world, "env://", timeout)
        return d.for_rank(rank), []
    init_method = f"tcp://127.0.0.1:{free_port()}"
    fd, blob = tempfile.mkstemp(prefix="specdeploy-rank-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((model_path, options), f)
    from specdeploy.distributed import pool

    if pool.enabled():  # reused workers (the test suite): no imports, warm export caches
        procs = pool.start_ranks(d.tp_size, init_method, timeout, blob)
    else:
        procs = [subprocess.Popen([sys.executable, "-m", "specdeploy.distributed.runtime",
                                   str(r), str(d.tp_size), init_method, str(timeout), blob])
                 for r in range(1, d.tp_size)]
    try:
        init_group(0, d.tp_size, init_method, timeout)
    except Exception:
        stop_workers(procs, 0.1)
        raise
    finally:
        os.unlink(blob)  # read by now: every worker has joined (or the start failed)
    return d.for_rank(0), procs


def build_ranked(model_path, options, timeout: float = 60.0):
    """Build this process's rank. Rank 0 gets a `Leader`; a torchrun rank > 0 serves as a worker
    until rank 0 stops, then returns None."""
    from specdeploy.deploy.build import build

    me, procs = start(model_path, options, timeout)
    try:
        rss_before = _rss()[0]
        deployed = build(model_path, dataclasses.replace(options, dist=me))
        _built_barrier()
        memory = rank_memory(deployed, rss_before)
    except BaseException:
        stop_workers(procs, 0.1)
        # NOTE: a refused build (e.g. a weight this tensor_parallel_size cannot cut) leaves the
        # process able to build again: without this the next LLM(tensor_parallel_size=...) in it
        # fails with "trying to initialize the default process group twice"
        try:
            leave()
        except Exception:  # noqa: S110 - the build's own error is the one to raise
            pass
        raise
    if me.rank != 0:
        serve_worker(deployed)
        _parting_barrier()
        leave()
        return None
    # a vision-language target: rank 0's tower wrapper around the Leader (deploy/vlm.py), so
    # its steps reach the ranks as embeddings (`forward_embeds`)
    vision = hasattr(deployed, "image_features")
    leader = Leader(deployed.inner if vision else deployed, me, procs)
    leader.rank_memory = memory  # per rank: weight bytes at load and kept, RSS
    import atexit

    atexit.register(leader.close)  # before multiprocessing's own exit handler kills daemons
    if vision:
        deployed.inner = leader
        return deployed
    return leader


if __name__ == "__main__":
    worker_main(sys.argv[1:])
    # the group is left and nothing is pending: skip the interpreter's teardown (~1 s of
    # torch's module finalizers per rank, which rank 0's shutdown would wait for)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
