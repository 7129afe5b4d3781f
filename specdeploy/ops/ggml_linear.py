"""Linears over GGUF-quantized weights (Q4_1, Q8_0, Q4_0) without expanding them to fp32 in memory.

Decode on a CPU is bound by reading weights: the default model's linears are 540 MB as fp32 and
96 MB as the GGUF file stores them (Q4_1 layers, Q8_0 embedding / tied head). The kernel in
`ggml_kernels.c` reads the blocks and expands each weight in registers to exactly the fp32 value
that `gguf`'s dequantization gives, so the model is the same fp32 model; only the order of the
fp32 sums differs from a matmul over the dequantized matrix (as between any two BLAS builds).

The C file is compiled on first use with the system C compiler into a per-user cache
(`SPECDEPLOY_CACHE_DIR`, default `~/.cache/specdeploy`) and loaded with ctypes. Where that cannot
happen (not x86-64 Linux with AVX2 / FMA / F16C, no compiler, `SPECDEPLOY_GGML_KERNELS=0`),
`kernel_unavailable()` says why and callers keep the fp32 weights.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.ops.replay_state import capturing

SOURCE = Path(__file__).with_name("ggml_kernels.c")
# name -> (kernel kind, bytes per block): 32-value blocks, and the K-quants' 256-value ones;
# mxfp4: ggml's MXFP4 (gpt-oss's experts: an E8M0 byte, then Q4_0's nibbles of the doubled
# E2M1 table), on the exact and the tiled kernels only (ggml_int.py refuses it)
# q5_0 / q5_1: what llama-quantize writes for a Q4_K / Q5_K tensor whose rows are not in 256s
# (Nemotron 3 Nano's hidden 2688, Gemma 3 1B's 1152), and the Q5_0 / Q5_1 file types
# iq4_nl / iq4_xs: ggml's non-linear 4-bit types (a 16-entry int8 table; IQ4_XS in 256-value
# super-blocks with a 6-bit scale per 32): the IQ4_XS file type, IQ4_NL its fallback
KINDS = {"q4_1": (0, 20), "q8_0": (1, 34), "q4_0": (2, 18), "q4_k": (3, 144), "q5_k": (4, 176),
         "q6_k": (5, 210), "mxfp4": (6, 17), "q5_0": (7, 22), "q5_1": (8, 24),
         "iq4_nl": (9, 18), "iq4_xs": (10, 136), "q3_k": (11, 110), "q2_k": (12, 84),
         # the lattice-codebook kinds (ggml_iq.c): exact and integer-dot kernels, not tiled
         "iq2_xxs": (13, 66), "iq2_xs": (14, 74), "iq2_s": (15, 82), "iq3_xxs": (16, 98),
         "iq3_s": (17, 110), "iq1_s": (18, 50), "iq1_m": (19, 56),
         # a GGUF's full-precision F16 / BF16 matrices, as 32-value "blocks" of their bytes:
         # the exact kernel only (the fp32 model, half the bytes; "fast" runs it at every row
         # count, as MXFP4 where no tiled copy does)
         "f16": (20, 64), "bf16": (21, 64),
         # ternary (BitNet b1.58-style) 256-value blocks, read by ggml_iq.c with the IQ kinds
         "tq1_0": (22, 54), "tq2_0": (23, 66)}
HALF_KINDS = ("f16", "bf16")
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # exact, integer-dot and tiled kernels
# ggml_iq.c's kinds: the lattice-codebook IQ1 / IQ2 / IQ3 kinds and the ternary TQ1_0 / TQ2_0
IQ_KINDS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")
SUPER_BLOCKS = (*K_QUANTS, "iq4_xs", "q3_k", "q2_k", *IQ_KINDS)  # 256 values a block


def block_values(kind: str) -> int:
    """Values per block of `kind`: 256 for the K-quants (Q2_K, Q3_K too) and IQ4_XS, else 32."""
    return 256 if kind in SUPER_BLOCKS else 32


def scale_bytes(kind: str) -> slice | None:
    """Where a block of `kind` keeps its fp16 scale(s) (d, and the offset m / dmin); None for
    mxfp4, whose E8M0 byte is always a finite power of two as ggml reads it, and for iq1_m,
    whose d is spread over four bytes' top nibbles (`iq1_m_scales`)."""
    if kind in ("mxfp4", "iq1_m", *HALF_KINDS):  # (F16 / BF16: every value is checked)
        return None
    if kind in ("q3_k", "q2_k"):
        return slice(108, 110) if kind == "q3_k" else slice(80, 84)
    if kind in ("tq1_0", "tq2_0"):  # d last
        return slice(52, 54) if kind == "tq1_0" else slice(64, 66)
    return slice(208, 210) if kind == "q6_k" else slice(0, 4 if kind in ("q4_1", "q5_1", "q4_k",
                                                                          "q5_k") else 2)


def iq1_m_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ1_M blocks [..., 56] -> their fp16 d [...]: the top nibbles of the four uint16 scales
    at bytes 48..55, lowest first (gguf-py's reading)."""
    b = blocks[..., 48:56].to(torch.int32)
    hi = b[..., 1::2]  # each uint16's high byte holds its top nibble
    bits = ((hi[..., 0] >> 4) | (hi[..., 1] & 0xF0) | ((hi[..., 2] & 0xF0) << 4)
            | ((hi[..., 3] & 0xF0) << 8))
    return bits.to(torch.int16).view(torch.float16)


def nonfinite_values(weight: GGMLWeight) -> bool:
    """Whether an F16 / BF16 weight holds an inf or NaN (exponent bits all ones)."""
    mask = 0x7C00 if weight.kind == "f16" else 0x7F80
    return bool(((weight.blocks.view(torch.int16) & mask) == mask).any())


_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC"]
_CPU_FLAGS = ("avx2", "fma", "f16c")


class GGMLWeight(NamedTuple):
    """A [N, K] linear weight as N rows of GGUF blocks (`blocks`: uint8 [N, K / QK * size], QK
    `block_values(kind)`); stacked routed experts [E, N, K] as [E, N, K / QK * size] (`expert`
    gives one's [N, K]). `gather` (int64 [K] or None): the blocks hold the columns in another
    order, W[:, j] = stored[:, cols[j]] with gather = argsort(cols), so x @ W^T is computed as
    x[..., gather] @ stored^T (a Qwen3.5 GGUF's `ssm_out`, whose value-head column reorder
    would split K-quant blocks; where it moves whole blocks `make_weight` reorders the blocks
    instead and there is no gather)."""

    kind: str  # a key of KINDS
    blocks: torch.Tensor
    shape: tuple[int, ...]
    gather: torch.Tensor | None = None


def make_weight(kind: str, blocks: torch.Tensor, shape: tuple[int, ...],
                cols: torch.Tensor | None = None) -> GGMLWeight:
    """Checked constructor: the block bytes must be exactly what `shape` ([N, K], or [E, N, K]
    for stacked experts) needs."""
    if kind not in KINDS:
        raise ValueError(f"ggml weight: unsupported kind {kind!r}; supported: {', '.join(KINDS)}")
    *lead, n, k = shape
    qk = block_values(kind)
    want = (*lead, n, k // qk * KINDS[kind][1])
    if len(lead) > 1 or k % qk or blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise ValueError(f"ggml weight: {kind} blocks for shape {tuple(shape)} must be uint8 "
                         f"{want}, got {blocks.dtype} {tuple(blocks.shape)}")
    gather = None
    if cols is not None:
        cols = torch.as_tensor(cols, dtype=torch.int64)
        if len(lead) or tuple(cols.shape) != (k,) or not torch.equal(cols.sort().values,
                                                                     torch.arange(k)):
            raise ValueError(f"ggml weight: cols must be a permutation of {k} columns")
        moved = _whole_blocks(cols, qk)
        if moved is not None:  # the blocks themselves reordered: a plain weight (tiled too)
            size = KINDS[kind][1]
            blocks = blocks.view(n, k // qk, size)[:, moved].reshape(n, -1)
        else:
            gather = cols.argsort()
    return GGMLWeight(kind, blocks.contiguous(), tuple(shape), gather)


def _whole_blocks(cols: torch.Tensor, qk: int) -> torch.Tensor | None:
    """For W[:, j] = stored[:, cols[j]]: the stored block each of W's blocks is, when `cols`
    moves whole blocks of `qk` columns in order (a Q8_0 / Q4_0 `ssm_out` whose value heads are
    multiples of 32), else None."""
    runs = cols.view(-1, qk)
    first = runs[:, :1]
    if (first % qk).any() or not torch.equal(runs, first + torch.arange(qk)):
        return None
    return first[:, 0] // qk


def expert(weight: GGMLWeight, e: int) -> GGMLWeight:
    """Expert `e`'s [N, K] weight of stacked experts [E, N, K] (a view of its blocks)."""
    return GGMLWeight(weight.kind, weight.blocks[e], weight.shape[1:])


def _rows_of(weight: GGMLWeight) -> GGMLWeight:
    """A stacked [E, N, K] weight as one [E * N, K] (its blocks are contiguous)."""
    if len(weight.shape) == 2:
        return weight
    e, n, k = weight.shape
    return GGMLWeight(weight.kind, weight.blocks.view(e * n, -1), (e * n, k))


def concat_rows(weights: list[GGMLWeight]) -> GGMLWeight:
    """Weights of one kind and input size stacked along the output rows (fused q/k/v, gate/up)."""
    kinds = {(w.kind, w.shape[1]) for w in weights}
    if any(w.gather is not None for w in weights):
        raise ValueError("ggml weights: cannot stack weights with reordered columns")
    if len(kinds) != 1:
        raise ValueError(f"ggml weights: cannot stack mixed kinds / input sizes {sorted(kinds)}")
    kind, k = kinds.pop()
    return make_weight(kind, torch.cat([w.blocks for w in weights]),
                       (sum(w.shape[0] for w in weights), k))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    """SPECDEPLOY_CACHE_DIR, else ~/.cache/specdeploy, else (home not writable, as on some CI
    runners) a per-user folder in the temp dir."""
    root = os.environ.get("SPECDEPLOY_CACHE_DIR")
    if root:
        return Path(root)
    for path in (Path.home() / ".cache" / "specdeploy",
                 Path(tempfile.gettempdir()) / f"specdeploy-{os.getuid()}"):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    return Path(tempfile.mkdtemp(prefix="specdeploy-"))


def _compile(out: Path, openmp: bool, source: Path = SOURCE, flags: list[str] = _FLAGS,
             libs: tuple[str, ...] = ()) -> str | None:
    """Compile `source` to `out`; None on success, else the compiler's complaint."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc / gcc) on PATH"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {out.parent}: {e}"
    # NOTE: compile to a temporary name, then rename: concurrent processes never load a
    # half-written library
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:
        return f"cannot write to {out.parent}: {e}"
    os.close(fd)
    cmd = [cc, *flags, *(["-fopenmp"] if openmp else []), "-o", tmp, str(source), *libs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            # NOTE: one line: the reason ends up in a warning and in skip details
            return f"{' '.join(cmd)} failed: {' '.join(proc.stderr.split())[-400:]}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{' '.join(cmd)} failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _with_includes(source: Path) -> bytes:
    """`source`'s bytes and those of the files it #includes "beside it" (a change to one
    rebuilds the library)."""
    text = source.read_bytes()
    extra = b"".join(_with_includes(source.with_name(m.decode()))
                     for m in re.findall(rb'^#include "([^"]+)"', text, flags=re.M))
    return text + extra


def load_compiled(stem: str, source: Path, flags: list[str],
                  signatures: dict[str, tuple[list, object]], libs: tuple[str, ...] = ("-lm",)
                  ) -> tuple[ctypes.CDLL | None, list[str]]:
    """`source` compiled into the cache (`stem-<digest>[-omp].so`: with OpenMP first, then
    without) and loaded, each function in `signatures` given its (argtypes, restype); or None
    and why each try failed."""
    digest = hashlib.sha256(_with_includes(source) + " ".join(flags).encode()).hexdigest()[:16]
    errors, cache = [], _cache_dir()
    for openmp in (True, False):
        path = cache / f"{stem}-{digest}{'-omp' if openmp else ''}.so"
        if not path.exists():
            err = _compile(path, openmp, source=source, flags=flags, libs=libs)
            if err:
                errors.append(err)
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        for name, (argtypes, restype) in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
        return lib, errors
    return None, errors


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDEPLOY_GGML_KERNELS", "1") == "0":
        return None, "SPECDEPLOY_GGML_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        why = f"needs x86-64 Linux (this is {platform.system()} {platform.machine()})"
        warn_unbuilt("the exact GGUF block kernel", why)
        return None, why
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        why = f"this CPU lacks {', '.join(missing)}"
        warn_unbuilt("the exact GGUF block kernel", why)
        return None, why
    # NOTE: a compiler without OpenMP still gets a 1-thread kernel (load_compiled's 2nd try)
    ptr, int_ = ctypes.c_void_p, ctypes.c_int
    lib, errors = load_compiled("ggml_kernels", SOURCE, _FLAGS, {
        "ggml_linear": ([int_, ptr, int_, int_, ptr, int_, ptr, int_], int_),
        "ggml_dequant": ([int_, ptr, ptr, int_, int_, ptr, int_], None),
        "ggml_iq_init": ([ptr], None)}, libs=())
    if lib is not None:
        from specdeploy.ops import ggml_iq

        ggml_iq.init(lib)
        return lib, None
    why = "; ".join(errors)
    warn_unbuilt("the exact GGUF block kernel", why)
    return None, why


def warn_unbuilt(what: str, why: str) -> None:
    """The one visible line when a kernel cannot be built or used here (callers then fall back
    to torch). A log record, not `warnings.warn`: that prints the source line under it, and a
    filter can hide it; with no logging configured Python prints the bare message on stderr.
    Once per kernel and process (the callers' `_library` is cached)."""
    logging.getLogger("specdeploy").warning("specdeploy: cannot build %s, falling back to "
                                            "torch: %s", what, why)


def kernel_unavailable() -> str | None:
    """None when the kernel is built and loaded here, else why not (for reports and skips)."""
    return _library()[1]


class BlockCall(NamedTuple):
    """A block-kernel linear closure's fixed arguments (ggml_tiled.c's `ggml_tiled_linear`,
    ggml_kernels_int.c's `ggml_linear_int`: the same signature) and its bias: what a fused
    caller (ops/layer_rows.py, ops/moe_block.py) needs to make the same call itself."""

    kind: int
    isa: int
    w_ptr: int
    n: int
    k: int
    bias: torch.Tensor | None


def ggml_linear(x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """`x[..., K] @ W^T (+ bias)` with W in GGUF blocks; x fp32 on the CPU."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"ggml kernels unavailable: {why}")
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"ggml_linear: x must be fp32 on the CPU with last dim {k}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    x2 = x.reshape(-1, k)
    x2 = (x2 if weight.gather is None else x2.index_select(1, weight.gather)).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        rc = lib.ggml_linear(KINDS[weight.kind][0], x2.data_ptr(), x2.shape[0], k,
                             weight.blocks.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
        if rc == -3:
            raise RuntimeError("ggml_linear: the IQ codebooks were not loaded (ggml_iq.init)")
        if rc != 0:
            raise MemoryError("ggml_linear: no scratch memory for the block sums")
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def dequantize(weight: GGMLWeight, rows: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of `weight` ([N, K]; with `rows` int64 [R] those rows, [R, K]), bit for
    bit what gguf's dequantization gives, written into `out` when given (a reused buffer of at
    least that many elements; the result is a view of it). Stacked experts [E, N, K]: all of
    them, [E, N, K] (`rows` then index the E * N rows)."""
    if len(weight.shape) == 3 and rows is None:
        return dequantize(_rows_of(weight), None, out).view(weight.shape)
    weight = _rows_of(weight)
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"ggml kernels unavailable: {why}")
    n, k = weight.shape
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise IndexError(f"ggml dequantize: rows outside [0, {n})")
    r = n if rows is None else rows.numel()
    if out is None:
        out = torch.empty(r, k, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < r * k:
        raise ValueError(f"ggml dequantize: out must be contiguous fp32 with >= {r * k} elements")
    out = out.view(-1)[:r * k].view(r, k)
    if r:
        lib.ggml_dequant(KINDS[weight.kind][0], weight.blocks.data_ptr(),
                         None if rows is None else rows.data_ptr(), r, k, out.data_ptr(),
                         torch.get_num_threads())
    if weight.gather is not None:  # stored column i is W's column gather[i]
        out[:, weight.gather] = out.clone()
    return out


def quantize_q8_0(w: torch.Tensor) -> GGMLWeight:
    """[N, K] fp32 -> Q8_0 blocks as gguf's (and llama.cpp's reference) quantizer writes them:
    per block of 32, d = max|x| / 127 in fp32, q = x * (1 / d) rounded half away from zero,
    d stored as fp16. Used for weights that come as fp32 but run on the block kernels (a
    drafter's linears: `SpecConfig(draft_quantize="q8_0")`)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantize_q8_0: the input size must be a multiple of 32, got {k}")
    x = w.detach().to(torch.float32).reshape(n, k // 32, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = x * inv
    q = torch.trunc(v + torch.copysign(torch.full_like(v, 0.5), v)).to(torch.int8)
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8).reshape(n, k // 32, 2),
                        q.view(torch.uint8)], -1)
    return make_weight("q8_0", blocks.reshape(n, -1), (n, k))


def ggml_embedding(ids: torch.Tensor, weight: GGMLWeight) -> torch.Tensor:
    """`embedding(ids, W)` with W in GGUF blocks: the rows of `ids`, dequantized (exactly the
    fp32 table's rows). ids [...] int -> [..., K] fp32. A step's few ids (a drafter's, each
    chain step) go as a host array on one thread: the same C call without ~10 torch calls."""
    n, k = weight.shape
    if ids.numel() > 64 or ids.device.type != "cpu":
        return dequantize(weight, ids).view(*ids.shape, k)
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"ggml kernels unavailable: {why}")
    if capturing() and ids.dtype is torch.int64 and ids.is_contiguous():
        # a CPU-graph capture (engine/cpu_graphs.py): the ids by pointer, read at each replay
        # (the runner checks them against the vocabulary before it replays)
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        lib.ggml_dequant(KINDS[weight.kind][0], weight.blocks.data_ptr(), ids.data_ptr(),
                         ids.numel(), k, out.data_ptr(), 1)
        return out.view(*ids.shape, k)
    flat = ids.reshape(-1).tolist()
    if any(not 0 <= i < n for i in flat):
        raise IndexError(f"ggml dequantize: rows outside [0, {n})")
    out = torch.empty(len(flat), k, dtype=torch.float32)
    if flat:
        arr = (ctypes.c_int64 * len(flat))(*flat)
        lib.ggml_dequant(KINDS[weight.kind][0], weight.blocks.data_ptr(), ctypes.addressof(arr),
                         len(flat), k, out.data_ptr(), 1)
    return out.view(*ids.shape, k)


_SCRATCH: list[torch.Tensor] = [torch.empty(0)]


def scratch(numel: int) -> torch.Tensor:
    """A flat fp32 buffer of at least `numel` elements, reused by every caller (the fp32 GEMM
    path of prefill dequantizes one weight at a time into it): one layer's weight resident,
    not the model's. Callers use it before the next call; the engine runs one step at a time."""
    if _SCRATCH[0].numel() < numel:
        _SCRATCH[0] = torch.empty(numel, dtype=torch.float32)
    return _SCRATCH[0]
