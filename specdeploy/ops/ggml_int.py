"""Integer-dot linears over GGUF Q4_1 / Q8_0 / Q4_0 blocks (and the K-quants): the "fast" kernels.

`ggml_linear.py`'s exact kernel expands every weight to fp32 and multiply-adds in fp32 (the same
fp32 model). This one does what llama.cpp does on a CPU: each input row is quantized to 8-bit
blocks of 32 values (one fp32 scale per block), the block dot products run in integers
(AVX2 `maddubs`, AVX-512 VNNI `dpbusd`) and only the per-block partial sums meet fp32. That is a
slightly different model: per block of 32 inputs an output moves by at most
    (d_x / 2) * sum_i |d_w * q_i|,   d_x = max |x_block| / 127
(the rounding of x to d_x * int8 times the weights' integer part; Q4_1's offset m multiplies the
exact fp32 block sum of x), plus fp32 round-off. `tests/ops/test_ggml_int.py` checks that bound.

One C file (`ggml_kernels_int.c`) holds a portable scalar path and the SIMD paths, each behind
a target attribute and chosen at run time from what the CPU reports (`supported_isas()`;
`SPECDEPLOY_GGML_ISA` forces one; see UNVERIFIED). All paths give bit-identical outputs, and a
row's output does not depend on the other rows or the thread count, so greedy speculative
decoding still equals greedy plain decoding within a deployment. Compiled on first use into
the same cache as the exact kernel; where it cannot be built, one warning says why and callers
keep the exact kernel (or fp32). `ggml_tiled.py` runs this model over weights repacked in tiles
of 16 outputs (several rows for little more than one); `ggml_linears` uses it wherever a kernel
call has N % 16 == 0 outputs and keeps this kernel for the others. MXFP4 has no kernel here
(INT_KINDS): it runs tiled, or on the exact kernel where it cannot.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.ggml_linear import KINDS, BlockCall, GGMLWeight

SOURCE = Path(__file__).with_name("ggml_kernels_int.c")
# NOTE: no -m flags: the SIMD functions carry their own targets; -ffp-contract=off keeps the
# scalar path's fp32 operations exactly the ones the SIMD paths perform
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
ISAS = ("scalar", "avx2", "avx512_vnni")  # the C file's ISA_* values, in order
# Paths written but not yet run on a CPU that has them, used only when SPECDEPLOY_GGML_ISA asks.
# avx512_vnni left this list on 2026-12-02: tests/ops/test_ggml_int.py passed on an AVX-512
# VNNI machine (bit-identical to scalar and AVX2, bounds, batch and thread invariance), and
# bench/linear_rows.py there gave 5.6 ms for 30 layers at 1 row against AVX2's 8.0 ms.
UNVERIFIED: tuple[str, ...] = ()
INT_KINDS = ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k",
             "q6_k", "iq4_xs", *_gl.IQ_KINDS)  # what ggml_kernels_int.c reads


def _check_kind(weight: GGMLWeight) -> None:
    if weight.kind not in INT_KINDS:
        raise ValueError(f"ggml_linear_int: no per-output integer kernel for {weight.kind} "
                         f"(kinds: {', '.join(INT_KINDS)}; mxfp4 runs on ggml_tiled or the exact "
                         "kernel)")


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDEPLOY_GGML_KERNELS", "1") == "0":
        return None, "SPECDEPLOY_GGML_KERNELS=0"
    # NOTE: a compiler without OpenMP still gets a 1-thread kernel (load_compiled's 2nd try)
    ptr, int_ = ctypes.c_void_p, ctypes.c_int
    lib, errors = _gl.load_compiled("ggml_kernels_int", SOURCE, _FLAGS, {
        "ggml_linear_int": ([int_, int_, ptr, int_, int_, ptr, int_, ptr, int_], int_),
        "ggml_int_isa_supported": ([int_], int_), "ggml_iq_init": ([ptr], None),
        "ggml_iq_as_xs": ([int_, ptr, ptr, ctypes.c_int64, ptr, int_], int_)})
    if lib is not None:
        from specdeploy.ops import ggml_iq

        ggml_iq.init(lib)
        return lib, None
    why = "; ".join(errors)
    _gl.warn_unbuilt("the integer-dot GGUF kernels", why)
    return None, why


def kernel_unavailable() -> str | None:
    """None when the integer kernels are built and loaded here, else why not."""
    return _library()[1]


def supported_isas() -> list[str]:
    """The ISA paths this build and this CPU run, slowest first (scalar is always there)."""
    lib, _ = _library()
    if lib is None:
        return []
    return [name for i, name in enumerate(ISAS) if lib.ggml_int_isa_supported(i)]


def default_isa() -> str:
    """SPECDEPLOY_GGML_ISA when set (an error naming the choices if this CPU cannot run it),
    else the fastest supported path not in UNVERIFIED."""
    have = supported_isas()
    if not have:
        raise RuntimeError(f"integer ggml kernels unavailable: {kernel_unavailable()}")
    want = os.environ.get("SPECDEPLOY_GGML_ISA")
    if want:
        if want not in have:
            raise ValueError(f"SPECDEPLOY_GGML_ISA={want!r}: this build / CPU runs "
                             f"{', '.join(have)}")
        return want
    return [isa for isa in have if isa not in UNVERIFIED][-1]


def ggml_linear_int(x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None = None,
                    isa: str | None = None) -> torch.Tensor:
    """`x[..., K] @ W^T (+ bias)` with W in GGUF blocks and x quantized per row to 8-bit blocks
    (see the module docstring for the error); x fp32 on the CPU."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"integer ggml kernels unavailable: {why}")
    _check_kind(weight)
    isa = default_isa() if isa is None else isa
    if isa not in ISAS:
        raise ValueError(f"isa: one of {', '.join(ISAS)}, got {isa!r}")
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"ggml_linear_int: x must be fp32 on the CPU with last dim {k}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    x2 = x.reshape(-1, k)
    x2 = (x2 if weight.gather is None else x2.index_select(1, weight.gather)).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        rc = lib.ggml_linear_int(KINDS[weight.kind][0], ISAS.index(isa), x2.data_ptr(),
                                 x2.shape[0], k, weight.blocks.data_ptr(), n, y.data_ptr(),
                                 torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"isa {isa!r}: this CPU / build runs {', '.join(supported_isas())}")
        if rc == -3:
            raise RuntimeError("ggml_linear_int: the IQ codebooks were not loaded (ggml_iq.init)")
        if rc != 0:
            raise MemoryError("ggml_linear_int: no scratch memory for the quantized rows")
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def bound_linear(weight: GGMLWeight, bias: torch.Tensor | None, isa: str):
    """`x -> ggml_linear_int(x, weight, bias, isa)` with everything that does not depend on x
    checked and looked up once: a decode step calls ~120 of these, where ggml_linear_int's
    per-call checks and lookups were a tenth of the kernel's own time. Inputs it does not take
    (not fp32 CPU, wrong width) go through ggml_linear_int, which names the problem."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"integer ggml kernels unavailable: {why}")
    if isa not in ISAS:
        raise ValueError(f"isa: one of {', '.join(ISAS)}, got {isa!r}")
    if not lib.ggml_int_isa_supported(ISAS.index(isa)):
        raise ValueError(f"isa {isa!r}: this CPU / build runs {', '.join(supported_isas())}")
    _check_kind(weight)
    fn, kind, isa_i = lib.ggml_linear_int, KINDS[weight.kind][0], ISAS.index(isa)
    n, k = weight.shape
    blocks = weight.blocks  # NOTE: the closure keeps the blocks alive for their pointer
    w_ptr, f32 = blocks.data_ptr(), torch.float32
    empty, threads = torch.empty, torch.get_num_threads

    gather = weight.gather

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not f32 or x.shape[-1] != k or x.device.type != "cpu":
            return ggml_linear_int(x, weight, bias, isa)
        if gather is not None:
            x = x.index_select(-1, gather)
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // k
        # NOTE: y in its final shape, no reshape / view: each torch call costs ~2 us here
        y = empty((*x.shape[:-1], n), dtype=f32)
        if rows and fn(kind, isa_i, x.data_ptr(), rows, k, w_ptr, n, y.data_ptr(), threads()):
            raise MemoryError("ggml_linear_int: no scratch memory for the quantized rows")
        if bias is not None:
            y += bias
        return y

    linear.blocks = blocks
    if gather is None:  # what a fused MoE block (ops/moe_block.py) needs to make this call
        linear.int_call = BlockCall(kind, isa_i, w_ptr, n, k, bias)
    return linear
