"""GGUF's lattice-codebook kinds (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) and the
ternary TQ1_0 / TQ2_0 read as stored (ops/ggml_iq.c) by the exact kernel and the integer-dot
kernel, against oracles the kernels did not produce:

1. gguf-py's dequantization: the exact kernel's values equal it bit for bit (every product
   f * s * w is exact in fp32), and its matmul is within fp32 round-off of a float64 matmul
   over those values;
2. the integer-dot kernel stays within the bound the 8-bit activation blocks imply (plus fp32
   round-off) of that float64 matmul, and equals the stated algorithm (x rounded per block of
   32, exact integer sums) re-done in float64 up to fp32 round-off.

Plus: every ISA path and row-group size bit-identical, rows batch- and thread-invariant, the
largest scales and a NaN in x, IQ1_M's scattered d, and tiny NemotronH MoE GGUFs of these kinds
deployed on their blocks (linears and experts) with greedy MTP equal to plain decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_int as gi
from specdeploy.ops import ggml_linear as gl
from tests.ops.test_ggml_int import _errors, _x, assert_rows_invariant

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
IQ = {"iq2_xxs": Q.IQ2_XXS, "iq2_xs": Q.IQ2_XS, "iq2_s": Q.IQ2_S, "iq3_xxs": Q.IQ3_XXS,
      "iq3_s": Q.IQ3_S, "iq1_s": Q.IQ1_S, "iq1_m": Q.IQ1_M,
      "tq1_0": Q.TQ1_0, "tq2_0": Q.TQ2_0}  # (the ternary kinds: read by the same file)

pytestmark = pytest.mark.skipif(
    gl.kernel_unavailable() is not None or gi.kernel_unavailable() is not None,
    reason=f"GGUF kernels unavailable: {gl.kernel_unavailable() or gi.kernel_unavailable()}")
HAVE = gi.supported_isas()
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in HAVE, reason=f"this CPU / build does not run {isa} (runs {HAVE})"))
    for isa in gi.ISAS]
SHAPES = [(8, 256), (37, 512), (64, 768)]


def _raw(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    from tests.checkpoint.gguf_nemotron_h_layout import random_kquant

    return random_kquant(IQ[kind], (n, k), np.random.default_rng(seed))


def _weight(kind: str, n: int, k: int, seed: int) -> tuple[gl.GGMLWeight, np.ndarray]:
    """Random blocks (any bits, a small d) and gguf-py's float64 values of them."""
    raw = _raw(kind, n, k, seed)
    values = gguf.quants.dequantize(raw, IQ[kind]).reshape(n, k).astype(np.float64)
    return gl.make_weight(kind, torch.from_numpy(raw), (n, k)), values


def _set_d(kind: str, raw: np.ndarray, d: np.ndarray) -> None:
    """Every block's fp16 d (uint16 bits [..., blocks]) written in place (IQ1_M: its nibbles)."""
    size = gl.KINDS[kind][1]
    b = raw.reshape(*raw.shape[:-1], -1, size)
    if kind == "iq1_m":
        sc = b[..., 48:56].copy().view(np.uint16)
        for j in range(4):
            sc[..., j] = (sc[..., j] & 0x0FFF) | (((d >> 4 * j) & 0xF) << 12)
        b[..., 48:56] = sc.view(np.uint8)
    elif kind.startswith("tq"):  # d last
        b[..., size - 2:size] = d[..., None].view(np.uint8)
    else:
        b[..., 0:2] = d[..., None].view(np.uint8)


@pytest.mark.parametrize("kind", list(IQ))
def test_dequantize_is_gguf_py_bit_for_bit(kind):
    """Any bytes, d from zero and subnormals to 65504 and +-inf: the same fp32 bits (a NaN d
    gives NaN values); rows gathered from stacked experts too."""
    n, k = 24, 512
    raw = _raw(kind, n, k, seed=11)
    specials = np.array([0x0000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00,
                         0xFC00, 0x1234, 0x8001], np.uint16)
    d = np.resize(specials, (n, k // 256))
    _set_d(kind, raw, d)
    with np.errstate(invalid="ignore"):  # (TQ's inf d times a 0 digit: NaN, both ways)
        want = gguf.quants.dequantize(raw, IQ[kind]).reshape(n, k)
    w = gl.make_weight(kind, torch.from_numpy(raw), (n, k))
    got = gl.dequantize(w).numpy()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert np.isinf(want).any() and (want == 0).any() and (np.signbit(want) & (want == 0)).any()
    if kind == "iq1_m":
        assert np.array_equal(gl.iq1_m_scales(torch.from_numpy(raw.reshape(n, -1, 56)))
                              .view(torch.int16).numpy().view(np.uint16), d)
    experts = gl.make_weight(kind, torch.from_numpy(raw.reshape(2, n // 2, -1)), (2, n // 2, k))
    rows = torch.tensor([5, 0, 23, 17])
    assert torch.equal(gl.dequantize(experts, rows), torch.from_numpy(want[rows.numpy()]))
    _set_d(kind, raw, np.full((n, k // 256), 0x7E00, np.uint16))  # NaN
    assert torch.isnan(gl.dequantize(gl.make_weight(kind, torch.from_numpy(raw), (n, k)))).all()


@pytest.mark.parametrize("kind", list(IQ))
def test_exact_kernel_is_the_fp32_model(kind):
    """The exact kernel: within fp32 round-off (8 lanes of K / 8 fmas, then the lane sum) of a
    float64 matmul over gguf-py's values; each row the same bits alone as in a batch."""
    for n, k in SHAPES:
        w, values = _weight(kind, n, k, seed=n)
        x = _x(7, k, seed=k)
        y = gl.ggml_linear(x, w).double().numpy()
        xd = x.double().numpy()
        bound = (k / 8 + 4) * 2.0**-24 * (np.abs(xd) @ np.abs(values).T)
        assert (np.abs(y - xd @ values.T) <= bound).all()
        alone = torch.cat([gl.ggml_linear(x[i:i + 1], w) for i in range(7)]).double().numpy()
        assert np.array_equal(alone, y)


def _check(y: torch.Tensor, x: torch.Tensor, values: np.ndarray) -> None:
    err, err_emul, bound, fp32 = _errors(y, x, values, np.zeros_like(values))
    assert (err_emul <= fp32).all(), (err_emul / fp32).max()
    assert (err <= bound + fp32).all(), ((err - fp32) / bound).max()


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(IQ))
def test_integer_kernel_within_the_activation_bound_and_equal_to_the_emulation(kind, isa):
    worst = 0.0
    for n, k in SHAPES:
        w, values = _weight(kind, n, k, seed=n + k)
        for rows in (1, 2, 3, 5, 9):
            x = _x(rows, k, seed=rows)
            y = gi.ggml_linear_int(x, w, isa=isa)
            _check(y, x, values)
            err, _, bound, _ = _errors(y, x, values, np.zeros_like(values))
            worst = max(worst, float((err / np.maximum(bound, 1e-30)).max()))
    assert worst > 0.05  # the bound is not vacuous


@pytest.mark.parametrize("kind", list(IQ))
def test_every_row_group_size_is_bit_identical_to_scalar(kind):
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    w, _ = _weight(kind, 40, 512, seed=3)
    x = _x(13, 512, seed=4)
    for rows in range(1, 14):
        want = gi.ggml_linear_int(x[:rows], w, isa="scalar")
        for isa in HAVE[1:]:
            assert torch.equal(gi.ggml_linear_int(x[:rows], w, isa=isa), want), (isa, rows)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(IQ))
def test_rows_are_batch_and_thread_invariant(kind, isa):
    w, _ = _weight(kind, 72, 256, seed=1)
    assert_rows_invariant(w, _x(9, 256, seed=1), isa)


def _largest(kind: str, n: int, k: int) -> np.ndarray:
    """Blocks of the largest scales and codebook values: every byte 0xFF but d (the top grid
    index and scale), then each group's grid indices set to the entry of largest |values|."""
    from gguf import quants

    raw = np.full((n, k // 256, gl.KINDS[kind][1]), 0xFF, np.uint8)
    if kind.startswith("tq"):  # every digit at its largest (TQ2_0's 3: w = 2)
        out = raw.reshape(n, -1)
        _set_d(kind, out, np.full((n, k // 256), 0x0C00, np.uint16))
        return out
    name = {"iq1_m": "IQ1_S"}.get(kind, kind.upper())
    cls = getattr(quants, name)
    cls.init_grid()
    top = int(np.abs(np.asarray(cls.grid).reshape(cls.grid_shape)).sum(-1).argmax())
    if kind in ("iq2_xxs", "iq3_xxs"):  # the grid bytes: 4 of every 8 / the first 64
        where = [2 + 8 * g + j for g in range(8) for j in range(4)] if kind == "iq2_xxs" \
            else list(range(2, 66))
        raw[..., where] = top
    elif kind == "iq2_xs":  # uint16: 9-bit index, sign index 127 (parity: one sign flipped)
        raw[..., 2:66] = np.frombuffer(np.uint16(top | 127 << 9).tobytes(), np.uint8)[
            np.arange(64) % 2]
    elif kind in ("iq2_s", "iq3_s"):  # low index bytes and their high bits
        hi_bits = 2 if kind == "iq2_s" else 1
        per = 8 // hi_bits
        count = 32 if kind == "iq2_s" else 64
        raw[..., 2:2 + count] = top & 0xFF
        hb = 0
        for j in range(per):
            hb |= (top >> 8) << (hi_bits * j)
        raw[..., 66:74] = hb
    else:  # IQ1: low index bytes, the 3 high bits in the uint16 / nibbles
        lo = slice(2, 34) if kind == "iq1_s" else slice(0, 32)
        raw[..., lo] = top & 0xFF
        h = top >> 8
        if kind == "iq1_s":
            raw[..., 34:50] = np.frombuffer(np.uint16(0xF000 | h | h << 3 | h << 6 | h << 9)
                                            .tobytes(), np.uint8)[np.arange(16) % 2]
        else:
            raw[..., 32:48] = h | h << 4 | 0x88
    out = raw.reshape(n, -1)
    _set_d(kind, out, np.full((n, k // 256), 0x0C00, np.uint16))  # 2^-12
    return out


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", list(IQ))
def test_largest_blocks_and_nan(kind, isa):
    """x at +-127 in every lane against the largest scales and codebook values (an int16
    saturation or int32 overflow would show as a wrong sum); a NaN in x reaches its row."""
    n, k = 16, 512
    raw = _largest(kind, n, k)
    w = gl.make_weight(kind, torch.from_numpy(raw), (n, k))
    values = gguf.quants.dequantize(raw, IQ[kind]).reshape(n, k).astype(np.float64)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    y = gi.ggml_linear_int(x, w, isa=isa)
    _check(y, x, values)
    x[0, 300] = float("nan")
    assert torch.isnan(gi.ggml_linear_int(x, w, isa=isa)[0]).all()
    assert torch.isnan(gl.ggml_linear(x, w)[0]).all()


def test_non_finite_iq1_m_scale_is_refused(tmp_path):
    """IQ1_M's d lies in four nibbles: a deferred load still finds an inf there."""
    from specdeploy.checkpoint.errors import CheckpointError
    from specdeploy.loading import _defer_blocks

    raw = _raw("iq1_m", 16, 256, seed=2)
    _set_d("iq1_m", raw, np.full((16, 1), 0x7C00, np.uint16))
    w = gl.make_weight("iq1_m", torch.from_numpy(raw), (16, 256))
    model = torch.nn.Linear(256, 16, bias=False)
    with pytest.raises(CheckpointError, match="'weight' has non-finite block scales"):
        _defer_blocks(model, {"weight": w}, {"weight": torch.zeros(16, 256)}, tmp_path)


# (matrices, experts): what llama-quantize's IQ file types pair (e.g. IQ2_XXS experts under
# IQ3_XXS / IQ2_XS attention); all seven kinds
DEPLOYED = [("iq3_xxs", "iq2_xxs"), ("iq2_xs", "iq1_s"), ("iq3_s", "iq1_m"), ("iq2_s", "iq2_s"),
            ("tq2_0", "tq1_0")]


@pytest.fixture(scope="module", params=DEPLOYED, ids=lambda kinds: "+".join(kinds))
def iq_gguf(request, tmp_path_factory):
    """The tiny NemotronH MoE of widths in 256s with the param's kinds for its matrices and its
    experts (random blocks)."""
    from tests.checkpoint.gguf_nemotron_h_layout import wide_moe_gguf

    matrices, experts = request.param
    path = wide_moe_gguf(tmp_path_factory.mktemp("iq"), IQ[matrices], IQ[experts])
    return path, set(request.param)


def test_gguf_deploys_on_its_blocks(iq_gguf):
    """"fast": every block matrix and both expert groups on the integer-dot kernel (no tiled
    copy: these kinds have none), logits within the shared check of the fp32 model read from
    the same file; greedy MTP speculation equals plain decoding."""
    from specdeploy.loading import load_model
    from specdeploy.ops import ggml_moe_int
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    path, kinds = iq_gguf
    assert_deploys_on_blocks(path, "fast", kinds, min_linears=10)
    experts = [w for w in load_model(path).ggml_weights.values() if len(w.shape) == 3]
    assert len(experts) == 4 and not any(ggml_moe_int.tiles(w, w) for w in experts)
    assert_mtp_equals_plain(path, max_tokens=16)


def test_gguf_deploys_on_the_exact_kernel(iq_gguf):
    """"exact": the same GGUF's logits within 1e-5 of the fp32 model's."""
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    path, kinds = iq_gguf
    if kinds != {"iq3_xxs", "iq2_xxs"}:
        pytest.skip("one pair is enough for the exact kernel (the values are checked above)")
    assert_deploys_on_blocks(path, "exact", kinds, min_linears=10)
