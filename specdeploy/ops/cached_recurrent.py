"""State-slot variants of the recurrent ops (causal conv1d, Mamba2 SSM, gated delta rule).

Each sequence owns a state slot. A NORMAL segment starts from its slot's state (zeros when the
sequence has nothing cached yet) and writes the final state back. An EXTEND segment (speculative
verification) starts from the slot too but writes the state after *every* token into the spec-state
resource `spec_state[slot, i]` and leaves the main slot untouched; the engine later promotes entry
(accepted - 1). Segments of one length and kind are run as one batch (the decodes of a step,
uniform extends), wherever they sit in the flattened batch; other segments run one by one.

NOTE: `*_host` tensors are CPU metadata used only for control flow (no device sync).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdeploy.cache.metadata import SEG_EXTEND
from specdeploy.ops.conv import causal_conv1d_core
from specdeploy.ops.gdn import gated_delta_rule_core
from specdeploy.ops.ssm import ssm_dt, ssm_scan_core

# core(inputs [S', n, ...] each, initial_state [S', ...] or None, return_states) ->
#   (y [S', n, ...], final_state [S', ...], states [S', n, ...] or None)
Core = Callable[[Sequence[torch.Tensor], torch.Tensor | None, bool], tuple]


def _groups(cu: list[int], kinds: list[int]) -> list[list[int]]:
    """Segment indices grouped by (length, kind), in order of first appearance: each group runs
    as one batch (all decodes of a step together, whatever prefill chunks sit between them)."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, kind in enumerate(kinds):
        by_shape.setdefault((cu[i + 1] - cu[i], kind), []).append(i)
    return list(by_shape.values())


def run_cached(
    inputs: Sequence[torch.Tensor], state: torch.Tensor, spec_state: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor, slot_idx: torch.Tensor,
    seg_kind_host: torch.Tensor, core: Core,
) -> torch.Tensor:
    """Drive `core` over the segments of a flattened batch; inputs are [1, T, ...]."""
    cu = cu_seqlens_host.tolist()
    lens = cache_lens_host.tolist()
    kinds = seg_kind_host.tolist()
    groups = _groups(cu, kinds)
    dev = slot_idx.device
    out = None
    for idx in groups:
        tokens = None  # token positions of the group when they are not one contiguous run
        if len(groups) == 1:
            xs = [x[0].unflatten(0, (len(idx), -1)) for x in inputs]
            slots = slot_idx
        elif len(idx) == 1:
            a, b = cu[idx[0]], cu[idx[0] + 1]
            xs = [x[:, a:b] for x in inputs]
            slots = slot_idx[idx[0] : idx[0] + 1]
        else:
            tokens = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in idx]).to(dev)
            xs = [x[0, tokens].unflatten(0, (len(idx), -1)) for x in inputs]
            slots = slot_idx[torch.tensor(idx, device=dev)]
        has_prefix = [lens[i] > 0 for i in idx]
        init = None
        if any(has_prefix):
            init = state[slots].float()
            if not all(has_prefix):
                # NOTE: select, not multiply: a slot's previous occupant may have left inf/NaN
                keep = torch.tensor(has_prefix, device=init.device)
                init = torch.where(keep.view(-1, *([1] * (init.dim() - 1))), init, 0.0)
        extend = kinds[idx[0]] == SEG_EXTEND
        if extend and spec_state is None:
            raise RuntimeError("EXTEND segment but no spec-state resource was allocated")
        y, final, states = core(xs, init, extend)
        if extend and states.shape[1] > spec_state.shape[1]:
            raise RuntimeError(f"EXTEND segment of {states.shape[1]} tokens, but spec state "
                               f"holds {spec_state.shape[1]} (max draft tokens + 1)")
        if extend:
            spec_state[slots, : states.shape[1]] = states.to(spec_state.dtype)
        else:
            state[slots] = final.to(state.dtype)
        if len(groups) == 1:
            return y.flatten(0, 1)[None]
        if out is None:
            out = y.new_empty(1, cu[-1], *y.shape[2:])
        if tokens is None:
            out[:, cu[idx[0]] : cu[idx[0] + 1]] = y
        else:
            out[0, tokens] = y.flatten(0, 1)
    return out


# ---- causal conv1d ---------------------------------------------------------------------------


@torch.library.custom_op(
    "specdeploy::cached_causal_conv1d", mutates_args=("conv_state", "spec_state")
)
def cached_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state: torch.Tensor, spec_state: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor, slot_idx: torch.Tensor,
    seg_kind_host: torch.Tensor, activation: str = "silu",
) -> torch.Tensor:
    def core(xs, init, return_states):
        out = causal_conv1d_core(xs[0], weight, bias, init, activation, return_states)
        return out.y, out.final_state, out.states

    return run_cached([x], conv_state, spec_state, cu_seqlens_host, cache_lens_host, slot_idx,
                      seg_kind_host, core)


@cached_causal_conv1d.register_fake
def _cached_conv_fake(x, *args, **kwargs):
    return torch.empty_like(x)


# ---- Mamba2 SSM ------------------------------------------------------------------------------


@torch.library.custom_op("specdeploy::cached_ssm_scan", mutates_args=("ssm_state", "spec_state"))
def cached_ssm_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
    spec_state: torch.Tensor | None, cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor,
    slot_idx: torch.Tensor, seg_kind_host: torch.Tensor, dt_min: float, dt_max: float,
    chunk_size: int,
) -> torch.Tensor:
    def core(xs, init, return_states):
        xx, dd, bb, cc = xs
        out = ssm_scan_core(xx, ssm_dt(dd, dt_bias, dt_min, dt_max), A, bb, cc, D, chunk_size,
                            init, return_states)
        return out.y.to(x.dtype), out.final_state, out.states

    return run_cached([x, dt, B, C], ssm_state, spec_state, cu_seqlens_host, cache_lens_host,
                      slot_idx, seg_kind_host, core)


@cached_ssm_scan.register_fake
def _cached_ssm_fake(x, *args, **kwargs):
    return torch.empty_like(x)


# ---- gated delta rule ------------------------------------------------------------------------


@torch.library.custom_op(
    "specdeploy::cached_gated_delta_rule", mutates_args=("gdn_state", "spec_state")
)
def cached_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    gdn_state: torch.Tensor, spec_state: torch.Tensor | None, cu_seqlens_host: torch.Tensor,
    cache_lens_host: torch.Tensor, slot_idx: torch.Tensor, seg_kind_host: torch.Tensor,
    use_qk_l2norm: bool, scale: float, chunk_size: int = 64,
) -> torch.Tensor:
    def core(xs, init, return_states):
        out = gated_delta_rule_core(*xs, init, use_qk_l2norm, scale, chunk_size, return_states)
        return out.o.to(q.dtype), out.final_state, out.states

    return run_cached([q, k, v, g, beta], gdn_state, spec_state, cu_seqlens_host,
                      cache_lens_host, slot_idx, seg_kind_host, core)


@cached_gated_delta_rule.register_fake
def _cached_gdn_fake(q, k, v, *args, **kwargs):
    return v.new_empty(v.shape, dtype=q.dtype)
