"""Tensor / expert parallelism end to end: 2 ranks as real processes (gloo on 127.0.0.1).

Oracle: greedy output of the same checkpoint on one process (TP=1, no speculation), token for
token, over a batch of mixed prompt lengths; speculative runs also with drafts forced to the
oracle's tokens (all accepted: the mirrored `commit` path). Then a killed rank: the next step
fails with an error naming it within a bounded time, for `LLM` and for the server.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from specdeploy import LLM, SamplingParams
from specdeploy.deploy.passes.shard import param_bytes
from specdeploy.distributed.groups import free_port
from specdeploy.distributed.runtime import RankFailure
from tests.spec.tiny_targets import Target

# checkpoint_every=1: recurrent targets checkpoint at every page, so a short shared prefix hits
LIMITS = dict(max_batch_size=4, max_seq_len=160, max_cache_gib=0.05, page_size=8,
              checkpoint_every=1)
TOKENS = 10
K = 3


def _ids(outs):
    return [o.token_ids for o in outs]


def _params():
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            t = Target(arch, root)
            t.prompts = t.prompts[:3] + t.prompts[4:]  # lengths 1, 7, 33, 12
            llm = LLM(str(t.path), **LIMITS)
            t.baseline = _ids(llm.generate(t.prompts, _params()))
            t.baseline_bytes = param_bytes(llm.deployed.gm)
            t.loaded_bytes = llm.deployed.load_stats["load_peak_bytes"]  # the whole model
            llm.reset_prefix_cache()
            t.shared_cold = llm.generate([SHARED[1]], _lp_params())[0]
            t.prompt_lp = llm.generate([t.prompts[2]], _plp_params())[0].prompt_logprobs
            cache[arch] = t
        return cache[arch]

    return get


_PREFIX = [(7 * i) % 90 + 5 for i in range(43)]  # 5 pages and 3 tokens: a hit mid-page
SHARED = (_PREFIX + [11, 12, 13, 14, 15, 16, 17, 18, 19], _PREFIX + [21, 22, 23, 24, 25, 26])


def _check_rank_memory(t, ranks):
    """Per-rank loading: each rank held its share of the checkpoint's weights while loading
    (plus one whole tensor being sliced), never the whole model. Llama's share is exact: the
    embedding and norms replicated, everything else (vocab-parallel head included) halved."""
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["load_peak_bytes"] < 0.75 * t.loaded_bytes, (r, t.loaded_bytes)
    if t.arch != "llama":
        return
    from specdeploy.loading import load_model

    sizes = {n: p.numel() * p.element_size() for n, p in load_model(t.path).named_parameters()}
    replicated = sum(b for n, b in sizes.items() if "embed_tokens" in n or "norm" in n)
    share = replicated + (sum(sizes.values()) - replicated) // 2
    assert share < 0.75 * sum(sizes.values())
    for r in ranks:
        assert r["load_resident_bytes"] == share
        assert share <= r["load_peak_bytes"] <= share + max(sizes.values())


def _lp_params():
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)


def _plp_params():
    return SamplingParams(max_tokens=2, prompt_logprobs=0)


def _check_prompt_logprobs(llm, t):
    """The prompt's logprobs (every row of a prefill chunk, engine/prompt_logprobs.py) under
    TP equal TP=1's within 1e-4 (fp32; the row-parallel reductions sum in another order)."""
    got = llm.generate([t.prompts[2]], _plp_params())[0].prompt_logprobs
    assert len(got) == len(t.prompt_lp) == len(t.prompts[2]) and got[0] is None
    for i, (a, b) in enumerate(zip(got[1:], t.prompt_lp[1:])):
        tok = t.prompts[2][i + 1]
        assert abs(a[tok] - b[tok]) < 1e-4, (i, a, b)


def _check_prefix_hits(llm, want):
    """Prefix caching under TP: the second prompt hits the first's pages (and, on recurrent
    targets, restores checkpointed states on every rank) and answers as the TP=1 cold run:
    the same tokens and their logprobs within 1e-4 (a tiny random model's greedy tokens barely
    move with a stale state on one rank; its logprobs move by ~1e-3)."""
    llm.reset_prefix_cache()
    llm.generate([SHARED[0]], _params())
    before = llm.stats()["prefix_cache_hits"]
    got = llm.generate([SHARED[1]], _lp_params())[0]
    assert llm.stats()["prefix_cache_hits"] - before == 40  # the 5 full shared pages
    assert got.token_ids == want.token_ids
    lp = [d[i] for d, i in zip(got.logprobs, got.token_ids)]
    ref = [d[i] for d, i in zip(want.logprobs, want.token_ids)]
    assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4, (lp, ref)


def _oracle(t):
    by_prompt = {tuple(p): b for p, b in zip(t.prompts, t.baseline)}

    def propose(seq, k):
        cont = by_prompt[tuple(seq.prompt_ids)]
        return (cont[len(seq.output_ids):len(seq.output_ids) + k] + [3] * k)[:k]

    return propose


CASES = [  # arch, speculation, tp, ep
    ("llama", True, 2, 1),
    ("nemotron_h", False, 2, 2),
    ("nemotron_h", True, 2, 1),
    ("qwen3_5_moe", False, 2, 1),
    ("qwen3_5_moe", True, 2, 2),
]


@pytest.mark.parametrize("arch,spec,tp,ep", CASES,
                         ids=[f"{a}-{'spec' if s else 'plain'}-tp{t}ep{e}" for a, s, t, e in CASES])
def test_tp2_greedy_equals_tp1(targets, arch, spec, tp, ep):
    t = targets(arch)
    # speculation with SpecConfig's default cost controller (calibrated over mirrored forwards)
    llm = LLM(str(t.path), spec=t.spec(K, "cost") if spec else None, tensor_parallel_size=tp,
              expert_parallel_size=ep, dist_timeout=30, **LIMITS)
    try:
        assert _ids(llm.generate(t.prompts, _params())) == t.baseline
        _check_prompt_logprobs(llm, t)
        graph = llm.deployed.target.gm if spec else llm.deployed.gm
        assert param_bytes(graph) < 0.75 * t.baseline_bytes  # sharded: rank 0 holds ~half
        _check_rank_memory(t, llm.deployed.rank_memory)
        _check_prefix_hits(llm, t.shared_cold)
        if spec:
            llm.engine.reset_spec_stats()
            llm.engine.fix_drafts(_oracle(t))
            # the same prompts again: their cached pages hit (restored states on every rank)
            assert _ids(llm.generate(t.prompts, _params())) == t.baseline
            assert llm.stats()["mean_accepted_length"] > 2
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def kv3(tmp_path_factory):
    """6 query heads over 3 KV heads: on 2 ranks each keeps the KV heads of its 3 query heads."""
    from specdeploy.models import llama

    path = llama.make_tiny(tmp_path_factory.mktemp("kv3") / "m", config_overrides=dict(
        num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48))
    prompts = [[5, 9, 11] * n for n in (1, 9, 4)]
    return path, prompts, _ids(LLM(str(path), **LIMITS).generate(prompts, _params()))


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
    finally:
        llm.shutdown()
    assert worker.wait(10) == 0
    assert not dist.is_initialized()
    assert "group" not in CONTROL and collectives._GROUP[0] is None


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
        llm.shutdown()  # kills the stopped worker


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


def test_server_killed_rank_errors_and_exits(kv3):
    path, _, _ = kv3
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "serve", "--model", str(path), "--port", str(port),
         "--tensor-parallel-size", "2", "--dist-timeout", "10", "--max-seq-len", "160",
         "--max-batch-size", "4", "--max-cache-gib", "0.05", "--drain-timeout", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
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


def test_vision_language_target_on_two_ranks(targets, monkeypatch):
    """A VLM on 2 ranks: rank 0 runs the tower and the embedding and sends each step's input
    embeddings (the images' pixels left behind); image, video and text requests, plain and MTP
    (K drafts every step: mirrored verify steps and commits), give the one-process tokens."""
    from specdeploy.distributed import runtime
    from tests.vision.conftest import rand_image
    from tests.vision.video_util import rand_frames

    t = targets("qwen3_5_moe")
    prompts = ["describe <|vision_start|><|image_pad|><|vision_end|> now", "hello there",
               "two <|vision_start|><|image_pad|><|vision_end|> x "
               "<|vision_start|><|image_pad|><|vision_end|>",
               "clip <|vision_start|><|video_pad|><|vision_end|> then"]
    images = [[rand_image(40, 56, 1)], [], [rand_image(64, 32, 2), rand_image(30, 30, 3)], []]
    videos = [[], [], [], [(rand_frames(12, 24, 32, 4), {"fps": 6})]]
    opts = dict(LIMITS, max_num_tokens=16)  # prefill chunks split the images
    want = _ids(LLM(str(t.path), **opts).generate(prompts, _params(), images=images,
                                                  videos=videos))
    sent = []
    send = runtime.send

    def spy(msg):
        sent.extend(m for m in msg or () if m[0] == "forward_embeds")
        send(msg)

    monkeypatch.setattr(runtime, "send", spy)
    for spec in (None, t.spec(K)):
        llm = LLM(str(t.path), spec=spec, tensor_parallel_size=2, dist_timeout=30, **opts)
        try:
            assert hasattr(llm.deployed, "image_features")  # rank 0's tower, over the Leader
            assert _ids(llm.generate(prompts, _params(), images=images, videos=videos)) == want
            if spec is not None:
                assert llm.stats()["draft_steps"] > 0
        finally:
            llm.shutdown()
    assert sent and all(m[1][0].mm_rows is None for m in sent)  # no pixels went to rank 1


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
