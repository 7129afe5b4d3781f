"""Tensor parallelism's process lifecycle and more families on 2 ranks (split from
test_tp_runtime.py so the two files run on both CI workers): shutdown, a killed or hung rank
(bounded errors naming it, for `LLM`, the server and torchrun), KV-head replication; dense
Qwen3.5, Qwen2 and Qwen3 on 2 ranks = one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import weakref

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.distributed.groups import free_port
from specdeploy.distributed.runtime import RankFailure
from tests.distributed.test_tp_runtime import LIMITS, TOKENS, _ids, _params


@pytest.fixture
def spawned_workers(monkeypatch):
    """The lifecycle tests run the production path: fresh worker processes (not
    tests/conftest.py's pooled ones), for `LLM` and for the server started here."""
    monkeypatch.delenv("SPECDEPLOY_WORKER_POOL", raising=False)


@pytest.fixture(scope="module")
def kv3(tmp_path_factory):
    """6 query heads over 3 KV heads: on 2 ranks each keeps the KV heads of its 3 query heads."""
    from specdeploy.models import llama

    path = llama.make_tiny(tmp_path_factory.mktemp("kv3") / "m", config_overrides=dict(
        num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48))
    prompts = [[5, 9, 11] * n for n in (1, 9, 4)]
    return path, prompts, _ids(LLM(str(path), **LIMITS).generate(prompts, _params()))


@pytest.mark.usefixtures("spawned_workers")
def test_shutdown_leaves_no_group_behind(kv3):
    """`shutdown` tears the groups down and drops every reference to them while the interpreter
    is whole (gloo objects left to interpreter finalization aborted a process now and then), and
    the worker leaves cleanly."""
    import torch.distributed as dist

    from specdeploy.distributed.groups import CONTROL
    from specdeploy.ops import collectives

    path, prompts, want = kv3
    llm = LLM(str(path), tensor_parallel_size=2, dist_timeout=10, **LIMITS)
    try:
        assert _ids(llm.generate(prompts, _params())) == want
        assert "group" in CONTROL and collectives._GROUP[0] is not None
        (worker,) = llm.deployed._workers
        assert isinstance(worker, subprocess.Popen)  # spawned: the production path
        groups = [weakref.ref(g) for g in (dist.group.WORLD, CONTROL["group"],
                                           collectives._GROUP[0])]
    finally:
        llm.shutdown()
    assert worker.wait(10) == 0
    assert not dist.is_initialized()
    assert "group" not in CONTROL and collectives._GROUP[0] is None
    assert all(g() is None for g in groups)  # gone now (gloo's threads with them)


def test_leave_collects_a_group_a_cycle_holds():
    """`leave` frees the groups at once, also one held by a reference cycle (it collects
    then; only then: a full collection of a large process takes ~0.5 s)."""
    import gc

    from specdeploy.distributed.groups import CONTROL, init_group, leave

    init_group(0, 1, f"tcp://127.0.0.1:{free_port()}", 10)
    cycle: list = [CONTROL["group"]]
    cycle.append(cycle)
    group = weakref.ref(CONTROL["group"])
    gc.disable()  # no automatic collection in between: leave's own must free it
    try:
        del cycle
        leave()
        assert group() is None
    finally:
        gc.enable()


@pytest.mark.usefixtures("spawned_workers")
def test_kv_replication_then_killed_rank(kv3):
    path, prompts, want = kv3
    llm = LLM(str(path), tensor_parallel_size=2, dist_timeout=10, **LIMITS)
    try:
        assert _ids(llm.generate(prompts, _params())) == want
        worker = llm.deployed._workers[0]
        worker.kill()
        worker.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            llm.generate(prompts, _params())
        assert time.monotonic() - t0 < 20
        with pytest.raises(RankFailure):  # stays failed, at once
            llm.generate(prompts, _params())
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("spawned_workers")
def test_hung_rank_times_out(kv3):
    """A stopped (not dead) worker: the next collective waits `dist_timeout`, then fails."""
    import signal

    path, prompts, want = kv3
    llm = LLM(str(path), tensor_parallel_size=2, dist_timeout=5, **LIMITS)
    try:
        assert _ids(llm.generate(prompts[:1], _params())) == want[:1]
        os.kill(llm.deployed._workers[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="collective timeout|rank 1"):
            llm.generate(prompts[:1], _params())
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()  # stops the stopped worker
    worker = llm.deployed._workers[0]
    assert worker.wait(5) == -signal.SIGTERM  # continued to act on it (not killed 2 s later)


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _post(port: int, body: dict, timeout: float = 30) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _ready(proc: subprocess.Popen, port: int, timeout: float = 240) -> str | None:
    """None once the server answers /health; else why not (its stderr's tail, or a timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.stderr.read().decode()[-2000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return None
        except OSError:
            time.sleep(1)
    return f"no answer on port {port} in {timeout} s"


@pytest.mark.usefixtures("spawned_workers")
def test_server_killed_rank_errors_and_exits(kv3):
    path, _, _ = kv3
    for attempt in range(3):  # a port free when picked may be taken by another test first
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdeploy", "serve", "--model", str(path), "--port",
             str(port), "--tensor-parallel-size", "2", "--dist-timeout", "10", "--max-seq-len",
             "160", "--max-batch-size", "4", "--max-cache-gib", "0.05", "--drain-timeout", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
        err = _ready(proc, port)
        if err is None:
            break
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
        assert "cannot listen" in err and attempt < 2, err  # (serve binds before loading)
    try:
        body = {"prompt": [5, 9, 11], "max_tokens": 4}
        assert _post(port, body) == 200
        (worker,) = _children(proc.pid)
        os.kill(worker, 9)
        assert _post(port, body) >= 500
        proc.wait(30)  # the server exits instead of serving with a rank missing
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


@pytest.mark.usefixtures("spawned_workers")
def test_torchrun_cli_generate(kv3):
    """`torchrun --nproc-per-node 2 -m specdeploy generate --tensor-parallel-size 2`: env://
    rendezvous, rank 1 serves inside `LLM` and exits; rank 0 prints the TP=1 tokens."""
    path, _, _ = kv3
    sp = SamplingParams(max_tokens=TOKENS)  # the CLI's greedy default (eos stops both alike)
    want = LLM(str(path), **LIMITS).generate("hello world", sp)[0].token_ids
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed next to this interpreter")
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
         "specdeploy", "generate", "--model", str(path), "--prompt", "hello world", "--json",
         "--max-tokens", str(TOKENS), "--max-seq-len", "160", "--max-cache-gib",
         "0.05", "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]  # rank 0 only
    assert json.loads(line)["token_ids"] == want


def test_dense_qwen3_5_on_two_ranks(tmp_path):
    """Dense Qwen3.5 (its MLP column- then row-sharded, the MoE family's other layers as
    before; MTP under TP: the MoE family's tests) on 2 gloo ranks: the one-process tokens."""
    from specdeploy.models import qwen3_5_moe as q35

    path = str(q35.make_tiny(tmp_path / "dense", seed=1,
                             hf_config=q35.tiny_hf_config(0, dense=True)))
    prompts = ["hello there", "a b c d"]
    want = _ids(LLM(path, **LIMITS).generate(prompts, _params()))
    llm = LLM(path, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert _ids(llm.generate(prompts, _params())) == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen2_qwen3_on_two_ranks(tmp_path, kind):
    """Qwen2's q/k/v biases split with their heads, Qwen3's per-head q/k norms replicated: 2
    ranks give the one-process tokens."""
    from specdeploy.models import llama

    path = str(llama.make_tiny(tmp_path / kind, seed=1,
                               config_overrides=llama.tiny_qwen_config(kind)))
    prompts = ["hello there", "a b c d"]
    want = _ids(LLM(path, **LIMITS).generate(prompts, _params()))
    llm = LLM(path, tensor_parallel_size=2, dist_timeout=30, **LIMITS)
    try:
        assert _ids(llm.generate(prompts, _params())) == want
    finally:
        llm.shutdown()
