"""A MoE layer's routed experts on GGUF blocks in one C call (`ggml_moe_int.c`): the integer-dot
kernels ("fast") over every chosen expert, the activation and the weighted sum per token, in
one OpenMP region; experts of the tiled kinds (ggml_tiled.TILED_KINDS: Q4_0 / Q4_1 / Q8_0 / Q5_0 /
Q5_1 / MXFP4 / Q4_K / Q5_K / Q6_K) on tiled copies (ggml_tiled.c's grouped
call: an OpenMP region for all the up matrices, one for the down ones; MXFP4 only there).
`deploy/passes/ggml_experts.py` uses it with `kernels="fast"`; where it cannot be built (or the
row kernels' SiLU is missing) the per-expert loop of ggml_linear_int calls stays (MXFP4: per-
expert tiled calls). SPECDEPLOY_GGML_MOE=0 turns it off.
gpt-oss's experts (`moe_experts_bias`: biases on the up and down rows, the clamped SwiGLU of
row_kernels.c) take the same call through its *_ex entry points.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.ops import ggml_int, ggml_tiled, row_kernels
from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.ggml_linear import KINDS, GGMLWeight, expert

SOURCE = Path(__file__).with_name("ggml_moe_int.c")
ACTIVATIONS = ("swiglu", "relu2", "swiglu_oai")  # the C file's ACT_* values, in order
TILED_KINDS = ggml_tiled.TILED_KINDS
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGS = [_I, _I, _I, _P, _I, _I, _P, _P, _I, _I, _P, _I64, _I, _P, _I64, _I, _I, _P]
_EX = [_P, _P, _P, _F, _F]  # b_up, b_down, the clamped SwiGLU, alpha, limit


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDEPLOY_GGML_MOE", "1") == "0":
        return None, "SPECDEPLOY_GGML_MOE=0"
    if ggml_int.kernel_unavailable():
        return None, ggml_int.kernel_unavailable()
    rows = row_kernels._library()
    if rows is None:
        return None, "the row kernels (its SiLU) could not be built"
    lib, errors = _gl.load_compiled("ggml_moe_int", SOURCE, ggml_int._FLAGS, {
        "ggml_moe_int": ([*_ARGS, _P, _I], _I),
        "ggml_moe_tiled": ([*_ARGS, _P, _P, _I], _I),
        "ggml_moe_int_ex": ([*_ARGS, *_EX, _P, _I], _I),
        "ggml_moe_tiled_ex": ([*_ARGS, _P, *_EX, _P, _I], _I),
        "ggml_iq_init": ([_P], None)})
    if lib is None:
        why = "; ".join(errors)
        _gl.warn_unbuilt("the one-call GGUF MoE kernel", why)
        return None, why
    from specdeploy.ops import ggml_iq

    ggml_iq.init(lib)
    lib.silu_mul = ctypes.cast(rows.silu_mul_rows, _P).value
    lib.swiglu_oai = ctypes.cast(rows.swiglu_oai_rows, _P).value
    lib.tiled = None
    if ggml_tiled.kernel_unavailable() is None:
        lib.tiled = ctypes.cast(ggml_tiled._lib().ggml_tiled_grouped, _P).value
    return lib, None


def unavailable() -> str | None:
    """None when the one-call kernel is built and loaded here, else why not."""
    return _library()[1]


def _tiled(w: GGMLWeight) -> torch.Tensor:
    """[E, ...] the experts' tiled copies (ops/ggml_tiled.py), one after another."""
    return torch.stack([ggml_tiled.repack(expert(w, e)).packed for e in range(w.shape[0])])


def tiles(up: GGMLWeight, down: GGMLWeight) -> bool:
    """Whether the experts can run on tiled copies: TILED_KINDS, outputs in 16s."""
    lib = _library()[0]
    return (lib is not None and lib.tiled is not None and up.kind in TILED_KINDS
            and down.kind in TILED_KINDS and up.shape[1] % 16 == 0 and down.shape[1] % 16 == 0)


def bound_experts(up: GGMLWeight, down: GGMLWeight, activation: str, isa: str,
                  tiled: bool | None = None, b_up: torch.Tensor | None = None,
                  b_down: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0):
    """(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H] in x's dtype: the routed
    experts' weighted sum on `up` [E, N_up, H] / `down` [E, H, I]'s blocks, one C call.
    `tiled` (None: where `tiles` says so): each expert's matrices repacked once for the tiled
    kernel (another fp32 summation than the per-output kernel's, batch-invariant too; ~2x faster
    at decode sizes), else the blocks as stored. gpt-oss: `b_up` [E, N_up] / `b_down` [E, H]
    added to each expert's rows, "swiglu_oai" with `alpha` / `limit` (ops/moe_bias.py)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"one-call GGUF MoE kernel unavailable: {why}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    e, n_up, h = up.shape
    e_down, h_down, i = down.shape
    if (e_down, h_down) != (e, h) or n_up != (i if activation == "relu2" else 2 * i):
        raise ValueError(f"expert weights do not fit together: up {tuple(up.shape)}, down "
                         f"{tuple(down.shape)}, {activation}")
    if up.gather is not None or down.gather is not None:
        raise ValueError("expert weights with reordered columns are not supported here")
    ub, db = up.blocks, down.blocks  # NOTE: the closure keeps the blocks alive for their pointer
    if not (ub.is_contiguous() and db.is_contiguous()):
        raise ValueError("expert blocks must be contiguous")
    biases = _biases(b_up, b_down, (e, n_up), (e, h))
    oai = activation == "swiglu_oai" or any(b is not None for b in biases)
    fn, silu = lib.ggml_moe_int, lib.silu_mul
    args = (KINDS[up.kind][0], KINDS[down.kind][0], ggml_int.ISAS.index(isa))
    if tiled is None:
        tiled = tiles(up, down)
    if not tiled and not {up.kind, down.kind} <= set(ggml_int.INT_KINDS):  # (no MXFP4 there)
        raise ValueError(f"mxfp4 experts run only tiled (outputs in 16s, the tiled kernel "
                         f"built), other kinds on {', '.join(ggml_int.INT_KINDS)}; got "
                         f"{up.kind} {tuple(up.shape)} / {down.kind} {tuple(down.shape)}")
    if tiled:
        if not tiles(up, down):
            raise ValueError(f"tiled experts: {' / '.join(TILED_KINDS)} with outputs in 16s and "
                             f"the tiled kernel built; got {up.kind} {tuple(up.shape)} / "
                             f"{down.kind} {tuple(down.shape)}")
        ub, db, fn = _tiled(up), _tiled(down), lib.ggml_moe_tiled
    tail = (e, ub.data_ptr(), ub.stride(0), n_up, db.data_ptr(), db.stride(0), i,
            ACTIVATIONS.index(activation), silu, *((lib.tiled,) if tiled else ()))
    if oai:  # NOTE: the closure keeps the biases alive for their pointers
        fn = lib.ggml_moe_tiled_ex if tiled else lib.ggml_moe_int_ex
        tail = (*tail, *(None if b is None else b.data_ptr() for b in biases), lib.swiglu_oai,
                alpha, limit)
    f32, i64 = torch.float32, torch.int64

    def experts_one_call(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                         ) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != h:
            raise ValueError(f"ggml_moe_int: x must be [T, {h}] on the CPU, got "
                             f"{tuple(x.shape)} on {x.device}")
        xf = x.to(f32).contiguous()
        ids = topk_ids.to(i64).contiguous()
        wts = topk_weights.to(f32).contiguous()
        out = torch.empty(xf.shape, dtype=f32)
        rc = fn(*args, xf.data_ptr(), xf.shape[0], h, ids.data_ptr(), wts.data_ptr(),
                ids.shape[1], *tail, out.data_ptr(), torch.get_num_threads())
        if rc == -4:
            raise RuntimeError("ggml_moe_int: the IQ codebooks were not loaded (ggml_iq.init)")
        if rc == -3:
            raise ValueError(f"ggml_moe_int: expert ids must lie in [0, {e}) with 1..64 per "
                             f"token, got ids of shape {tuple(ids.shape)}")
        if rc:
            raise MemoryError("ggml_moe_int: no scratch memory") if rc == -1 else ValueError(
                f"isa {isa!r}: this CPU / build runs {', '.join(ggml_int.supported_isas())}")
        return out if x.dtype is f32 else out.to(x.dtype)

    experts_one_call.blocks = (ub, db)
    if oai:  # (a fused MoE block, ops/moe_block.c, makes the call without biases)
        experts_one_call.biases = biases
        return experts_one_call
    experts_one_call.moe_call = MoeCall(bool(tiled), *args, e, ub.data_ptr(), ub.stride(0), n_up,
                                        db.data_ptr(), db.stride(0), i,
                                        ACTIVATIONS.index(activation), h)
    return experts_one_call


def _biases(b_up, b_down, up_shape, down_shape) -> tuple:
    out = []
    for b, shape in ((b_up, up_shape), (b_down, down_shape)):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"expert biases must be {list(shape)}, got {list(b.shape)}")
        out.append(None if b is None else b.detach().to(torch.float32).contiguous())
    return tuple(out)


class MoeCall(NamedTuple):
    """A `bound_experts` closure's fixed arguments of ggml_moe_tiled / ggml_moe_int (what a
    fused MoE block, ops/moe_block.py, needs to make the same call); `h`: x's width."""

    tiled: bool
    kind_up: int
    kind_down: int
    isa: int
    e: int
    w_up: int
    up_stride: int
    n_up: int
    w_down: int
    down_stride: int
    i: int
    act: int
    h: int
