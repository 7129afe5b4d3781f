from __future__ import annotations

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops.ssm import ssm_dt, ssm_scan_core, ssm_scan_ref

LENGTHS = (1, 7, 63, 130)

DT_MIN, DT_MAX = 1e-3, 5.0


def _inputs(t, b=2, h=4, p=3, g=2, n=5):
    return dict(
        x=torch.randn(b, t, h, p),
        dt=torch.randn(b, t, h),
        A=-torch.rand(h) * 4,
        B=torch.randn(b, t, g, n),
        C=torch.randn(b, t, g, n),
        D=torch.randn(h),
        dt_bias=torch.randn(h),
    )


def _scan(inp, chunk_size, initial_state=None, fn=None):
    fn = fn or torch.ops.specdeploy.ssm_scan
    return fn(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"],
        DT_MIN, DT_MAX, chunk_size, initial_state,
    )


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("with_state", (False, True))
@pytest.mark.parametrize("chunk_size", (16, 64))
def test_ssm_chunked_matches_recurrence(close, t, with_state, chunk_size):
    inp = _inputs(t)
    s0 = torch.randn(2, 4, 3, 5) if with_state else None
    y, state = _scan(inp, chunk_size, s0)
    y_ref, state_ref = _scan(inp, chunk_size, s0, fn=ssm_scan_ref)
    close(y, y_ref)
    close(state, state_ref)
    assert state.dtype == torch.float32


@pytest.mark.parametrize("split", (1, 40, 100))
def test_ssm_chunking_invariance(close, split):
    inp = _inputs(130)
    s0 = torch.randn(2, 4, 3, 5)
    y, state = _scan(inp, 32, s0)
    first = {k: (v[:, :split] if v.dim() > 1 else v) for k, v in inp.items()}
    second = {k: (v[:, split:] if v.dim() > 1 else v) for k, v in inp.items()}
    y1, s1 = _scan(first, 32, s0)
    y2, s2 = _scan(second, 32, s1)
    close(torch.cat((y1, y2), dim=1), y)
    close(s2, state)


def test_ssm_per_token_states(close):
    inp = _inputs(19)
    s0 = torch.randn(2, 4, 3, 5)
    delta = ssm_dt(inp["dt"], inp["dt_bias"], DT_MIN, DT_MAX)
    out = ssm_scan_core(
        inp["x"], delta, inp["A"], inp["B"], inp["C"], inp["D"], 8, s0, return_states=True
    )
    for i in (0, 7, 8, 18):
        prefix = {k: (v[:, : i + 1] if v.dim() > 1 else v) for k, v in inp.items()}
        close(out.states[:, i], _scan(prefix, 8, s0, fn=ssm_scan_ref)[1])


def test_ssm_dt_is_clamped():
    dt = torch.tensor([-30.0, 0.0, 30.0])
    assert torch.equal(ssm_dt(dt, torch.zeros(3), 0.01, 2.0)[[0, 2]], torch.tensor([0.01, 2.0]))


def test_ssm_bf16_inputs_keep_dtype(close):
    inp = {k: v.bfloat16() for k, v in _inputs(9).items()}
    y, state = _scan(inp, 4)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    close(y.float(), _scan(inp, 4, fn=ssm_scan_ref)[0].float(), rtol=2e-2)


def test_ssm_strong_decay_stays_finite(close):
    inp = _inputs(130)
    inp["dt"] = inp["dt"] * 4 + 6  # dt up to DT_MAX with |A| up to 4: exp(-20) per step
    y, state = _scan(inp, 64)
    y_ref, state_ref = _scan(inp, 64, fn=ssm_scan_ref)
    assert torch.isfinite(y).all()
    close(y, y_ref)
    close(state, state_ref)
