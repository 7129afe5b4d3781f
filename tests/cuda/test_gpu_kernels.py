"""The Triton kernels of ops/gpu_kernels.py against the torch refs they replace: RMSNorm, residual
add + RMSNorm, the SiLU-gated product, and a uniform step's attention from a fused q/k/v
projection (RoPE, the paged-cache writes, paged attention; decode and verify shapes, GQA,
partial rotary, odd cache lengths). The caches the kernels write are compared too.

On a CUDA device (`cuda` marker). Where Triton is installed but no GPU is, the same checks run
on the CPU under Triton's interpreter, in a subprocess (TRITON_INTERPRET must be set before
Triton is imported): `test_kernels_under_the_interpreter`. NOTE: Triton is not a test
dependency (torch.export imports it wherever it is installed: +46 MiB in every CPU deployment),
so CI skips that one; `pip install triton==3.6.0` in a dev venv runs it (~4 min, whole tiny
models of the three architectures on the kernels included, with the fused norm + linear on
and off)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdeploy.ops import gpu_kernels as gk
from specdeploy.ops.fused_rows import add_rms_norm_ref, silu_mul_ref
from specdeploy.ops.norm import rms_norm_ref
from specdeploy.ops.norm_linear import add_norm_linear_ref, norm_linear_ref
from specdeploy.ops.qkv_attention import qkv_attention_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the expected tensor's max


def _device_checks(fn):
    """The kernel checks: on CUDA (cuda marker), or under the interpreter (no marker)."""
    return fn if INTERPRETED else pytest.mark.cuda(fn)


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    """A kernel that fails must fail the test, not fall back to the torch ops quietly."""
    if not INTERPRETED and not torch.cuda.is_available():
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = False

    def fail(what, e, key="on"):
        raise AssertionError(f"the Triton {what} kernel failed") from e

    monkeypatch.setattr(gk, "_failed", fail)
    monkeypatch.setitem(gk._STATE, "on", True)  # off by default: these tests are what turn it on
    yield


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, tol: float | None = None
           ) -> None:
    assert got is not None and got.shape == want.shape and got.dtype == want.dtype
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    assert err <= (tol or TOL[dtype]) * max(want.double().abs().max().item(), 1e-6), err


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 96), (13, 200)])
def test_rms_norm_and_add(dtype, rows, n):
    x, b = (torch.randn(rows, n).to(dtype) for _ in range(2))
    w = torch.randn(n).to(dtype)
    want = rms_norm_ref(x, w, 1e-5)
    dev = [t.to(DEVICE) for t in (x, w, b)]
    _close(gk.rms_norm(dev[0], dev[1], 1e-5), want, dtype)
    total, normed = gk.add_rms_norm(dev[0], dev[2], dev[1], 1e-5)
    want_total, want_normed = add_rms_norm_ref(x, b, w, 1e-5)
    _close(total, want_total, dtype)
    _close(normed, want_normed, dtype)


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,extra", [(1, 1536, 0), (5, 37, 3), (3, 1100, 0)])
def test_silu_mul(dtype, rows, n, extra):
    x = torch.randn(rows, 2 * n + extra).to(dtype)
    _close(gk.silu_mul(x.to(DEVICE), n), silu_mul_ref(x, n), dtype)


def _norm_linear_case(rows, k, n, glu, add, bias, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, b = (torch.randn(rows, k, generator=g).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(2 * n if glu else n, k, generator=g) / k ** 0.5).to(dtype)
    bb = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
    return x, (b if add else None), nw, w, bb, (n if glu else 0)


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n,glu,add,bias", [
    (1, 576, 960, False, False, False), (1, 576, 1536, True, True, False),
    (4, 96, 40, True, True, False), (3, 200, 37, False, True, True),
    (2, 64, 2048, True, False, True), (2, 1500, 40, True, True, True)])  # K in 2 chunks
def test_norm_linear(dtype, rows, k, n, glu, add, bias, monkeypatch):
    """The fused RMSNorm (+ residual add) + linear (+ SiLU-gated product) against the chain's
    refs; the sum it writes equals torch's add (but under the interpreter, whose bf16 casts
    truncate)."""
    monkeypatch.setitem(gk._STATE, "gemv", True)
    x, b, nw, w, bb, glu = _norm_linear_case(rows, k, n, glu, add, bias, dtype)
    dev = [None if t is None else t.to(DEVICE) for t in (x, b, nw, w, bb)]
    got = gk.norm_linear(dev[0], dev[1], dev[2], 1e-5, dev[3], dev[4], glu)
    if b is None:
        assert got[0] is None
        want = norm_linear_ref(x, nw, 1e-5, w, bb, glu)
    else:
        want_total, want = add_norm_linear_ref(x, b, nw, 1e-5, w, bb, glu)
        if INTERPRETED and dtype != torch.float32:  # its casts to bf16 truncate: 1 ulp
            _close(got[0], want_total, dtype)
        else:
            assert torch.equal(got[0].cpu(), want_total)
    # NOTE: the interpreter's truncating bf16 casts at the chain's five roundings (sum, norm,
    # gate, up, product) bias the result: 2.1% of the max against fp64 where the bf16 chain
    # itself is 0.5% off (measured on these cases); on a GPU they round to nearest
    _close(got[1], want, dtype, 3e-2 if INTERPRETED and dtype != torch.float32 else None)


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear_rows_do_not_depend_on_the_step(dtype, monkeypatch):
    """A row alone (a decode) and inside a verify step of 5 rows: the same bits (cuBLAS's
    kernels change with the row count; this one computes each row alone)."""
    monkeypatch.setitem(gk._STATE, "gemv", True)
    x, b, nw, w, _, glu = _norm_linear_case(5, 192, 96, True, True, False, dtype)
    dev = [t.to(DEVICE) for t in (x, b, nw, w)]
    total, out = gk.norm_linear(dev[0], dev[1], dev[2], 1e-5, dev[3], None, glu)
    for i in range(5):
        one = gk.norm_linear(dev[0][i:i + 1], dev[1][i:i + 1], dev[2], 1e-5, dev[3], None, glu)
        assert torch.equal(one[1], out[i:i + 1]) and torch.equal(one[0], total[i:i + 1]), i


@_device_checks
def test_norm_linear_leaves_what_it_does_not_take(monkeypatch):
    """More rows than GEMV_ROWS (prefill chunks: cuBLAS), another dtype, off: None."""
    x, b, nw, w, _, _ = _norm_linear_case(gk.GEMV_ROWS + 1, 64, 32, False, True, False,
                                          torch.float32)
    dev = [t.to(DEVICE) for t in (x, b, nw, w)]
    monkeypatch.setitem(gk._STATE, "gemv", True)
    assert gk.norm_linear(dev[0], dev[1], dev[2], 1e-5, dev[3], None, 0) is None
    assert gk.norm_linear(dev[0][:2], None, dev[2], 1e-5, dev[3].double(), None, 0) is None
    assert gk.norm_linear(dev[0][:2], None, dev[2], 1e-5, dev[3], None, 0) is not None
    monkeypatch.setitem(gk._STATE, "gemv", False)
    assert gk.norm_linear(dev[0][:2], None, dev[2], 1e-5, dev[3], None, 0) is None


def _attention_case(n: int, hq: int, hkv: int, d: int, r: int, dtype: torch.dtype):
    """S = 3 sequences of n queries each at odd cache lengths, pages scattered in the cache."""
    ps, pages, width = 16, 40, 4
    lens = torch.tensor([5, 33, 17])
    s = lens.shape[0]
    table = torch.randperm(pages - 1)[: s * width].view(s, width)
    kc, vc = (torch.randn(pages, ps, hkv, d).to(dtype) for _ in range(2))
    qkv = torch.randn(1, s * n, (hq + 2 * hkv) * d + 3).to(dtype)
    pos = (lens[:, None] + torch.arange(n)).reshape(-1)
    freqs = pos[:, None].float() / 10000 ** (torch.arange(0, r, 2).float() / r)
    emb = torch.cat((freqs, freqs), -1)
    slot = table[torch.arange(s).repeat_interleave(n), pos // ps] * ps + pos % ps
    cu = torch.arange(0, s * n + 1, n)
    return (qkv, emb.cos()[None], emb.sin()[None], kc, vc, cu, lens, table, slot)


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hq,hkv,d,r", [(1, 9, 3, 64, 64), (4, 6, 2, 32, 16),
                                          (3, 4, 4, 64, 64)])
def test_qkv_attention_uniform_steps(dtype, n, hq, hkv, d, r):
    qkv, cos, sin, kc, vc, cu, lens, table, slot = _attention_case(n, hq, hkv, d, r, dtype)
    kc_want, vc_want = kc.clone(), vc.clone()
    want = qkv_attention_ref(qkv, cos, sin, kc_want, vc_want, cu, cu, lens, lens, table,
                             d ** -0.5, 0, slot, hq, hkv, d)
    dev = [t.to(DEVICE) for t in (qkv, cos, sin, kc, vc, table, lens, slot)]
    got = gk.qkv_attention(dev[0], dev[1], dev[2], dev[3], dev[4], cu, lens, dev[5], dev[6],
                           d ** -0.5, 0, dev[7], hq, hkv, d)
    _close(got, want, dtype)
    _close(dev[3], kc_want, dtype)
    _close(dev[4], vc_want, dtype)


@_device_checks
def test_other_steps_are_left_to_torch():
    """Prefill chunks and mixed steps (not uniform), sliding windows: None (the torch chain)."""
    qkv, cos, sin, kc, vc, cu, lens, table, slot = _attention_case(2, 4, 2, 32, 32,
                                                                   torch.float32)
    dev = [t.to(DEVICE) for t in (qkv, cos, sin, kc, vc, table, lens, slot)]
    ragged = torch.tensor([0, 1, 3, 6])
    args = (dev[0], dev[1], dev[2], dev[3], dev[4])
    assert gk.qkv_attention(*args, ragged, lens, dev[5], dev[6], 0.1, 0, dev[7], 4, 2, 32) is None
    assert gk.qkv_attention(*args, cu, lens, dev[5], dev[6], 0.1, 8, dev[7], 4, 2, 32) is None


@pytest.mark.skipif(not INTERPRETED, reason="whole models under Triton's interpreter only "
                    "(on a GPU the cuda tests run them with SPECDEPLOY_TRITON=1)")
@pytest.mark.parametrize("gemv", [False, True], ids=["chains", "gemv"])
@pytest.mark.parametrize("arch", ["llama", "nemotron_h", "qwen3_5_moe"])
def test_whole_model_greedy_spec_equals_plain_on_the_kernels(arch, gemv, tmp_path,
                                                              monkeypatch):
    """A tiny model's steps on these kernels (CPU tensors, interpreted): greedy EAGLE-3 / MTP
    K=3 through the graph runner's padded steps (verify rows of 4, the drafter's chain fed on the
    device, catch-ups replayed) and decode bursts give plain's tokens, and plain on the kernels
    gives the torch ops' tokens (fp32). `gemv`: with the fused norm + linear kernel on too."""
    from specdeploy.ops import _triton_src
    from tests.engine.test_cuda_graphs import _greedy
    from tests.spec.tiny_targets import Target

    monkeypatch.setitem(gk._STATE, "gemv", gemv)
    calls = []
    for name in ("paged_attention", "rms_norm_rows", "silu_mul_rows", "norm_linear_rows"):
        launch = getattr(_triton_src, name)
        monkeypatch.setattr(_triton_src, name,
                            lambda *a, _f=launch, _n=name: calls.append(_n) or _f(*a))
    target = Target(arch, tmp_path)
    gk.set_enabled(False)
    want, _ = _greedy(target, runner=False)
    gk.set_enabled(True)
    plain, _ = _greedy(target, runner=True)
    spec, _ = _greedy(target, runner=True, spec=3, drafts=True)
    assert "rms_norm_rows" in calls  # the kernels ran; the Llama's attention too
    assert ("norm_linear_rows" in calls) == gemv
    assert arch != "llama" or "paged_attention" in calls
    assert plain == want
    assert spec == want
    from specdeploy import SamplingParams
    from tests.engine.test_decode_burst import run

    burst, _ = run(target, 4, [SamplingParams(max_tokens=16, ignore_eos=True)] * 3)
    assert [ids for ids, _ in burst] == want  # decode bursts on the kernels


def test_kernels_under_the_interpreter():
    """This file's checks on the CPU under Triton's interpreter (where Triton is installed)."""
    if INTERPRETED:
        pytest.skip("already under the interpreter")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "-k", "not interpreter"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@_device_checks
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_the_step(dtype):
    """Greedy speculation is lossless only if a query's attention is bit-identical alone (a
    decode, n = 1) and inside a verify step (n = 4), whatever the page table's width: the
    split-key kernel's chunks are fixed by position, its combine adds exact zeros past them."""
    hq, hkv, d = 6, 2, 64
    qkv, cos, sin, kc, vc, cu, lens, table, slot = _attention_case(4, hq, hkv, d, d, dtype)
    dev = [t.to(DEVICE) for t in (qkv, cos, sin, kc, vc, table, lens, slot)]
    verify = gk.qkv_attention(*dev[:5], cu, lens, dev[5], dev[6], d ** -0.5, 0, dev[7],
                              hq, hkv, d)
    for i in range(4):  # query i of each sequence again, alone, with a wider table
        rows = torch.arange(3) * 4 + i
        wide = torch.cat([table, torch.full((3, 3), 39)], 1).to(DEVICE)
        one = gk.qkv_attention(dev[0][:, rows.to(DEVICE)], dev[1][:, rows.to(DEVICE)],
                               dev[2][:, rows.to(DEVICE)], *dev[3:5], torch.arange(4),
                               lens + i, wide, (lens + i).to(DEVICE), d ** -0.5, 0,
                               dev[7][rows.to(DEVICE)], hq, hkv, d)
        assert torch.equal(one[0], verify[0, rows.to(DEVICE)]), i


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "nemotron_h", "qwen3_5_moe"])
def test_fused_norm_linear_greedy_spec_equals_plain_on_cuda(arch, tmp_path, monkeypatch):
    """With the fused norm + linear on (CUDA graphs captured over it, fp32): greedy EAGLE-3 /
    MTP K=3 gives plain's tokens, and plain gives the unfused graph's (cuBLAS) tokens."""
    from specdeploy.ops import _triton_src
    from tests.engine.test_cuda_graphs import _greedy
    from tests.spec.tiny_targets import Target

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    calls = []
    launch = _triton_src.norm_linear_rows
    monkeypatch.setattr(_triton_src, "norm_linear_rows",
                        lambda *a: calls.append(1) or launch(*a))
    target = Target(arch, tmp_path)
    want, _ = _greedy(target, runner=True, device="cuda", dtype="float32")
    monkeypatch.setitem(gk._STATE, "gemv", True)
    plain, _ = _greedy(target, runner=True, device="cuda", dtype="float32")
    spec, _ = _greedy(target, runner=True, device="cuda", dtype="float32", spec=3, drafts=True)
    assert calls  # the fused kernel ran (at capture)
    assert plain == want
    assert spec == want
