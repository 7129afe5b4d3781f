"""C kernels for the recurrent mixers' decode steps (conv1d, Mamba2 SSM, gated delta rule, the
fused Mamba2 / gated-delta chains) and the speculative commit of their states
(`row_kernels.c`, the same library as the row-wise ops in row_kernels.py).

Each function takes fp32 CPU tensors and returns None when the kernel does not take them: the
caller then runs torch. With `slots`, a state argument is the cache's whole slot tensor, moved
on in place at those rows.
"""
from __future__ import annotations

import torch

from specdeploy.ops.row_kernels import _F32, _library, _ptr, _usable


def _slot_state(state: torch.Tensor | None, slots: torch.Tensor | None, rows: int,
                shape: tuple[int, ...]) -> tuple[torch.Tensor | None, int | None] | None:
    """(the state to read, the slot indices' pointer) for a step: with `slots`, `state` is the
    cache's whole slot tensor [S, *shape], updated in place at those rows; else a [rows, *shape]
    tensor or None (zeros). None when the step cannot take them."""
    if slots is None:
        if state is not None and tuple(state.shape) != (rows, *shape):
            return None
        return (None if state is None else state.contiguous()), None
    if (state is None or tuple(state.shape[1:]) != shape or not state.is_contiguous()
            or slots.dtype is not torch.int64 or slots.device.type != "cpu"
            or tuple(slots.shape) != (rows,) or not slots.is_contiguous()):
        return None
    return state, slots.data_ptr()


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              state: torch.Tensor | None, activation: str, slots: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A depthwise causal conv1d's decode step (row_kernels.c `conv_step_rows`): x [B, 1, C],
    weight [C, W], state [B, C, W - 1] or None (zeros) -> (y [B, 1, C], the next state). With
    `slots` [B] (int64), `state` is the cache's [S, C, W - 1], moved on in place at those rows
    and returned as the next state. None when the kernel does not take these tensors."""
    ts = (x, weight) + tuple(t for t in (bias, state) if t is not None)
    if activation not in ("silu", "none") or not _usable(*ts) or x.dim() != 3 or x.shape[1] != 1:
        return None
    b, _, c = x.shape
    w = weight.shape[1]
    st = _slot_state(state, slots, b, (c, w - 1)) if weight.shape[0] == c else None
    if st is None:
        return None
    s2, slot_ptr = st
    x2, w2 = x.contiguous(), weight.contiguous()
    b2 = None if bias is None else bias.contiguous()
    y = torch.empty(b, 1, c, dtype=_F32)
    new = state if slots is not None else torch.empty(b, c, w - 1, dtype=_F32)
    _library().conv_step_rows(x2.data_ptr(), _ptr(s2), slot_ptr, w2.data_ptr(), _ptr(b2), b, c,
                              w, int(activation == "silu"), y.data_ptr(), new.data_ptr())
    return y, new


def ssm_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, state: torch.Tensor | None,
             slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mamba2's decode step (row_kernels.c `ssm_step_rows`): x [R, H, P], dt [R, H] (already
    discretized), B / C [R, G, N], A / D [H], state [R, H, P, N] or None (zeros) -> (y [R, H, P],
    the next state); with `slots`, the cache's [S, H, P, N] updated in place at those rows (as
    conv_step). None when the kernel does not take these tensors."""
    ts = (x, dt, A, B, C, D) + (() if state is None else (state,))
    if not _usable(*ts):
        return None
    r, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    st = None if h % g else _slot_state(state, slots, r, (h, p, n))
    if st is None:
        return None
    s2, slot_ptr = st
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    y = torch.empty(r, h, p, dtype=_F32)
    new = state if slots is not None else torch.empty(r, h, p, n, dtype=_F32)
    _library().ssm_step_rows(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(),
                             C.data_ptr(), D.data_ptr(), _ptr(s2), slot_ptr, r, h, p, n, g,
                             y.data_ptr(), new.data_ptr(), torch.get_num_threads())
    return y, new


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor | None, slots: torch.Tensor | None = None,
             l2norm: bool = False, scale: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta rule's decode step (row_kernels.c `gdn_step_rows`): q / k [R, Hk, K]
    (each serving H / Hk consecutive value heads; with `l2norm` normalized in the step, q then
    times `scale`), v [R, H, V], g / beta [R, H], state [R, H, K, V] or None -> (o [R, H, V],
    the next state); with `slots`, the cache's [S, H, K, V] updated in place at those rows (as
    conv_step). None when the kernel does not take these tensors."""
    ts = (q, k, v, g, beta) + (() if state is None else (state,))
    if not _usable(*ts) or q.dim() != 3 or q.shape != k.shape or v.dim() != 3:
        return None
    r, hk, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    if h % hk or dk > 4096 or tuple(g.shape) != (r, h) or tuple(beta.shape) != (r, h):
        return None
    st = _slot_state(state, slots, r, (h, dk, dv))
    if st is None:
        return None
    s2, slot_ptr = st
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(r, h, dv, dtype=_F32)
    new = state if slots is not None else torch.empty(r, h, dk, dv, dtype=_F32)
    _library().gdn_step_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
                             beta.data_ptr(), _ptr(s2), slot_ptr, r, h, hk, dk, dv, int(l2norm),
                             float(scale), o.data_ptr(), new.data_ptr(), torch.get_num_threads())
    return o, new


def _rows2(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """x [1, T, ...] as [T, width] rows with a stride (a view of a projection's columns), or
    None when its last dims are not `width` dense values a row."""
    if x.numel() == 0 or x.shape[0] != 1:
        return None
    x2 = x.reshape(x.shape[1], -1)
    return x2 if x2.shape[1] == width and x2.stride(1) == 1 else None


def _state_ok(state: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return tuple(state.shape[1:]) == shape and state.is_contiguous()


def _spec_ok(spec: torch.Tensor | None, shape: tuple[int, ...], ntok: int) -> bool:
    """A verify step's spec states [slots, K + 1, *shape] with room for `ntok` tokens."""
    return (spec is not None and spec.dtype is _F32 and spec.device.type == "cpu"
            and spec.dim() == len(shape) + 2 and tuple(spec.shape[2:]) == shape
            and spec.shape[1] >= ntok and spec.is_contiguous())


def mamba2_decode(xbc, z, dt, conv_w, conv_b, conv_state, slots, A, D, dt_bias, dt_min, dt_max,
                  ssm_state, norm_w, eps, group, h, p, n, g, ntok: int = 1, conv_spec=None,
                  ssm_spec=None) -> torch.Tensor | None:
    """A Mamba2 mixer's step from its in_proj columns (xbc [1, T, C], z [1, T, H P], dt
    [1, T, H]) to its gated norm's output [1, T, H P] in one C call (row_kernels.c
    `mamba2_decode_rows`: the chain's kernels in its order). T = sequences x `ntok`: without
    spec states one token each, states updated in place at `slots`; with them (a verify step)
    each sequence's tokens in turn, the states after each into its spec entries. None when the
    kernel does not take these tensors."""
    ts = [xbc, z, dt, conv_w, conv_state, A, D, dt_bias, ssm_state, norm_w]
    if conv_b is not None:
        ts.append(conv_b)
    if not _usable(*ts) or slots.dtype is not torch.int64 or not slots.is_contiguous():
        return None
    dx, c = h * p, h * p + 2 * g * n
    t, width = xbc.shape[1], conv_w.shape[-1]
    x2, z2, dt2 = _rows2(xbc, c), _rows2(z, dx), _rows2(dt, h)
    verify = conv_spec is not None or ssm_spec is not None
    if (x2 is None or z2 is None or dt2 is None or tuple(slots.shape) != (t // ntok,)
            or t % ntok or h % g or not conv_w.is_contiguous()
            or tuple(conv_w.shape) != (c, width)
            or not _state_ok(conv_state, (c, width - 1)) or not _state_ok(ssm_state, (h, p, n))
            or dx % group or norm_w.numel() != dx or A.numel() != h or D.numel() != h
            or dt_bias.numel() != h or (not verify and ntok != 1)
            or (verify and not (_spec_ok(conv_spec, (c, width - 1), ntok)
                                and _spec_ok(ssm_spec, (h, p, n), ntok)
                                and conv_spec.shape[1] == ssm_spec.shape[1]))):
        return None
    out = torch.empty(1, t, dx, dtype=_F32)
    b2 = None if conv_b is None else conv_b.contiguous()
    A, D, dt_bias, norm_w = (v.contiguous() for v in (A, D, dt_bias, norm_w))
    k1 = conv_spec.shape[1] if verify else 1
    rc = _library().mamba2_decode_rows(
        x2.data_ptr(), x2.stride(0), z2.data_ptr(), z2.stride(0), dt2.data_ptr(), dt2.stride(0),
        t // ntok, ntok, slots.data_ptr(), conv_state.data_ptr(), _ptr(conv_spec),
        conv_w.data_ptr(), _ptr(b2), width, ssm_state.data_ptr(), _ptr(ssm_spec), k1,
        A.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), float(dt_min), float(dt_max), h, p, n, g,
        norm_w.data_ptr(), float(eps), group, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("mamba2_decode_rows: no scratch memory")
    return out


def gdn_decode(qkv, b, a, z, conv_w, conv_b, conv_state, slots, A, dt_bias, gdn_state, l2norm,
               scale, norm_w, eps, group, hk, h, dk, dv, ntok: int = 1, conv_spec=None,
               gdn_spec=None) -> torch.Tensor | None:
    """A gated-delta (Qwen3.5) mixer's step from its in_proj columns (qkv [1, T, C], b / a
    [1, T, H], z [1, T, H, V]; the norm per head: weight [V]) to its gated norm's output
    [1, T, H, V] in one C call (row_kernels.c `gdn_decode_rows`; decode or verify as
    mamba2_decode), or None when the kernel does not take these tensors."""
    ts = [qkv, b, a, z, conv_w, conv_state, A, dt_bias, gdn_state, norm_w]
    if conv_b is not None:
        ts.append(conv_b)
    if not _usable(*ts) or slots.dtype is not torch.int64 or not slots.is_contiguous():
        return None
    vd, c = h * dv, 2 * hk * dk + h * dv
    t, width = qkv.shape[1], conv_w.shape[-1]
    q2, b2, a2, z2 = _rows2(qkv, c), _rows2(b, h), _rows2(a, h), _rows2(z, vd)
    verify = conv_spec is not None or gdn_spec is not None
    if (q2 is None or b2 is None or a2 is None or z2 is None
            or tuple(slots.shape) != (t // ntok,) or t % ntok or h % hk or dk > 4096
            or not conv_w.is_contiguous() or tuple(conv_w.shape) != (c, width)
            or not _state_ok(conv_state, (c, width - 1))
            or not _state_ok(gdn_state, (h, dk, dv)) or dv % group or norm_w.numel() != dv
            or A.numel() != h or dt_bias.numel() != h or (not verify and ntok != 1)
            or (verify and not (_spec_ok(conv_spec, (c, width - 1), ntok)
                                and _spec_ok(gdn_spec, (h, dk, dv), ntok)
                                and conv_spec.shape[1] == gdn_spec.shape[1]))):
        return None
    out = torch.empty(1, t, h, dv, dtype=_F32)
    cb = None if conv_b is None else conv_b.contiguous()
    A, dt_bias, norm_w = (v.contiguous() for v in (A, dt_bias, norm_w))
    k1 = conv_spec.shape[1] if verify else 1
    rc = _library().gdn_decode_rows(
        q2.data_ptr(), q2.stride(0), b2.data_ptr(), b2.stride(0), a2.data_ptr(), a2.stride(0),
        z2.data_ptr(), z2.stride(0), t // ntok, ntok, slots.data_ptr(), conv_state.data_ptr(),
        _ptr(conv_spec), conv_w.data_ptr(), _ptr(cb), width, gdn_state.data_ptr(),
        _ptr(gdn_spec), k1, A.data_ptr(), dt_bias.data_ptr(), hk, h, dk, dv, int(l2norm),
        float(scale), norm_w.data_ptr(), float(eps), group, out.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise MemoryError("gdn_decode_rows: no scratch memory")
    return out


class StatePromoter:
    """`promote_states` over fixed (main [S, ...], spec [S, K1, ...]) pairs, the cache's own
    buffers (which a deployment never replaces): checked and their pointers laid out once, so a
    step's commit is one C call and two small host lists. `usable` False: the C call cannot
    take them (no library, off the CPU, not contiguous, a spec that is not [S, K1, *main's
    entry] of main's dtype); the caller copies with torch."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs  # (kept alive: the pointers below are theirs)
        self.lib = _library()
        self.k1 = pairs[0][1].shape[1] if pairs else 0
        self.n_slots = pairs[0][0].shape[0] if pairs else 0
        self.usable = self.lib is not None and bool(pairs) and all(
            main.device.type == "cpu" and spec.device.type == "cpu" and main.dtype == spec.dtype
            and main.is_contiguous() and spec.is_contiguous()
            and spec.shape == (main.shape[0], self.k1, *main.shape[1:])
            and main.shape[0] == self.n_slots for main, spec in pairs)
        if self.usable:
            self.lists = torch.tensor([[m.data_ptr() for m, _ in pairs],
                                       [sp.data_ptr() for _, sp in pairs],
                                       [m[0].nbytes for m, _ in pairs]], dtype=torch.int64)

    def __call__(self, slots: list[int], idx: list[int]) -> bool:
        """`main[slots[r]] = spec[slots[r], idx[r]]` for every pair; False (nothing done) where
        not `usable`; IndexError for a slot or index out of range."""
        if not self.usable:
            return False
        if len(slots) != len(idx):
            raise ValueError(f"promote_states: {len(slots)} slots, {len(idx)} indices")
        for s, i in zip(slots, idx):
            if not (0 <= s < self.n_slots and 0 <= i < self.k1):
                raise IndexError(f"promote_states: slots {slots} must lie in [0, "
                                 f"{self.n_slots}) and indices {idx} in [0, {self.k1})")
        if not slots:
            return True
        rows = torch.tensor([slots, idx], dtype=torch.int64)
        lst = self.lists
        self.lib.promote_states(len(self.pairs), lst[0].data_ptr(), lst[1].data_ptr(),
                                lst[2].data_ptr(), self.k1, rows[0].data_ptr(),
                                rows[1].data_ptr(), len(slots), torch.get_num_threads())
        return True


def promote_states(pairs: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int],
                   idx: list[int]) -> bool:
    """`main[slots[r]] = spec[slots[r], idx[r]]` for every (main [S, ...], spec [S, K1, ...])
    pair, in one C call (row_kernels.c `promote_states`). False (nothing done) where the call
    cannot take them (`StatePromoter.usable`); IndexError for a slot or index out of range."""
    return StatePromoter(pairs)(slots, idx)
