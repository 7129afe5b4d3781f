"""State-slot variants of the recurrent ops (causal conv1d, Mamba2 SSM, gated delta rule).

Each sequence owns a state slot. A NORMAL segment starts from its slot's state (zeros when the
sequence has nothing cached yet) and writes the final state back. An EXTEND segment (speculative
verification) starts from the slot too, runs token by token as decode steps do
(`_token_by_token`: its rows are bit for bit the decode rows), and writes the state after *every*
token into the spec-state resource `spec_state[slot, i]`, leaving the main slot untouched; the
engine later promotes entry (accepted - 1). Segments of one length and kind are run as one batch
(the decodes of a step, uniform extends), wherever they sit in the flattened batch; other
segments run one by one.

Prefix caching adds a checkpoint pool `ckpt[num_checkpoints, ...]`: for each fed token listed in
`ckpt_tokens_host` (a NORMAL segment crossing a cached page boundary) the state after it goes to
`ckpt[ckpt_slots[i]]`. The chunked scans already hold the state entering every chunk, so a
boundary costs one within-chunk sum (`state_at` of the cores), never per-token states. EXTEND
segments write no checkpoint here: the engine copies committed ones from `spec_state`.

NOTE: `*_host` tensors are CPU metadata used only for control flow (no device sync).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdeploy.cache.metadata import SEG_EXTEND
from specdeploy.ops.conv import causal_conv1d_core
from specdeploy.ops.gdn import decode_step as gdn_decode_step
from specdeploy.ops.gdn import gated_delta_rule_core
from specdeploy.ops.replay_state import reads_allowed
from specdeploy.ops.ssm import ssm_dt, ssm_scan_core
from specdeploy.ops.state_rows import conv_step, ssm_step

# step(inputs [S, 1, ...] each, state [slots, ...], slot_idx [S]) -> y [S, 1, ...] or None: a
#   decode step that reads and writes the rows `slot_idx` of the cache's state in place (the
#   bits of `core`'s one-token form, which verify steps run); None when it cannot run
Step = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor], "torch.Tensor | None"]

# core(inputs [S', n, ...] each, initial_state [S', ...] or None, return_states, state_at
#   [W, 2] (row, token) or None) ->
#   (y [S', n, ...], final_state [S', ...], states [S', n, ...] or None, at [W, ...] or None)
Core = Callable[[Sequence[torch.Tensor], torch.Tensor | None, bool, torch.Tensor | None], tuple]


def _groups(cu: list[int], kinds: list[int]) -> list[list[int]]:
    """Segment indices grouped by (length, kind), in order of first appearance: each group runs
    as one batch (all decodes of a step together, whatever prefill chunks sit between them)."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, kind in enumerate(kinds):
        by_shape.setdefault((cu[i + 1] - cu[i], kind), []).append(i)
    return list(by_shape.values())


def _checkpoint_rows(cu: list[int], idx: list[int], tokens: list[int]
                     ) -> tuple[list[int], list[list[int]]]:
    """Of the checkpointed flat tokens, those inside the group's segments `idx`: their indices
    in `tokens` and (row in the group, token offset in its segment)."""
    which, at = [], []
    for row, i in enumerate(idx):
        for w, tok in enumerate(tokens):
            if cu[i] <= tok < cu[i + 1]:
                which.append(w)
                at.append([row, tok - cu[i]])
    return which, at


def _token_by_token(core: Core, xs: Sequence[torch.Tensor], init: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple:
    """An EXTEND segment (a verify step's 1 + K tokens) run as that many decode steps: each
    token through the one-token form of `core`, from the state the previous one left, rounded
    to the slot's dtype as a decode step stores it. So a verified row is bit for bit the row a
    decode step computes (the chunked form sums in another order: ~5e-7 apart, which the fast
    kernels' 8-bit activation rounding amplified to ~3e-2 in logprob on hybrid GGUFs)."""
    ys, states, st = [], [], init
    for i in range(xs[0].shape[1]):
        y, st, _, _ = core([x[:, i:i + 1] for x in xs], st, False, None)
        st = st.to(dtype).float()
        ys.append(y)
        states.append(st)
    return torch.cat(ys, 1), st, torch.stack(states, 1), None


def run_cached(
    inputs: Sequence[torch.Tensor], state: torch.Tensor, spec_state: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor, slot_idx: torch.Tensor,
    seg_kind_host: torch.Tensor, core: Core, ckpt: torch.Tensor | None = None,
    ckpt_tokens_host: torch.Tensor | None = None, ckpt_slots: torch.Tensor | None = None,
    step: Step | None = None,
) -> torch.Tensor:
    """Drive `core` over the segments of a flattened batch; inputs are [1, T, ...]. A step of
    decodes only (one token each, every one with a cached state, no checkpoint) goes to `step`
    where it can run: no gather, copy and scatter of the states."""
    cu = cu_seqlens_host.tolist()
    # NOTE: only whether each sequence continues a cached state is read: the same for every
    # step a CPU graph replays (engine/cpu_graphs.py; its runner replays only steps where all do)
    with reads_allowed():
        cached = [n > 0 for n in cache_lens_host.tolist()]
    kinds = seg_kind_host.tolist()
    ckpt_tokens = [] if ckpt is None or ckpt_tokens_host is None else ckpt_tokens_host.tolist()
    if (step is not None and cu[-1] == len(kinds) and not ckpt_tokens and SEG_EXTEND not in kinds
            and all(cached)):
        y = step([x[0, :, None] for x in inputs], state, slot_idx)
        if y is not None:
            return y[None, :, 0]
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
        has_prefix = [cached[i] for i in idx]
        init = None
        if any(has_prefix):
            # NOTE: index_select / index_copy_, not advanced indexing: ~10x less overhead a call
            init = state.index_select(0, slots).float()
            if not all(has_prefix):
                # NOTE: select, not multiply: a slot's previous occupant may have left inf/NaN
                keep = torch.tensor(has_prefix, device=init.device)
                init = torch.where(keep.view(-1, *([1] * (init.dim() - 1))), init, 0.0)
        extend = kinds[idx[0]] == SEG_EXTEND
        if extend and spec_state is None:
            raise RuntimeError("EXTEND segment but no spec-state resource was allocated")
        which, at = _checkpoint_rows(cu, idx, ckpt_tokens) if ckpt_tokens else ([], [])
        state_at = torch.tensor(at, dtype=torch.long) if which else None  # host metadata
        if extend:
            y, final, states, at_states = _token_by_token(core, xs, init, state.dtype)
        else:
            y, final, states, at_states = core(xs, init, extend, state_at)
        if which:
            ckpt[ckpt_slots[torch.tensor(which, device=dev)]] = at_states.to(ckpt.dtype)
        if extend and states.shape[1] > spec_state.shape[1]:
            raise RuntimeError(f"EXTEND segment of {states.shape[1]} tokens, but spec state "
                               f"holds {spec_state.shape[1]} (max draft tokens + 1)")
        if extend:
            spec_state[slots, : states.shape[1]] = states.to(spec_state.dtype)
        else:
            state.index_copy_(0, slots, final.to(state.dtype))
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
    "specdeploy::cached_causal_conv1d", mutates_args=("conv_state", "spec_state", "ckpt")
)
def cached_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state: torch.Tensor, spec_state: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor, slot_idx: torch.Tensor,
    seg_kind_host: torch.Tensor, activation: str = "silu", ckpt: torch.Tensor | None = None,
    ckpt_tokens_host: torch.Tensor | None = None, ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    def core(xs, init, return_states, state_at):
        out = causal_conv1d_core(xs[0], weight, bias, init, activation, return_states, state_at)
        return out.y, out.final_state, out.states, out.at

    def step(xs, state, slots):  # the one-token form of `core`, in place (conv_step_rows)
        out = conv_step(xs[0], weight, bias, state, activation, slots)
        return None if out is None else out[0]

    return run_cached([x], conv_state, spec_state, cu_seqlens_host, cache_lens_host, slot_idx,
                      seg_kind_host, core, ckpt, ckpt_tokens_host, ckpt_slots,
                      step=step)


@cached_causal_conv1d.register_fake
def _cached_conv_fake(x, *args, **kwargs):
    return torch.empty_like(x)


# ---- Mamba2 SSM ------------------------------------------------------------------------------


@torch.library.custom_op("specdeploy::cached_ssm_scan",
                         mutates_args=("ssm_state", "spec_state", "ckpt"))
def cached_ssm_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
    spec_state: torch.Tensor | None, cu_seqlens_host: torch.Tensor, cache_lens_host: torch.Tensor,
    slot_idx: torch.Tensor, seg_kind_host: torch.Tensor, dt_min: float, dt_max: float,
    chunk_size: int, ckpt: torch.Tensor | None = None,
    ckpt_tokens_host: torch.Tensor | None = None, ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    def core(xs, init, return_states, state_at):
        xx, dd, bb, cc = xs
        out = ssm_scan_core(xx, ssm_dt(dd, dt_bias, dt_min, dt_max), A, bb, cc, D, chunk_size,
                            init, return_states, state_at)
        return out.y.to(x.dtype), out.final_state, out.states, out.at

    def step(xs, state, slots):  # `core` at one token (ssm.py _ssm_step), in place
        xx, dd, bb, cc = xs
        delta = ssm_dt(dd, dt_bias, dt_min, dt_max)
        out = ssm_step(xx[:, 0], delta[:, 0], A, bb[:, 0], cc[:, 0], D, state, slots)
        return None if out is None else out[0][:, None].to(x.dtype)

    return run_cached([x, dt, B, C], ssm_state, spec_state, cu_seqlens_host, cache_lens_host,
                      slot_idx, seg_kind_host, core, ckpt, ckpt_tokens_host, ckpt_slots,
                      step=step)


@cached_ssm_scan.register_fake
def _cached_ssm_fake(x, *args, **kwargs):
    return torch.empty_like(x)


# ---- gated delta rule ------------------------------------------------------------------------


@torch.library.custom_op(
    "specdeploy::cached_gated_delta_rule", mutates_args=("gdn_state", "spec_state", "ckpt")
)
def cached_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    gdn_state: torch.Tensor, spec_state: torch.Tensor | None, cu_seqlens_host: torch.Tensor,
    cache_lens_host: torch.Tensor, slot_idx: torch.Tensor, seg_kind_host: torch.Tensor,
    use_qk_l2norm: bool, scale: float, chunk_size: int = 64, ckpt: torch.Tensor | None = None,
    ckpt_tokens_host: torch.Tensor | None = None, ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    def core(xs, init, return_states, state_at):
        out = gated_delta_rule_core(*xs, init, use_qk_l2norm, scale, chunk_size, return_states,
                                    state_at)
        return out.o.to(q.dtype), out.final_state, out.states, out.at

    def step(xs, state, slots):  # `core` at one token (gdn.py decode_step), in place
        out = gdn_decode_step(*xs, state, slots, use_qk_l2norm, scale)
        return None if out is None else out[0][:, None].to(q.dtype)

    return run_cached([q, k, v, g, beta], gdn_state, spec_state, cu_seqlens_host,
                      cache_lens_host, slot_idx, seg_kind_host, core, ckpt, ckpt_tokens_host,
                      ckpt_slots, step=step)


@cached_gated_delta_rule.register_fake
def _cached_gdn_fake(q, k, v, *args, **kwargs):
    return v.new_empty(v.shape, dtype=q.dtype)
