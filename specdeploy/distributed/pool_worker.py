"""A pooled worker process (distributed/pool.py starts it as
`python -m specdeploy.distributed.pool_worker FD`): it runs one rank's job after another, each
as a spawned worker would (`runtime.run_rank`), and reports each job's exit on descriptor FD.
Its own module so that pool.py (imported by runtime.start) never imports runtime."""
from __future__ import annotations

import json
import os
import sys

from specdeploy.distributed.runtime import _watch_parent, run_rank


def serve(results_fd: int) -> None:
    """A pooled worker's loop: one rank's job per line on stdin until EOF."""
    import threading
    import traceback

    import torch

    os.set_inheritable(results_fd, False)
    # the jobs come on a private descriptor: what a job starts (a compiler) gets no stdin
    jobs = os.fdopen(os.dup(0), "rb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(max(1, int(os.environ.get("SPECDEPLOY_WORKER_THREADS", "1"))))
    for line in jobs:
        rank, world, init_method, timeout, blob, env = json.loads(line)
        os.environ.clear()
        os.environ.update(env)
        try:
            run_rank(int(rank), int(world), init_method, float(timeout), blob)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os.write(results_fd, b"1\n")
            os._exit(1)  # a failed job leaves its group and state behind: never reused
        os.write(results_fd, b"0\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as a spawned worker: skip the interpreter's teardown
