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
