"""The run-time side of `fuse_recurrent_mixers` (fuse_mixers.py): the fused Mamba2 and
gated-delta calls, which run one C call (ops/state_rows.py) for the steps it takes and the
original chain (`_Sub`) for every other step.
"""
from __future__ import annotations

from specdeploy.cache.metadata import SEG_EXTEND
from specdeploy.deploy.passes.chain_fusion import _Sub
from specdeploy.ops import state_rows
from specdeploy.ops.replay_state import reads_allowed


def _step_kind(cu_h, lens_h, kind_h, ckpt, ckpt_tok, conv_spec, spec) -> tuple[int, bool] | None:
    """(tokens a sequence, verify) for a step the fused call takes: decodes only (run_cached's
    in-place path) or verify segments only (with spec states), all of one length; every
    sequence with a cached state, no prefix-cache checkpoint. None for any other step (the
    chain runs it)."""
    if ckpt is not None and ckpt_tok is not None and ckpt_tok.numel():
        return None
    kinds, cu = kind_h.tolist(), cu_h.tolist()
    with reads_allowed():  # a replayed step (engine/cpu_graphs.py) has every state cached
        fresh = 0 in lens_h.tolist()
    if fresh or not kinds:
        return None
    if SEG_EXTEND not in kinds:
        return (1, False) if cu[-1] == len(kinds) else None
    n = cu[1] - cu[0]
    if conv_spec is None or spec is None:
        return None
    if any(k != SEG_EXTEND for k in kinds) or cu[-1] != n * len(kinds) or any(
            cu[i + 1] - cu[i] != n for i in range(len(kinds))):
        return None
    return n, True


def _mamba2_fn(sub: _Sub, c: dict):
    def mamba2_mixer(*ext):
        (xbc, z, dt, conv_w, conv_b, conv_state, slots, cu_h, lens_h, kind_h, ckpt, ckpt_tok,
         A, D, dt_bias, ssm_state, norm_w, conv_spec, ssm_spec) = ext[:19]
        kind = _step_kind(cu_h, lens_h, kind_h, ckpt, ckpt_tok, conv_spec, ssm_spec)
        if kind is not None:
            ntok, verify = kind
            out = state_rows.mamba2_decode(
                xbc, z, dt, conv_w, conv_b, conv_state, slots, A, D, dt_bias, c["dt_min"],
                c["dt_max"], ssm_state, norm_w, c["eps"], c["group"], c["h"], c["p"], c["n"],
                c["g"], ntok, conv_spec if verify else None, ssm_spec if verify else None)
            if out is not None:
                return out
        return sub(ext)

    return mamba2_mixer


def _gdn_fn(sub: _Sub, c: dict):
    def gdn_mixer(*ext):
        (qkv, b, a, z, conv_w, conv_b, conv_state, slots, cu_h, lens_h, kind_h, ckpt, ckpt_tok,
         A, dt_bias, gdn_state, norm_w, conv_spec, gdn_spec) = ext[:19]
        kind = _step_kind(cu_h, lens_h, kind_h, ckpt, ckpt_tok, conv_spec, gdn_spec)
        if kind is not None:
            ntok, verify = kind
            out = state_rows.gdn_decode(
                qkv, b, a, z, conv_w, conv_b, conv_state, slots, A, dt_bias, gdn_state,
                c["l2norm"], c["scale"], norm_w, c["eps"], c["group"], c["hk"], c["h"],
                c["dk"], c["dv"], ntok, conv_spec if verify else None,
                gdn_spec if verify else None)
            if out is not None:
                return out
        return sub(ext)

    return gdn_mixer
