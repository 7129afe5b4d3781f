"""Integer-dot GGUF linears over weights repacked in tiles of 16 outputs (issue 21).

`ggml_int.py` runs the same model (x quantized per row to 8-bit blocks, exact integer block dot
products, fp32 scales; its error bound holds here) over the GGUF blocks as stored, one output
per accumulator, so R rows cost nearly R times one row and a speculative verify step of 1 + K
rows cost about two decode steps. Here (`ggml_tiled.c`, layout in its header) the weights are
repacked once, as llama.cpp does, so that one vector holds 16 outputs' sums and the unpacked
weights of a block serve a group of rows (AVX2: 5, Q8_0 4; AVX-512: 8): several rows cost
little more than one.

The packed copy replaces the blocks (same bytes; Q3_K 4 bytes more a super-block). Scalar C,
AVX2 and AVX-512 VNNI paths give bit-identical outputs (and so does AMX, which the AVX-512 path
hands steps of >= AMX_MIN_ROWS rows where the CPU has AMX-INT8: the tile unit makes the exact
integer block sums, the same fp32 operations follow), independent of the other rows and the
thread count, so greedy speculative decoding still equals greedy plain decoding. The outputs
are not those of `ggml_int` (the fp32 sums run in another order), so a deployment uses one
kernel per weight, at every row count.
Compiled on first use next to the other kernels; where it cannot be built, one warning says why
and callers keep `ggml_int`.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.ggml_int import ISAS
from specdeploy.ops.ggml_linear import KINDS, BlockCall, GGMLWeight
from specdeploy.ops.replay_state import capturing

SOURCE = Path(__file__).with_name("ggml_tiled.c")
# NOTE: no -m flags (the SIMD functions carry their targets); -ffp-contract=off keeps the
# scalar path's fp32 operations the ones the SIMD paths perform
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
TILE = 16
# Steps of at least this many rows run on AMX where the CPU has it (the same bits: ggml_tiled.c);
# SPECDEPLOY_GGML_AMX=0 keeps them on AVX-512. Where AMX starts to pay with 2 threads on a
# 2-core Xeon with AMX (2026-12-05, bench/linear_rows.py): Q8_0 (the lm_head) from ~6 rows,
# the 4-bit kinds, whose nibbles AMX needs unpacked to bytes, from ~32.
AMX_MIN_ROWS = {"q4_1": 32, "q8_0": 8, "q4_0": 32}
# the kinds ggml_tiled.c runs; mxfp4, the Q5 kinds, IQ4_NL and the K-quants / IQ4_XS
# (ggml_tiled_kquant.c) on scalar and AVX2 code (avx512_vnni runs the AVX2 one: the same bits)
TILED_K_QUANTS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs")  # (256-value super-blocks)
# NOTE: SPECDEPLOY_GGML_TILED_KQUANTS=0 leaves these on the integer-dot kernel as stored
# (ops/ggml_int.py): on AVX-512 VNNI CPUs its 16-output dpbusd tiles may win prefill-sized calls
# (measured on AVX2 only: the tiled kernel 0.4-0.55x its time at 4-64 rows there)
# IQ3_XXS / IQ3_S: transcoded to IQ4_XS's layout, each value a nibble into a table of the kind's
# 16 values (`iq_as_xs`; the same values, 136 bytes a super-block instead of 110 / 98: +24% /
# +39% for those matrices), then tiled as IQ4_XS. As stored, each output's lattice indices cost
# a decode per output and row group (ops/ggml_iq_int.c), ~4-5x the tiled copy's time at decode.
# SPECDEPLOY_GGML_TILED_IQ3=0 keeps them as stored (their bytes, the integer-dot kernel).
TILED_IQ3 = ("iq3_s", "iq3_xxs")
# IQ2_XXS / IQ1_S / TQ1_0 / TQ2_0 fit the same transcoding, but at 2.1-2.7x their bytes (66 / 50
# / 54 / 66 -> 136 a super-block): memory is why those files exist, so only on request
# (SPECDEPLOY_GGML_TILED_LOWBIT=1). IQ2_XS / IQ2_S / IQ1_M scale each 16 values: they do not fit.
TILED_LOWBIT = ("iq2_xxs", "iq1_s", "tq1_0", "tq2_0")
TILED_KINDS = ("q4_0", "q4_1", "q8_0", "mxfp4", "q5_0", "q5_1", "iq4_nl") + (
    TILED_K_QUANTS if os.environ.get("SPECDEPLOY_GGML_TILED_KQUANTS", "1") != "0" else ()) + (
    TILED_IQ3 if os.environ.get("SPECDEPLOY_GGML_TILED_IQ3", "1") != "0" else ()) + (
    TILED_LOWBIT if os.environ.get("SPECDEPLOY_GGML_TILED_LOWBIT", "0") == "1" else ())
TRANSCODED = (*TILED_IQ3, *TILED_LOWBIT)  # (the lattice kinds `repack` transcodes first)
_P, _I = ctypes.c_void_p, ctypes.c_int


class TiledWeight(NamedTuple):
    """A [N, K] weight repacked in tiles of 16 outputs (`packed`: uint8 [N / 16, tile bytes])."""

    kind: str  # one of TILED_KINDS
    packed: torch.Tensor
    shape: tuple[int, int]


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDEPLOY_GGML_KERNELS", "1") == "0":
        return None, "SPECDEPLOY_GGML_KERNELS=0"
    # NOTE: a compiler without OpenMP still gets a 1-thread kernel (load_compiled's 2nd try)
    lib, errors = _gl.load_compiled("ggml_tiled", SOURCE, _FLAGS, {
        "ggml_tiled_linear": ([_I, _I, _P, _I, _I, _P, _I, _P, _I], _I),
        "ggml_tiled_grouped": ([_I, _I, _P, _I, _I, _P, _I, _P, ctypes.c_int64, _I, _P, _I],
                               _I),
        "ggml_tiled_isa_supported": ([_I], _I), "ggml_tiled_amx_usable": ([], _I),
        "ggml_tiled_packed_bytes": ([_I], _I), "ggml_tiled_xs_table": ([_I, _P], _I),
        "ggml_tiled_amx_min_rows": ([_I, _I], _I),
        "ggml_tiled_repack": ([_I, _P, _I, _I, _P, _I, _I], None),
        "ggml_tiled_rows": ([_I, _P, _I, _P, _I, _P, _I], None)})
    if lib is not None:
        if os.environ.get("SPECDEPLOY_GGML_AMX", "1") != "0":
            for kind, rows in AMX_MIN_ROWS.items():  # a no-op where AMX is unusable
                lib.ggml_tiled_amx_min_rows(KINDS[kind][0], rows)
        return lib, None
    why = "; ".join(errors)
    _gl.warn_unbuilt("the tiled integer-dot GGUF kernels", why)
    return None, why


def _lib() -> ctypes.CDLL:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"tiled ggml kernels unavailable: {why}")
    return lib


def kernel_unavailable() -> str | None:
    """None when the tiled kernels are built and loaded here, else why not."""
    return _library()[1]


def amx_usable() -> bool:
    """Whether this CPU has AMX-INT8 and the OS let this process use it (asked once)."""
    lib, _ = _library()
    return lib is not None and bool(lib.ggml_tiled_amx_usable())


def amx_min_rows() -> dict[str, int]:
    """Per kind: steps of at least this many rows take AMX on the avx512_vnni path (0: never)."""
    lib = _lib()
    return {kind: lib.ggml_tiled_amx_min_rows(KINDS[kind][0], -1) for kind in AMX_MIN_ROWS}


@contextmanager
def amx(min_rows: int | dict[str, int]):
    """Within: steps of >= min_rows rows (one number for every kind, or per kind) take AMX
    (0: none) where it is usable; the outputs are the same bits either way (ggml_tiled.c),
    only the time differs. Process-wide: not for use while another thread runs a step."""
    want = min_rows if isinstance(min_rows, dict) else dict.fromkeys(AMX_MIN_ROWS, min_rows)
    bad = {k: v for k, v in want.items() if k not in AMX_MIN_ROWS or v < 0}
    if bad:
        raise ValueError(f"amx: min_rows must be >= 0 for kinds of {sorted(AMX_MIN_ROWS)}, "
                         f"got {bad}")
    lib = _lib()
    before = {k: lib.ggml_tiled_amx_min_rows(KINDS[k][0], v) for k, v in want.items()}
    try:
        yield
    finally:
        for k, v in before.items():
            lib.ggml_tiled_amx_min_rows(KINDS[k][0], v)


def supported_isas() -> list[str]:
    """The ISA paths this build and this CPU run, slowest first (scalar is always there)."""
    lib, _ = _library()
    return [] if lib is None else [n for i, n in enumerate(ISAS) if lib.ggml_tiled_isa_supported(i)]


def repack(weight: GGMLWeight | list[GGMLWeight]) -> TiledWeight:
    """The tiled copy of `weight` (a list: weights of one kind and K stacked along the outputs,
    repacked straight from each, no stacked GGUF copy in between). N % 16 != 0 raises
    ValueError (callers keep the GGUF blocks and `ggml_int` then)."""
    members = weight if isinstance(weight, list) else [weight]
    kinds = {(w.kind, w.shape[1]) for w in members}
    if len(kinds) != 1:
        raise ValueError(f"tiled repack: cannot stack mixed kinds / input sizes {sorted(kinds)}")
    (kind, k), n = kinds.pop(), sum(w.shape[0] for w in members)
    if kind not in TILED_KINDS and kind not in TILED_LOWBIT:  # (those: deployments opt in)
        raise ValueError(f"tiled repack: no tiled kernel for {kind} (tiled: "
                         f"{', '.join(TILED_KINDS)})")
    if n % TILE:
        raise ValueError(f"tiled repack: {n} outputs (shape {(n, k)}) are not a multiple of "
                         f"{TILE}")
    lib = _lib()
    # (a tiled block has GGUF's bytes but for Q3_K's, whose scales it unpacks, and the lattice
    # kinds', transcoded: the C file's)
    packed = torch.empty(n // TILE, TILE * k // _gl.block_values(kind)
                         * lib.ggml_tiled_packed_bytes(KINDS[kind][0]), dtype=torch.uint8)
    row0 = 0
    for w in members:
        blocks = iq_as_xs(w) if kind in TRANSCODED else w.blocks.contiguous()
        lib.ggml_tiled_repack(KINDS[kind][0], blocks.data_ptr(), w.shape[0], k,
                              packed.data_ptr(), row0, torch.get_num_threads())
        row0 += w.shape[0]
    return TiledWeight(kind, packed, (n, k))


def iq_as_xs(weight: GGMLWeight) -> torch.Tensor:
    """A lattice weight's blocks (TRANSCODED kinds) in IQ4_XS's byte layout, each value a nibble
    into the kind's table (uint8 [N, K / 256 * 136]; ggml_kernels_int.c's ggml_iq_as_xs, the
    table from ggml_tiled.c): what the tiled copy is made from."""
    from specdeploy.ops import ggml_int

    lib, why = ggml_int._library()
    if lib is None:
        raise RuntimeError(f"iq_as_xs: the integer-dot kernels (codebooks) are unavailable: {why}")
    table = ctypes.create_string_buffer(16)
    if _lib().ggml_tiled_xs_table(KINDS[weight.kind][0], table):
        raise ValueError(f"iq_as_xs: {weight.kind} {tuple(weight.shape)}: not a kind transcoded "
                         f"to IQ4_XS tiles ({', '.join(TRANSCODED)})")
    n, k = weight.shape
    blocks = weight.blocks.contiguous()
    out = torch.empty(n, k // 256 * 136, dtype=torch.uint8)
    rc = lib.ggml_iq_as_xs(KINDS[weight.kind][0], table, blocks.data_ptr(), n * (k // 256),
                           out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"iq_as_xs: {weight.kind} {tuple(weight.shape)}: " + (
            "codebooks not loaded" if rc == -3 else "a block whose values or scales no "
            f"{weight.kind} block has (corrupt blocks?)"))
    return out


def tiled_rows(tw: TiledWeight, ids: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """fp32 [len(ids), K]: rows `ids` of `tw` dequantized, the exact fp32 values gguf gives
    (d * q + m), written into `out` when given (contiguous fp32 of that many elements)."""
    n, k = tw.shape
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"tiled_rows: ids outside [0, {n})")
    if out is None:
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != ids.numel() * k:
        raise ValueError(f"tiled_rows: out must be contiguous fp32 of {ids.numel() * k} elements")
    if ids.numel():
        _lib().ggml_tiled_rows(KINDS[tw.kind][0], tw.packed.data_ptr(), k, ids.data_ptr(),
                               ids.numel(), out.data_ptr(), torch.get_num_threads())
    return out.view(ids.numel(), k)


def tiled_linear(x: torch.Tensor, tw: TiledWeight, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> torch.Tensor:
    """`x[..., K] @ W^T (+ bias)` on the tiled copy; x fp32 on the CPU (checked, named)."""
    from specdeploy.ops.ggml_int import default_isa

    lib = _lib()
    isa = default_isa() if isa is None else isa
    if isa not in ISAS:
        raise ValueError(f"isa: one of {', '.join(ISAS)}, got {isa!r}")
    n, k = tw.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"tiled_linear: x must be fp32 on the CPU with last dim {k}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        rc = lib.ggml_tiled_linear(KINDS[tw.kind][0], ISAS.index(isa), x2.data_ptr(),
                                   x2.shape[0], k, tw.packed.data_ptr(), n, y.data_ptr(),
                                   torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"isa {isa!r}: this CPU / build runs {', '.join(supported_isas())}")
        if rc != 0:
            raise MemoryError("tiled_linear: no scratch memory for the quantized rows")
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def tiled_linear_fn(tw: TiledWeight, bias: torch.Tensor | None, isa: str,
                    gather: torch.Tensor | None = None):
    """`x -> tiled_linear(x, tw, bias, isa)` with everything that does not depend on x checked
    and looked up once (as `ggml_int.bound_linear`: a decode step calls ~120 of these). Inputs
    it does not take go through tiled_linear, which names the problem. `gather`
    (GGMLWeight.gather): the copy holds the columns in stored order, x's are taken in it
    first (then no `tiled_call`: a fused caller would pass x as it is)."""
    lib = _lib()
    if isa not in ISAS:
        raise ValueError(f"isa: one of {', '.join(ISAS)}, got {isa!r}")
    if not lib.ggml_tiled_isa_supported(ISAS.index(isa)):
        raise ValueError(f"isa {isa!r}: this CPU / build runs {', '.join(supported_isas())}")
    fn, kind, isa_i = lib.ggml_tiled_linear, KINDS[tw.kind][0], ISAS.index(isa)
    n, k = tw.shape
    packed = tw.packed  # NOTE: the closure keeps the packed copy alive for its pointer
    w_ptr, f32 = packed.data_ptr(), torch.float32
    empty, threads = torch.empty, torch.get_num_threads

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not f32 or x.shape[-1] != k or x.device.type != "cpu":
            return tiled_linear(x if gather is None else x[..., gather], tw, bias, isa)
        if gather is not None:
            x = x.index_select(-1, gather)
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // k
        # NOTE: y in its final shape, no reshape / view: each torch call costs ~2 us here
        y = empty((*x.shape[:-1], n), dtype=f32)
        if rows and fn(kind, isa_i, x.data_ptr(), rows, k, w_ptr, n, y.data_ptr(), threads()):
            raise MemoryError("tiled_linear: no scratch memory for the quantized rows")
        if bias is not None:
            y += bias
        return y

    linear.packed = packed
    if gather is None:  # what a fused decoder layer (ops/layer_rows.py) needs to make this call
        linear.tiled_call = TiledCall(kind, isa_i, w_ptr, n, k, bias)
    return linear


TiledCall = BlockCall  # a `tiled_linear_fn` closure's fixed arguments of ggml_tiled_linear


class TiledMember(NamedTuple):
    """Outputs start .. start + shape[0] of a tiled (possibly fused) weight: what a repacked
    weight's name maps to once its GGUF blocks are gone (`member_rows` gives its values)."""

    tiled: TiledWeight
    start: int
    shape: tuple[int, int]
    gather: torch.Tensor | None = None  # the copy's columns in stored order (GGMLWeight.gather)


SMALL_IDS = 64  # up to this many ids (a decode / verify step's tokens): the host fast path


def member_rows(m: TiledMember, ids: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The member's rows `ids` (all when None) dequantized: `tiled_rows` of the whole weight."""
    if m.gather is not None:  # W[:, j] = stored[:, cols[j]], cols = argsort(gather)
        rows = member_rows(m._replace(gather=None), ids)[..., m.gather.argsort()]
        return rows if out is None else out.copy_(rows.view_as(out))
    if (ids is not None and out is None and ids.numel() <= SMALL_IDS
            and ids.device.type == "cpu"):
        if capturing() and ids.dtype is torch.int64 and ids.is_contiguous() and not m.start:
            # a CPU-graph capture (engine/cpu_graphs.py): the ids by pointer, read at each
            # replay (the runner checks them against the vocabulary before it replays)
            out = torch.empty(ids.numel(), m.shape[1], dtype=torch.float32)
            _lib().ggml_tiled_rows(KINDS[m.tiled.kind][0], m.tiled.packed.data_ptr(),
                                   m.shape[1], ids.data_ptr(), ids.numel(), out.data_ptr(), 1)
            return out
        return _few_rows(m, ids.reshape(-1).tolist())
    ids = torch.arange(m.shape[0]) if ids is None else ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= m.shape[0]):
        raise IndexError(f"member_rows: ids outside [0, {m.shape[0]})")
    return tiled_rows(m.tiled, ids + m.start if m.start else ids, out)


def _few_rows(m: TiledMember, ids: list[int]) -> torch.Tensor:
    """`member_rows` of a step's few token ids: checked and passed as a host array, one thread
    (a row is ~1 us of work; the tensor path's ~10 torch calls and a thread team took ~30 us a
    decode step's embedding, 2026-12-04). The same C function, so the same values."""
    n, k = m.shape
    if any(not 0 <= i < n for i in ids):
        raise IndexError(f"member_rows: ids outside [0, {n})")
    out = torch.empty(len(ids), k, dtype=torch.float32)
    if ids:
        arr = (ctypes.c_int64 * len(ids))(*(i + m.start for i in ids))
        _lib().ggml_tiled_rows(KINDS[m.tiled.kind][0], m.tiled.packed.data_ptr(), k,
                               ctypes.addressof(arr), len(ids), out.data_ptr(), 1)
    return out
