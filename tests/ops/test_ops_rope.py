from __future__ import annotations

import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops import rope_cos_sin


def _inv_freq(dim, base=10000.0):
    return 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)


def test_rope_full_rotation_matches_complex_form(close):
    # rotate-half RoPE == multiplying (x_i, x_{i+D/2}) pairs by e^{i * pos * f_i}
    x = torch.randn(2, 9, 3, 16)
    pos = torch.arange(9).expand(2, 9)
    cos, sin = rope_cos_sin(pos, _inv_freq(16))
    out = torch.ops.specdeploy.rope(x, cos, sin)
    angle = pos[..., None, None].float() * _inv_freq(16)
    z = torch.complex(x[..., :8], x[..., 8:]) * torch.polar(torch.ones_like(angle), angle)
    close(out, torch.cat((z.real, z.imag), dim=-1))


def test_rope_partial_rotary_passes_the_rest(close):
    x = torch.randn(1, 5, 2, 16)
    cos, sin = rope_cos_sin(torch.arange(3, 8)[None], _inv_freq(4))
    assert cos.shape == (1, 5, 4)
    out = torch.ops.specdeploy.rope(x, cos, sin)
    close(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])


def test_mrope_text_positions_equal_plain_rope(close):
    pos = torch.arange(11)[None]
    plain = rope_cos_sin(pos, _inv_freq(24))
    for interleaved in (False, True):
        m = rope_cos_sin(pos, _inv_freq(24), mrope_section=[4, 4, 4], mrope_interleaved=interleaved)
        close(m.cos, plain.cos)
        close(m.sin, plain.sin)


def test_mrope_sections_pick_axes():
    # distinct positions per axis reveal which axis each frequency slot reads
    inv = torch.ones(6)
    pos = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    contiguous = rope_cos_sin(pos, inv, mrope_section=[2, 2, 2]).cos[0, 0, :6]
    assert torch.equal(contiguous, torch.tensor([1.0, 1, 2, 2, 3, 3]).cos())
    interleaved = rope_cos_sin(pos, inv, mrope_section=[2, 2, 2], mrope_interleaved=True)
    assert torch.equal(interleaved.cos[0, 0, :6], torch.tensor([1.0, 2, 3, 1, 2, 3]).cos())
    # section [3, 2, 1]: slot 5 (axis 2 by stride) is beyond 3 * 1 -> temporal
    uneven = rope_cos_sin(pos, inv, mrope_section=[3, 2, 1], mrope_interleaved=True).cos
    assert torch.equal(uneven[0, 0, :6], torch.tensor([1.0, 2, 3, 1, 2, 1]).cos())


def _cos_sin64(pos3, inv, axis, scaling):
    """float64 oracle over the same fp32 frequency (the product rounded once, as torch's)."""
    idx = torch.as_tensor(axis)[None, None, :].expand(1, *pos3.shape[1:], len(axis))
    f = (pos3.float()[..., None] * inv).gather(0, idx)[0].double()
    emb = torch.cat((f, f), -1)
    return emb.cos() * scaling, emb.sin() * scaling


def test_cos_sin_c_kernel_against_float64_and_the_torch_form():
    """`specdeploy::rope_cos_sin` on the CPU is one C call (row_kernels.c): per slot the
    position axis as `_merge_mrope` picks it (1-D; interleaved and blocked mRoPE sections, with
    and without slots left over), libm's cos / sin of torch's fp32 frequency: within 2 ulp of
    fp32 at |x| <= 1 (times the scaling) of the float64 values, and of `rope_cos_sin_ref`."""
    from specdeploy.ops import row_kernels
    from specdeploy.ops.rope import rope_cos_sin_ref

    if row_kernels._library() is None:
        import pytest

        pytest.skip("no C compiler here")
    inv = _inv_freq(16, base=500000.0)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 40000, (2, 37), generator=g)
    pos3 = torch.stack([pos, pos + torch.randint(0, 50, pos.shape, generator=g), pos // 7])
    cases = [(pos, None, False, [0] * 8), (pos, [3, 3, 2], True, None),
             (pos3, [3, 3, 2], True, None), (pos3, [3, 3, 2], False, None),
             (pos3, [2, 1, 1], True, None), (pos3, [2, 1, 1], False, None),
             (pos3, [4, 3, 1], True, None), (pos3, [4, 3, 1], False, None)]
    for p, sec, inter, axis in cases:
        for scaling in (1.0, 1.3466):
            got = rope_cos_sin(p, inv, sec, inter, attention_scaling=scaling)
            assert got.cos.shape == (2, 37, 16) and got.cos.dtype == torch.float32
            p3 = p if p.dim() == 3 else p.expand(3, *p.shape)
            want_c, want_s = _cos_sin64(p3, inv, axis or _axis(sec, inter), scaling)
            tol = 2.4e-7 * scaling  # libm's value and the scaling's product: 1 ulp each
            assert (got.cos.double() - want_c).abs().max() <= tol, (sec, inter, scaling)
            assert (got.sin.double() - want_s).abs().max() <= tol, (sec, inter, scaling)
            ref = rope_cos_sin_ref(p, inv, sec, inter, scaling)
            assert (got.cos - ref.cos).abs().max() <= 2 * tol
            assert (got.sin - ref.sin).abs().max() <= 2 * tol


def _axis(sec, interleaved, half=8):
    """The axis of each frequency slot, written out from transformers' rules."""
    if sec is None:
        return [0] * half
    out = [0] * half
    if interleaved:
        for a in (1, 2):
            for j in range(a, min(3 * sec[a], half), 3):
                out[j] = a
    else:
        j = 0
        for a, n in enumerate(sec):
            for _ in range(n):
                out[j], j = a, j + 1
    return out
