"""distributed/pool.py: reused worker processes (tests/conftest.py turns them on).

Oracle: the one-process tokens of the same checkpoint. A pooled worker serves one deployment
after another in the same process; a job that was stopped or failed never hands its process
on; another environment gets another worker.
"""
from __future__ import annotations

import pytest

from specdeploy import LLM
from specdeploy.distributed import pool
from specdeploy.distributed.runtime import RankFailure
from tests.distributed.test_tp_runtime import LIMITS, _ids, _params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specdeploy.models import llama

    path = str(llama.make_tiny(tmp_path_factory.mktemp("pool") / "m"))
    prompts = [[5, 9, 11] * n for n in (1, 9)]
    return path, prompts, _ids(LLM(path, **LIMITS).generate(prompts, _params()))


@pytest.fixture(autouse=True)
def pooled(monkeypatch):
    monkeypatch.setenv(pool.ENV, "1")


def _deploy(path):
    return LLM(path, tensor_parallel_size=2, dist_timeout=20, **LIMITS)


def _alive(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] not in "ZX"


def test_a_worker_serves_one_deployment_after_another(tiny):
    path, prompts, want = tiny
    pids = []
    for _ in range(2):
        llm = _deploy(path)
        try:
            (job,) = llm.deployed._workers
            assert isinstance(job, pool.PooledRank) and job.poll() is None
            assert _ids(llm.generate(prompts, _params())) == want
        finally:
            llm.shutdown()
        assert job.wait(5) == 0 and job.poll() == 0  # the job ended; its process waits on
        job.kill()  # an ended job's process is no longer its to stop
        assert _alive(job.pid)
        pids.append(job.pid)
    assert pids[0] == pids[1]


def test_a_killed_job_fails_the_step_and_its_process_is_not_reused(tiny):
    path, prompts, _ = tiny
    llm = _deploy(path)
    try:
        (job,) = llm.deployed._workers
        job.kill()
        assert job.wait(1) == -9
        with pytest.raises(RankFailure, match=r"rank 1 exited \(code -9\)"):
            llm.generate(prompts, _params())
    finally:
        llm.shutdown()
    assert all(w.proc.pid != job.pid for ws in pool._IDLE.values() for w in ws)


def test_another_environment_gets_other_workers(monkeypatch):
    """Keyed by the environment, but for what changes as a process goes (the first deployment
    in a process sets TORCHINDUCTOR_CACHE_DIR; pytest names each test in PYTEST_CURRENT_TEST):
    the workers spawned before still fit."""
    key = pool._key()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    assert pool._key() == key
    monkeypatch.setenv("SPECDEPLOY_POOL_TEST_MARK", "1")
    assert pool._key() != key
