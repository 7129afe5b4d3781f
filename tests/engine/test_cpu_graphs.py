"""CPU graphs (engine/cpu_graphs.py): decode and verify steps recorded once per bucket and replayed
give the eager steps' tokens (the oracle: the same model with `cpu_graphs=False`) on the hybrid
MoE GGUFs and a Llama GGUF, plain and speculative, batches shrinking through the buckets, and on
the tiny fp32 checkpoints with their drafters; and a capture refuses what a replay could not
reproduce."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.engine.cpu_graphs import CaptureRefused, CpuGraph
from specdeploy.ops import ggml_int, row_kernels
from specdeploy.ops.ggml_linear import kernel_unavailable
from specdeploy.ops.replay_state import capturing, reads_allowed

Q = pytest.importorskip("tests.checkpoint.test_gguf").Q
pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(
    kernel_unavailable() is not None or ggml_int.kernel_unavailable() is not None,
    reason=f"ggml kernels unavailable: {kernel_unavailable() or ggml_int.kernel_unavailable()}")
LIMITS = dict(max_batch_size=3, max_seq_len=96, max_cache_gib=0.05)


@pytest.fixture(scope="module", params=["nemotron", "qwen3_5", "llama"])
def gguf(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        from specdeploy.models import llama
        from tests.deploy.test_fuse_layer import _tiny_llama_gguf

        src = llama.make_tiny(d / "st", seed=11, config_overrides={"num_hidden_layers": 2})
        return src, _tiny_llama_gguf(src, d / "tiny.gguf", Q.Q8_0)
    from tests.deploy.test_fast_rows_invariant import _nemotron, _qwen

    writer = {"nemotron": _nemotron, "qwen3_5": _qwen}[request.param]
    return None, writer(d, Q.Q8_0, Q.Q8_0)


def _llm(gguf, monkeypatch, **kw):
    src, path = gguf
    if src is not None:  # the tiny Llama GGUF has no vocabulary: its source's tokenizer
        from specdeploy import tokenizer as tok_mod

        real = tok_mod.load_tokenizer
        monkeypatch.setattr(tok_mod, "load_tokenizer", lambda p: real(src))
    return LLM(str(path), **LIMITS, **kw)


_SHARED: dict = {}


def _shared_llm(gguf, monkeypatch, cpu_graphs: bool):
    """The eager / CPU-graph LLM of a case, built once for the tests below that only generate
    on it (export is most of their time)."""
    key = (str(gguf[1]), cpu_graphs)
    if key not in _SHARED:
        _SHARED[key] = _llm(gguf, monkeypatch, cpu_graphs=cpu_graphs)
    return _SHARED[key]


def _runner(llm):
    return getattr(llm.deployed, "target", llm.deployed).graph_runner


PROMPTS = [[5, 6, 7, 8] * 5, [9, 4] * 3 + [9], list(range(10, 40))]
# different lengths: the batch shrinks from 3 (bucket 4) through 2 to 1 sequence
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 24, 30)]


@needs_kernels
def test_replayed_steps_give_the_eager_tokens(gguf, monkeypatch):
    eager = _shared_llm(gguf, monkeypatch, cpu_graphs=False)
    assert _runner(eager) is None
    want = [o.token_ids for o in eager.generate(PROMPTS, PARAMS)]
    graphs = _shared_llm(gguf, monkeypatch, cpu_graphs=True)
    runner = _runner(graphs)
    replays = runner.replays
    got = [o.token_ids for o in graphs.generate(PROMPTS, PARAMS)]
    assert got == want
    assert runner.refused == {}, runner.refused
    # buckets 4, 2 and 1 at least
    assert runner.replays - replays >= 25 and len(runner._graphs) >= 3
    # a second run on the same recordings (the caches' pages now elsewhere)
    assert [o.token_ids for o in graphs.generate(PROMPTS[::-1], PARAMS[::-1])] == [
        o.token_ids for o in eager.generate(PROMPTS[::-1], PARAMS[::-1])]


@needs_kernels
def test_speculative_steps_with_graphs_give_the_plain_tokens(gguf, monkeypatch):
    plain = _shared_llm(gguf, monkeypatch, cpu_graphs=False)
    want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    spec = SpecConfig("ngram", 3, prompt_lookup_num_tokens=4, controller="off")
    fast = _llm(gguf, monkeypatch, spec=spec, cpu_graphs=True)
    assert [o.token_ids for o in fast.generate(PROMPTS, PARAMS)] == want
    # drafts every step (mostly rejected): uniform verify steps
    fast.engine.fix_drafts(lambda seq, n: [7] * n)
    assert [o.token_ids for o in fast.generate(PROMPTS, PARAMS)] == want
    runner = _runner(fast)
    assert runner.refused == {}, runner.refused
    verify = sum(v for k, v in runner.replays_by_tokens.items() if k > 1)
    assert verify > 10, runner.replays_by_tokens  # verify steps replayed


@needs_kernels
def test_kernel_calls_in_one_c_loop_give_the_ctypes_bits(gguf, monkeypatch):
    """A recorded decode step replayed with its runs of kernel calls in one C loop each
    (ops/replay_calls.py) gives the logits and cache bits of the same recording made call by
    call through ctypes, from the same caches."""
    from specdeploy.engine import cpu_graphs as cg

    llm = _shared_llm(gguf, monkeypatch, cpu_graphs=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    runner = _runner(llm)
    cap = runner._graphs[next(k for k in runner._graphs if k[:2] == (1, 1))]
    batched = cap.graph.events
    if not any(e[0] == cg._BATCH for e in batched):
        pytest.skip("the C replay loop is not built here")
    unrolled = []
    for e in batched:
        if e[0] != cg._BATCH:
            unrolled.append(e)
            continue
        unrolled += [(cg._STRUCT_CALL, f, a, r, tuple(st)) if st else (cg._CALL, f, a, r, None)
                     for f, a, r, st in e[4].recorded]
    gm = runner.target.gm
    before = [b.clone() for b in gm.buffers()]
    outs = []
    for events in (batched, unrolled):
        for b, saved in zip(gm.buffers(), before):
            b.copy_(saved)
        cap.graph.events = events
        with torch.inference_mode():
            cap.graph.replay()
        outs.append([t.clone() for t in cap.out] + [b.clone() for b in gm.buffers()])
    cap.graph.events = batched
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@needs_kernels
def test_default_on_the_cpu_and_off_when_eager(gguf, monkeypatch):
    assert _runner(_llm(gguf, monkeypatch)) is not None
    assert _runner(_llm(gguf, monkeypatch, cuda_graphs=False)) is None  # --enforce-eager
    monkeypatch.setenv("SPECDEPLOY_CPU_GRAPHS", "0")
    assert _runner(_llm(gguf, monkeypatch)) is None


@pytest.fixture(scope="module", params=["llama", "nemotron_h", "qwen3_5_moe"])
def fp32_target(request, tmp_path_factory):
    from tests.spec.tiny_targets import Target

    return Target(request.param, tmp_path_factory.mktemp("fp32"))


def test_fp32_safetensors_targets_replay_plain_and_with_their_drafters(fp32_target):
    """The tiny fp32 checkpoints (torch recurrent paths, whose ops read on the host only
    whether each sequence continues a cached state; their EAGLE-3 / MTP drafters): decode,
    verify and drafter steps replay, and greedy tokens are the eager deployment's."""
    from tests.spec.tiny_targets import LIMITS as TINY

    t = fp32_target
    prompts, params = t.prompts[:3], [SamplingParams(max_tokens=n, ignore_eos=True)
                                      for n in (12, 20, 16)]
    eager = LLM(str(t.path), cpu_graphs=False, **TINY)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    plain = LLM(str(t.path), **TINY)
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    runner = _runner(plain)
    assert runner.refused == {} and runner.replays >= 15, (runner.replays, runner.refused)
    spec = LLM(str(t.path), spec=t.spec(2), **TINY)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    runner = _runner(spec)
    assert runner.refused == {} and runner.replays_by_tokens[3] > 0, runner.replays_by_tokens
    drafts = [d.graph_runner for d in spec.deployed.drafts]
    assert sum(r.replays for r in drafts) > 0 and not any(r.refused for r in drafts)


def test_replayed_steps_make_no_metadata_tensors(fp32_target, monkeypatch):
    """A replayed decode / verify / drafter step reads its metadata's host lists only: no
    tensor of it is made (cache/metadata.py, lazily; ~30-50 us a step here)."""
    from specdeploy.cache import metadata
    from specdeploy.engine import cpu_graphs
    from tests.spec.tiny_targets import LIMITS as TINY

    t = fp32_target
    recorded, program = set(), cpu_graphs._program
    monkeypatch.setattr(cpu_graphs, "_program", lambda events: recorded.update(
        str(e[1]) for e in events if e[0] != 2) or program(events))  # (2: a C call)
    llm = LLM(str(t.path), spec=t.spec(2), **TINY)
    llm.generate(t.prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # (captures)
    made = []
    real = metadata._materialize
    monkeypatch.setattr(metadata, "_materialize", lambda m: made.append(m.num_tokens) or real(m))
    runner = _runner(llm)
    before = runner.replays
    llm.generate(t.prompts[1:2], SamplingParams(max_tokens=16, ignore_eos=True))
    # the prompt's prefill (target and drafter catch-up) and at most one new capture make
    # them; each replayed step (>= 14: the target's and the drafter chain's) did before
    assert runner.replays - before >= 10 and len(made) <= 3, (runner.replays - before, made)
    # RoPE's cos / sin are one C call in the replay (ops/rope.py), not ~7-11 torch ops
    assert recorded and not recorded & {"aten.cos.default", "aten.sin.default"}, recorded


def test_required_off_the_cpu_is_refused():
    with pytest.raises(ValueError, match="cpu_graphs"):
        LLM(None, cpu_graphs=True, device="cuda")


# ---- CpuGraph itself ------------------------------------------------------------------------
def test_replay_recomputes_torch_ops_on_new_inputs():
    x, w = torch.zeros(4), torch.arange(4.0)
    g = CpuGraph()
    out = g.capture(lambda a: torch.add(a, w).mul(2.0), [x], [], [])
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    g.replay()
    assert torch.equal(out, (x + w) * 2)


def test_replay_remakes_kernel_calls():
    if row_kernels._library() is None:
        pytest.skip("row kernels unavailable")
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5

    def norm(a):
        return row_kernels.rms_norm(a, w, 1e-6)

    g = CpuGraph()
    out = g.capture(norm, [x], [], [w])
    x.copy_(torch.randn(2, 8))
    g.replay()
    assert torch.equal(out, row_kernels.rms_norm(x, w, 1e-6))


def _recorded_calls(g: CpuGraph) -> int:
    """Kernel calls a recording makes: one a call event, a batch's (ops/replay_calls.py)."""
    from specdeploy.engine import cpu_graphs as cg

    return sum(len(e[4].names) if e[0] == cg._BATCH else e[0] in (cg._CALL, cg._STRUCT_CALL)
               for e in g.events)


def test_captures_in_two_threads_each_record_their_own_calls():
    """The capture's hooks are process-wide: a second thread's capture waits for the first (one
    that ended while another ran removed the hooks under it: its later calls went unrecorded),
    and a thread that is not capturing is neither recorded nor told it is capturing."""
    if row_kernels._library() is None:
        pytest.skip("row kernels unavailable")
    w = torch.rand(8) + 0.5
    xa, xb, xc = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    inside, b_started, c_done = threading.Event(), threading.Event(), threading.Event()
    order, outs = [], {}

    def norm2(a):
        return row_kernels.rms_norm(row_kernels.rms_norm(a, w, 1e-6), w, 1e-6)

    def fa(a):
        y = row_kernels.rms_norm(a, w, 1e-6)
        inside.set()
        c_done.wait(10)  # B's capture and this thread's eager call happen meanwhile
        order.append("a")
        return row_kernels.rms_norm(y, w, 1e-6)

    def fb(b):
        order.append("b")
        return norm2(b)

    def run_b():
        b_started.set()
        outs["b"] = gb.capture(fb, [xb], [], [w])

    ga, gb = CpuGraph(), CpuGraph()
    ta = threading.Thread(target=lambda: outs.__setitem__("a", ga.capture(fa, [xa], [], [w])))
    ta.start()
    assert inside.wait(10)
    tb = threading.Thread(target=run_b)
    tb.start()
    assert b_started.wait(10)
    time.sleep(0.05)  # (B is waiting for A's capture to end)
    assert not capturing()
    want_c = norm2(xc)  # eager calls in a thread that is not capturing
    c_done.set()
    ta.join(10)
    tb.join(10)
    assert order == ["a", "b"]
    assert [_recorded_calls(g) for g in (ga, gb)] == [2, 2]
    assert torch.equal(want_c, norm2(xc))
    xa.copy_(torch.randn(2, 8))
    xb.copy_(torch.randn(2, 8))
    ga.replay()
    gb.replay()
    assert torch.equal(outs["a"], norm2(xa)) and torch.equal(outs["b"], norm2(xb))


def test_a_host_read_of_anything_but_a_static_input_refuses():
    x, s = torch.zeros(3, dtype=torch.long), torch.arange(4)
    with pytest.raises(CaptureRefused, match="tolist"):
        CpuGraph().capture(lambda a, b: torch.tensor(a.tolist()) + 1, [x, s], [s], [])
    with pytest.raises(CaptureRefused):  # a value read through a derived tensor
        CpuGraph().capture(lambda a, b: int((a + 1).sum()), [x, s], [s], [])
    if row_kernels._library() is not None:  # ... or through a kernel's output
        w = torch.ones(3)

        def via_kernel(a, b):
            return row_kernels.rms_norm(a.float()[None], w, 1e-6).tolist()

        with pytest.raises(CaptureRefused):
            CpuGraph().capture(via_kernel, [x, s], [s], [w])
    # a static input may be read (a view of one too); a read the caller vouches for is allowed
    CpuGraph().capture(lambda a, b: b[1:].tolist(), [x, s], [s], [])

    def vouched(a, b):
        with reads_allowed():
            return 0 in a.tolist()

    CpuGraph().capture(vouched, [x, s], [s], [])


def test_a_pointer_outside_what_a_replay_keeps_refuses():
    if row_kernels._library() is None:
        pytest.skip("row kernels unavailable")
    lib = row_kernels._library()
    x, w = torch.randn(1, 8), torch.ones(8)

    def temp_out(a):
        out = (ctypes.c_float * 8)()  # a host array nobody keeps
        lib.rms_norm_rows(a.data_ptr(), 1, 8, 8, w.data_ptr(), 1e-6, ctypes.addressof(out), 1)
        return a

    with pytest.raises(CaptureRefused, match="rms_norm_rows: argument 6"):
        CpuGraph().capture(temp_out, [x], [], [w])
