"""Reused worker processes for spawned ranks (opt-in: `SPECDEPLOY_WORKER_POOL=1`).

By default `runtime.start` spawns a fresh interpreter per worker rank, which imports torch and
specdeploy (~3 s on a 2-core CPU) and exports its model in a cold process. A process that
deploys on several ranks again and again (the test suite: tests/conftest.py sets the variable)
can keep its workers instead: a pooled worker runs one rank's job after another (build, serve,
leave the group: `runtime.run_rank`, what a spawned worker runs) and reports each job's exit
code, so later jobs skip the imports and reuse the worker's export cache (deploy/export_cache.py).

A job's `PooledRank` stands in for the `subprocess.Popen` of a spawned worker (`pid`, `poll`,
`wait`, `terminate`, `kill`): it "exits" when its job ends; stopping it stops the process, which
is then never reused, nor is one whose job failed (it exits). Workers are reused only by
processes of the same environment variables and working directory as the one that spawned
them (a variable may be read at import). They exit when their pool's process closes their
stdin (at exit, or when it dies) and, like spawned workers, when their parent is gone.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys

ENV = "SPECDEPLOY_WORKER_POOL"
# variables set as a process goes (by torch's inductor; by pytest, per test): not in the key
_SET_AS_IT_GOES = ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_", "TORCH_WARM_POOL",
                   "KMP_DUPLICATE_LIB_OK", "PYTEST_CURRENT_TEST")
_IDLE: dict[tuple, list[_Worker]] = {}  # (environment, cwd) -> workers waiting for a job


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class _Worker:
    """A pooled process: jobs go in on its stdin, one exit code per job comes back on a pipe."""

    def __init__(self):
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdeploy.distributed.pool_worker", str(w)],
                stdin=subprocess.PIPE, pass_fds=(w,))
        finally:
            os.close(w)
        self.results = r

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the process: EOF on its stdin (it exits between jobs), then signals."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.results)


class PooledRank:
    """One rank's job on a pooled worker, with the surface of that rank's `Popen`."""

    def __init__(self, worker: _Worker, key: tuple, job: list):
        self._worker, self._key = worker, key
        self.pid = worker.proc.pid
        self.returncode: int | None = None
        worker.proc.stdin.write((json.dumps(job) + "\n").encode())
        worker.proc.stdin.flush()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read(timeout):
            raise subprocess.TimeoutExpired(f"pooled worker {self.pid}", timeout)
        return self.returncode

    def _read(self, timeout: float | None) -> bool:
        """The job's exit code when it comes within `timeout` (then the worker goes back to
        the pool, unless the job failed); the process's own code when it died."""
        ready, _, _ = select.select([self._worker.results], [], [], timeout)
        if not ready:
            return False
        line = b""
        while not line.endswith(b"\n"):  # a one-line message: its rest is a moment away
            chunk = os.read(self._worker.results, 16)
            if not chunk:  # the process is gone: its result pipe closed
                self.returncode = self._worker.proc.wait()
                os.close(self._worker.results)
                return True
            line += chunk
        self.returncode = int(line)
        if self.returncode == 0:
            _IDLE.setdefault(self._key, []).append(self._worker)
        else:
            self._worker.close()
        return True

    def terminate(self) -> None:
        self._stop()

    def kill(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.poll() is None:  # a job that ended has given its worker back: leave it be
            self._worker.proc.kill()
            self._worker.proc.wait()
            self.returncode = self._worker.proc.returncode
            os.close(self._worker.results)


def start_ranks(world: int, init_method: str, timeout: float, blob: str) -> list[PooledRank]:
    """Ranks 1..world-1 of a group at `init_method`, on idle pooled workers (or new ones)."""
    key = _key()
    idle = _IDLE.setdefault(key, [])
    out = []
    for rank in range(1, world):
        while idle and not idle[-1].alive():
            idle.pop().close()
        worker = idle.pop() if idle else _Worker()
        out.append(PooledRank(worker, key, [rank, world, init_method, timeout, blob,
                                            dict(os.environ)]))
    return out


def _key() -> tuple:
    """Workers serve processes like the one that spawned them (a variable may be read at
    import), but for variables set as a process goes (each job runs in its caller's
    environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SET_AS_IT_GOES)}
    return tuple(sorted(env.items())), os.getcwd()


@atexit.register
def _close_all() -> None:
    for workers in _IDLE.values():
        for w in workers:
            w.close()
    _IDLE.clear()
