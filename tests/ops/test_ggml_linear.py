"""The Q4_1 / Q8_0 / Q4_0 / Q5_0 / Q5_1 block kernels against `gguf`'s own dequantization (an
independent oracle): x @ W^T in float64 over gguf's fp32 weights. Plus batch invariance,
threads, bias, errors, and the fallbacks when the kernel cannot be built."""
from __future__ import annotations

import ctypes
import shutil
import threading

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KINDS = {"q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}

needs_kernel = pytest.mark.skipif(gl.kernel_unavailable() is not None,
                                  reason=f"ggml kernel unavailable: {gl.kernel_unavailable()}")


def _weight(kind: str, n: int, k: int, seed: int = 0):
    """(GGMLWeight, gguf's fp32 dequantization of the same blocks)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.1, 2.0, (n, 1)).astype(
        np.float32)
    raw = gguf.quants.quantize(w, KINDS[kind])
    deq = gguf.quants.dequantize(raw, KINDS[kind]).astype(np.float32)
    gw = gl.make_weight(kind, torch.from_numpy(np.ascontiguousarray(raw)), (n, k))
    return gw, torch.from_numpy(deq)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """fp32 sums in another order: each output within 1e-6 of sum_j |x_j w_j| (its condition
    scale; fp32 round-off over <= 1536 terms stays well below that)."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = ((y.double() - ref).abs() / scale).max().item()
    assert err < 1e-6, err


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (40, 64), (129, 576), (64, 1536)])
def test_kernel_matches_gguf_dequantization(kind, n, k):
    gw, w = _weight(kind, n, k, seed=n + k)
    g = torch.Generator().manual_seed(n)
    for rows in (1, 2, 3, 4, 5, 9, 16, 17):
        x = torch.randn(rows, k, generator=g)
        _check(gl.ggml_linear(x, gw), x, w)


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_batch_invariant_and_thread_invariant(kind):
    """A row's output is bit-identical alone and inside any batch, at 1 or 2 threads: a 1-row
    decode and a K + 1-row verify compute the same numbers."""
    gw, _ = _weight(kind, 200, 576, seed=1)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = gl.ggml_linear(x, gw)
            for rows in (1, 3, 4, 8):
                assert torch.equal(gl.ggml_linear(x[:rows], gw), full[:rows])
            assert torch.equal(torch.cat([gl.ggml_linear(x[i:i + 1], gw) for i in range(17)]),
                               full)
            outs.append(full)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_shapes_bias_and_strided_input():
    gw, w = _weight("q4_1", 24, 64, seed=2)
    b = torch.randn(24)
    x = torch.randn(2, 3, 128)[..., ::2]  # non-contiguous, 3-D
    y = gl.ggml_linear(x, gw, b)
    assert y.shape == (2, 3, 24)
    _check((y - b).reshape(6, 24), x.reshape(6, 64), w)
    assert gl.ggml_linear(torch.zeros(0, 64), gw).shape == (0, 24)
    with pytest.raises(ValueError, match="last dim 64"):
        gl.ggml_linear(torch.randn(2, 32), gw)
    with pytest.raises(ValueError, match="fp32"):
        gl.ggml_linear(torch.randn(2, 64, dtype=torch.float64), gw)


@needs_kernel
def test_concat_rows_equals_separate_calls():
    a, wa = _weight("q8_0", 16, 64, seed=3)
    b, wb = _weight("q8_0", 8, 64, seed=4)
    x = torch.randn(4, 64)
    both = gl.ggml_linear(x, gl.concat_rows([a, b]))
    assert torch.equal(both, torch.cat([gl.ggml_linear(x, a), gl.ggml_linear(x, b)], -1))
    c, _ = _weight("q4_1", 8, 64, seed=5)
    with pytest.raises(ValueError, match="mixed kinds"):
        gl.concat_rows([a, c])


def test_make_weight_checks_sizes():
    with pytest.raises(ValueError, match=r"uint8 \(4, 40\)"):
        gl.make_weight("q4_1", torch.zeros(4, 41, dtype=torch.uint8), (4, 64))
    with pytest.raises(ValueError, match="unsupported kind 'q8_k'.*q4_1"):  # (not a file type)
        gl.make_weight("q8_k", torch.zeros(4, 292, dtype=torch.uint8), (4, 256))
    with pytest.raises(ValueError, match=r"iq2_xs blocks for shape \(4, 64\)"):  # 256s only
        gl.make_weight("iq2_xs", torch.zeros(4, 36, dtype=torch.uint8), (4, 64))


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """An empty kernel cache and a cleared loader (restored afterwards)."""
    monkeypatch.setenv("SPECDEPLOY_CACHE_DIR", str(tmp_path))
    gl._library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    gl._library.cache_clear()


def test_switched_off_by_environment(fresh_library, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_GGML_KERNELS", "0")
    assert gl.kernel_unavailable() == "SPECDEPLOY_GGML_KERNELS=0"
    with pytest.raises(RuntimeError, match="unavailable: SPECDEPLOY_GGML_KERNELS=0"):
        gl.ggml_linear(torch.randn(1, 32), _weight("q8_0", 2, 32)[0])


def _kernel_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "specdeploy" and "cannot build" in r.getMessage()]


def test_compiler_failure_is_reported(fresh_library, monkeypatch, caplog):
    # as on an x86-64 Linux with AVX2 (where a compile is attempted), whatever this machine is
    monkeypatch.setattr(gl.platform, "system", lambda: "Linux")
    monkeypatch.setattr(gl.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gl, "_cpu_flags", lambda: set(gl._CPU_FLAGS))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("WARNING", logger="specdeploy"):
        why = gl.kernel_unavailable()
        gl.kernel_unavailable()  # cached: no second line
    assert why is not None and "failed" in why
    lines = _kernel_lines(caplog)
    assert len(lines) == 1 and "\n" not in lines[0]  # one visible line
    assert "cannot build the exact GGUF block kernel" in lines[0]
    assert list(fresh_library.glob("*.so")) == []  # nothing half-written left behind


def test_unsupported_cpu_warns_in_one_line(fresh_library, monkeypatch, caplog):
    """A CPU without AVX2 (or not x86-64) cannot run the kernel: one log line says so, where
    it used to fall back in silence."""
    monkeypatch.setattr(gl.platform, "system", lambda: "Linux")
    monkeypatch.setattr(gl.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gl, "_cpu_flags", lambda: {"sse2"})
    with caplog.at_level("WARNING", logger="specdeploy"):
        assert "lacks avx2" in gl.kernel_unavailable()
    lines = _kernel_lines(caplog)
    assert len(lines) == 1 and "lacks avx2" in lines[0] and "\n" not in lines[0]


@needs_kernel
def test_builds_into_the_cache_dir(fresh_library):
    assert gl.kernel_unavailable() is None
    assert len(list(fresh_library.glob("ggml_kernels-*.so"))) == 1


def test_quantize_q8_0_writes_ggufs_bytes():
    """quantize_q8_0 against gguf's own quantizer (an independent implementation): the same
    bytes, including all-zero blocks, tiny values and exact .5 ties before rounding."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g) * 3
    w[0, :32] = 0
    w[1, 5] = 1e-30
    w[2, :32] = torch.arange(32) - 12.7  # ties: x / d lands on .5 for some values
    w[3, :32] = torch.linspace(-127, 127, 32)
    got = gl.quantize_q8_0(w)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.blocks.numpy(), want.reshape(40, -1))
    deq = gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(gl.dequantize(got), torch.from_numpy(deq))
    with pytest.raises(ValueError, match="multiple of 32"):
        gl.quantize_q8_0(torch.zeros(4, 48))


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_concurrent_compiles_both_succeed(tmp_path):
    """Two pytest-xdist workers may build one kernel at once (a fresh cache): each compiles to
    its own temporary name and renames it into place, so both succeed, the library loads and
    no temporary is left behind."""
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    out = tmp_path / "cache" / "k.so"
    start, errors = threading.Barrier(2), ["did not finish"] * 2

    def build(i: int) -> None:
        start.wait()
        errors[i] = gl._compile(out, False, source=src, flags=["-O2", "-shared", "-fPIC"])

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [None, None]
    assert ctypes.CDLL(str(out)).answer() == 42
    assert list(out.parent.iterdir()) == [out]
