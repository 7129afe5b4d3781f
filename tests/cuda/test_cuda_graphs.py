"""CUDA-graph replay of decode and verify steps (engine/cuda_graphs.py) on a device: greedy output
with graphs equals eager (and, speculating, plain), for the tiny attention, Mamba2-hybrid and
GDN-hybrid targets; and a replayed step makes no host sync.
Run by bench/gpu_check.sh on a GPU machine."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_cuda_graphs import _greedy
from tests.spec.tiny_targets import METHODS, Target

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=sorted(METHODS))
def target(request, tmp_path_factory) -> Target:
    return Target(request.param, tmp_path_factory.mktemp("cuda_graphs"))


def test_greedy_with_cuda_graphs_equals_eager(target):
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = _greedy(target, runner=False, device="cuda", dtype="float32")
    got, runner = _greedy(target, runner=True, device="cuda", dtype="float32")
    assert runner.capture and runner.replays >= 10 and runner._graphs
    assert got == want


def test_greedy_spec_with_cuda_graphs_equals_plain(target):
    """Fixed K = 3: the verify steps replay too (attention: `extend_uniform`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = _greedy(target, runner=False, device="cuda", dtype="float32")
    got, runner = _greedy(target, runner=True, device="cuda", spec=3, dtype="float32")
    assert any(key[2] == 1 for key in runner._graphs)  # a verify graph (SEG_EXTEND) replayed
    assert got == want


def test_replay_makes_no_host_sync(target):
    from specdeploy.cache.metadata import Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.engine.cuda_graphs import install
    from tests.spec.tiny_targets import LIMITS

    dep = build(str(target.path), vision=False, device="cuda", dtype="float32", **LIMITS)
    runner = install(dep, LIMITS["max_batch_size"])
    pages = list(range(3))
    dep_target = getattr(dep, "target", dep)
    for slot in range(3):
        dep_target.forward(build_metadata([Segment(list(range(3, 20)), 0, pages, slot)]))
    meta = build_metadata([Segment([5], 17, pages, s) for s in range(3)])
    runner.run(meta)  # captures bucket 4
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.run(meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.logits.shape[0] == 3


def test_greedy_spec_with_drafter_graphs_equals_plain(target):
    """The drafter programs' chain steps replayed too (`install(drafts=True)`, what `LLM`
    does on a CUDA device)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = _greedy(target, runner=False, device="cuda", dtype="float32")
    got, runner = _greedy(target, runner=True, device="cuda", spec=3, drafts=True,
                          dtype="float32")
    assert got == want
    drafts = [d.graph_runner for d in runner.test_drafts]
    assert drafts and sum(r.replays for r in drafts) >= 3
    assert all(r._graphs and all(c.hidden is not None for c in r._graphs.values())
               for r in drafts if r.replays)


def test_drafter_catch_ups_replay(target):
    """All-accepted (oracle) drafts: the drafter's catch-ups of 1 + K tokens replay as graphs
    (EXTEND steps of the drafter program) and greedy output stays plain's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = _greedy(target, runner=False, device="cuda", dtype="float32")
    got, runner = _greedy(target, runner=True, device="cuda", spec=3, drafts=True,
                          dtype="float32", oracle=want)
    assert got == want
    runners = [d.graph_runner for d in runner.test_drafts]
    assert sum(n for r in runners for k, n in r.replays_by_tokens.items() if k > 1) >= 3
    assert any(key[1] > 1 for r in runners for key in r._graphs)


def test_decode_bursts_equal_steps(target):
    """engine/decode_burst.py on the device: the argmax of step j fed to step j + 1 by a
    device-to-device copy into the graph's input buffer; the tokens of step-by-step decoding."""
    from specdeploy import SamplingParams
    from tests.engine.test_decode_burst import run

    torch.backends.cuda.matmul.allow_tf32 = False
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 7, 13)]
    want, steps = run(target, 1, params, device="cuda", dtype="float32")
    got, calls = run(target, 4, params, device="cuda", dtype="float32")
    assert got == want
    assert calls < steps - 6


def test_drafter_chain_on_the_device(target, monkeypatch):
    """The drafter chain fed on the device (no host sync between its steps) drafts what the
    host chain drafts, on a GPU, and greedy output stays plain's."""
    from tests.engine.test_cuda_graphs import chain_drafts_match

    torch.backends.cuda.matmul.allow_tf32 = False
    chain_drafts_match(target, monkeypatch, device="cuda", dtype="float32")


def test_deferred_catch_ups_in_pieces(target, monkeypatch):
    """The controller's deferred catch-ups replayed in pieces on a GPU: the last-row logits
    and hidden state of one eager forward (fp32, 1e-4), the same drafts."""
    from tests.engine.test_cuda_graphs import deferred_pieces_match

    torch.backends.cuda.matmul.allow_tf32 = False
    deferred_pieces_match(target, monkeypatch, device="cuda", dtype="float32")


def test_seeded_sampling_in_bursts_equals_steps(target):
    """Seeded sampled requests in decode bursts on the device: each request's CUDA generator
    drawn once a step, in order: step-by-step's tokens."""
    from specdeploy import SamplingParams
    from tests.engine.test_decode_burst import run

    torch.backends.cuda.matmul.allow_tf32 = False
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=1),
              SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.2, top_k=20,
                             top_p=0.9, seed=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, min_p=0.05,
                             seed=3)]
    want, steps = run(target, 1, params, device="cuda", dtype="float32")
    got, calls = run(target, 4, params, device="cuda", dtype="float32")
    assert got == want
    assert calls < steps - 4


def test_suffix_with_cuda_graphs_equals_plain(target, tmp_path):
    """method="suffix" (engine/suffix_store.py) on the device with graphs: a store of the
    plain replies drafts them back (verify widths vary step to step); the tokens are plain's."""
    from specdeploy import LLM, SamplingParams, SpecConfig
    from specdeploy.engine.suffix_store import SuffixStore
    from tests.spec.tiny_targets import LIMITS

    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", cuda_graphs=True, **LIMITS)
    plain = LLM(str(target.path), **kw)
    want = [o.token_ids for o in plain.generate(target.prompts, params)]
    SuffixStore.save(tmp_path / "store", want, plain.deployed.vocab_size)
    spec = LLM(str(target.path), spec=SpecConfig(
        "suffix", 3, suffix_store=str(tmp_path / "store"),
        suffix_decoding_max_cached_requests=0, controller="off"), **kw)
    assert [o.token_ids for o in spec.generate(target.prompts, params)] == want
    assert spec.stats()["store_steps"] > 0
