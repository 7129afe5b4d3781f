"""The K-quants (Q2_K ... Q6_K), IQ4_XS and IQ3_XXS / IQ3_S as IQ4_XS tiles
(ops/ggml_tiled_kquant.c) and IQ4_NL (ggml_tiled.c) on the tiled integer-dot kernel, each ISA
path this CPU runs, against oracles the kernel did not produce:

1. a GGUF dequantizer of its own (transformers' for Q4_K / Q5_K / Q6_K, gguf-py's for Q3_K /
   Q2_K / IQ4_XS / IQ4_NL) + a float64 matmul, within the bound the 8-bit activation blocks
   imply plus fp32 round-off;
2. the stated algorithm (8-bit activation blocks of 32, exact integer sums per group; Q4_K /
   Q5_K's offset -dmin * m meeting the exact sum of x, Q2_K's the quantized one) re-done in
   float64: equal up to fp32 round-off.

Plus: bit-identical across ISA paths, every row-group size and the minimum terms' own pass,
rows and threads (batch invariance); the tiled copy's rows are gguf's values bit for bit, in
the same bytes; extreme blocks (the int16 sums at their largest, Q6_K's scale -128) equal the
emulation; GGUFs of these kinds deploy with their linears and experts on tiled copies.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl
from specdeploy.ops import ggml_tiled as gt
from tests.ops.test_ggml_int import _errors, _x
from tests.ops.test_ggml_kquants import KQ as KQ_HF
from tests.ops.test_ggml_kquants import _kq_offsets
from tests.ops.test_ggml_kquants import _weight as _hf_weight

gguf = pytest.importorskip("gguf")
_Q = gguf.GGMLQuantizationType
KQ = {**KQ_HF, "q3_k": _Q.Q3_K, "q2_k": _Q.Q2_K, "iq4_xs": _Q.IQ4_XS, "iq4_nl": _Q.IQ4_NL,
      "iq3_s": _Q.IQ3_S, "iq3_xxs": _Q.IQ3_XXS, "iq2_xxs": _Q.IQ2_XXS, "iq1_s": _Q.IQ1_S,
      "tq1_0": _Q.TQ1_0, "tq2_0": _Q.TQ2_0}

pytestmark = pytest.mark.skipif(gt.kernel_unavailable() is not None,
                                reason=f"tiled kernel unavailable: {gt.kernel_unavailable()}")
HAVE = gt.supported_isas()
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in HAVE, reason=f"this CPU / build does not run {isa} (runs {HAVE})"))
    for isa in gt.ISAS]
SHAPES = [(16, 256), (48, 768), (80, 512)]  # 1, 3 and 5 tiles; 1, 3 and 2 super-blocks


def _weight(kind: str, n: int, k: int, seed: int) -> tuple[gl.GGMLWeight, torch.Tensor]:
    """Random valid blocks and their fp32 values by a dequantizer of its own."""
    if kind in KQ_HF:
        return _hf_weight(kind, n, k, seed)
    from tests.checkpoint.gguf_nemotron_h_layout import random_kquant

    raw = random_kquant(KQ[kind], (n, k), np.random.default_rng(seed))
    values = torch.from_numpy(gguf.quants.dequantize(raw, KQ[kind]).reshape(n, k))
    return gl.make_weight(kind, torch.from_numpy(raw), (n, k)), values


def _check(y: torch.Tensor, x: torch.Tensor, w: gl.GGMLWeight, values: torch.Tensor) -> None:
    n, k = w.shape
    # (Q2_K's minimums meet the quantized x, as its scales do: no exact-x offset)
    m = (_kq_offsets(w.kind, w.blocks.numpy(), n, k) if w.kind in ("q4_k", "q5_k")
         else np.zeros((n, k)))
    err, err_emul, bound, fp32 = _errors(y, x, values.double().numpy(), m)
    assert (err_emul <= fp32).all(), (err_emul / fp32).max()
    assert (err <= bound + fp32).all(), ((err - fp32) / bound).max()


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", sorted(KQ))
def test_within_the_activation_bound_and_equal_to_the_emulation(kind, isa):
    for n, k in SHAPES:
        w, values = _weight(kind, n, k, seed=n + k)
        tw = gt.repack(w)
        for rows in (1, 2, 3, 5, 9):
            x = _x(rows, k, seed=rows) * 0.05
            _check(gt.tiled_linear(x, tw, isa=isa), x, w, values)


@pytest.mark.parametrize("kind", sorted(KQ))
def test_every_row_group_size_is_bit_identical_to_scalar(kind):
    """Rows 1..13: the AVX2 row groups (5 for Q4_K, 4 for the others) and their remainders,
    the minimum terms in the group loop (1-2 rows) or in a pass of their own (3 on)."""
    if len(HAVE) < 2:
        pytest.skip(f"only {HAVE} here")
    w, _ = _weight(kind, 48, 768, seed=5)
    tw = gt.repack(w)
    x = _x(13, 768, seed=6)
    for rows in range(1, 14):
        want = gt.tiled_linear(x[:rows], tw, isa="scalar")
        for isa in HAVE[1:]:
            assert torch.equal(gt.tiled_linear(x[:rows], tw, isa=isa), want), (isa, rows)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", sorted(KQ))
def test_rows_are_batch_and_thread_invariant(kind, isa):
    """Row r's output is bit-identical alone and in any batch of up to 11 rows, at 1 or 2
    threads (13 tiles: uneven thread ranges): a decode row equals itself in a verify step."""
    from tests.ops.test_ggml_tiled import assert_batch_and_thread_invariant

    assert_batch_and_thread_invariant(gt.repack(_weight(kind, 208, 512, seed=1)[0]),
                                      _x(11, 512, seed=1), isa)


@pytest.mark.parametrize("kind", sorted(KQ))
def test_repack_round_trip_and_stacking(kind):
    """tiled_rows gives the dequantizer's values bit for bit; the copy has the blocks' bytes;
    a list of weights repacks to the copy of their stack (members not in 16s)."""
    w, values = _weight(kind, 48, 512, seed=5)
    tw = gt.repack(w)
    extra = 48 // 16 * 2 * 16 * 4 if kind == "q3_k" else 0  # (its scales unpacked: 4 B more)
    if kind in gt.TRANSCODED:  # IQ4_XS's 136 bytes a super-block
        extra = 48 * 2 * (136 - gl.KINDS[kind][1])
    assert tw.packed.nbytes == w.blocks.nbytes + extra and tw.shape == (48, 512)
    assert torch.equal(gt.tiled_rows(tw, torch.arange(48)), values)
    ids = torch.tensor([[47, 0], [17, 17]])
    assert torch.equal(gt.tiled_rows(tw, ids), values[ids.reshape(-1)])
    parts = [_weight(kind, n, 512, seed=n)[0] for n in (8, 20, 4)]
    stacked = gt.repack(parts)
    assert torch.equal(stacked.packed, gt.repack(gl.concat_rows(parts)).packed)
    member = gt.TiledMember(stacked, 8, (20, 512))
    assert torch.equal(gt.member_rows(member), gl.dequantize(parts[1]))
    assert torch.equal(gt.member_rows(member, torch.tensor([19, 0])),
                       gl.dequantize(parts[1])[[19, 0]])


def _extreme(kind: str, n: int, k: int) -> np.ndarray:
    """Blocks at the kernel's limits: every value and 6-bit scale at its largest (the int16
    sums' worst case), Q6_K's values at -32 and its scales at -128 on odd outputs, Q3_K's at
    -4 and -32 on even ones (3 and 31 on odd ones), IQ4's at -127 (IQ4_XS: scale -32) on even
    ones (113, 31 on odd ones)."""
    size = gl.KINDS[kind][1]
    raw = np.zeros((n, k // gl.block_values(kind), size), np.uint8)
    half = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    if kind in gt.TRANSCODED:  # every index, sign and scale bit set (IQ3: s = 31), then d
        raw[...] = 0xFF
        at = size - 2 if kind.startswith("tq") else 0
        raw[..., at:at + 2] = half
    elif kind.startswith("iq4"):  # even outputs -127 (IQ4_XS: scale -32), odd 113 (31)
        raw[..., 0:2] = half
        raw[1::2, :, 2:] = 0xFF
    elif kind == "q2_k":
        raw[..., :80] = 0xFF  # sc = m = 15, q = 3
        raw[..., 80:82] = raw[..., 82:84] = half
    elif kind == "q3_k":
        raw[1::2, :, :108] = 0xFF  # hmask set, q = 3, scales 63 - 32
        raw[..., 108:110] = half
    elif kind == "q6_k":
        raw[..., 208:210] = half
        raw[0::2, :, :192] = 0xFF  # q = 63
        raw[0::2, :, 192:208] = 127
        raw[1::2, :, :192] = 0  # q = 0: -32
        raw[1::2, :, 192:208] = np.uint8(0x80)  # -128
    else:
        raw[..., 0:2] = raw[..., 2:4] = half
        raw[..., 4:size] = 0xFF  # scales, minimums 63; q 15 (Q5_K: 31)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kind", sorted(KQ))
def test_extreme_blocks_equal_the_emulation(kind, isa):
    """x at +-127 in every lane (the largest products) meets the largest blocks: an int16
    overflow would show as a wrong sum; a NaN in x reaches the output."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    n, k = 32, 512
    raw = torch.from_numpy(_extreme(kind, n, k))
    w = gl.make_weight(kind, raw, (n, k))
    values = (hf_dequantize(raw.reshape(-1), int(KQ[kind])) if kind in KQ_HF else torch.from_numpy(
        gguf.quants.dequantize(raw.numpy(), KQ[kind]))).reshape(n, k)
    assert values.abs().min() > 0
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    y = gt.tiled_linear(x, gt.repack(w), isa=isa)
    _check(y, x, w, values)
    assert torch.equal(y, torch.from_numpy(x.double().numpy() @ values.double().numpy().T)
                       .float())  # these sums are exact in fp32
    x[0, 300] = float("nan")
    assert torch.isnan(gt.tiled_linear(x, gt.repack(w), isa=isa)[0]).all()


# (matrices, experts): the kinds llama-quantize's K-quant and IQ4_XS file types write
DEPLOYED = [("q5_k", "q6_k"), ("q3_k", "q2_k"), ("iq4_xs", "iq4_nl"), ("iq3_s", "iq3_xxs")]


@pytest.fixture(scope="module", params=DEPLOYED, ids=lambda kinds: "+".join(kinds))
def kq_gguf(request, tmp_path_factory):
    """The tiny NemotronH MoE of widths in 256s with the param's kinds for its matrices and its
    experts (random valid blocks)."""
    from tests.checkpoint.gguf_nemotron_h_layout import wide_moe_gguf

    matrices, experts = request.param
    path = wide_moe_gguf(tmp_path_factory.mktemp("kqt"), KQ[matrices], KQ[experts])
    return path, set(request.param)


def test_gguf_deploys_on_tiled_copies(kq_gguf):
    """"fast": every block linear with outputs in 16s and both expert groups on tiled copies,
    logits within the shared check's 5e-2 of the fp32 model's; greedy MTP speculation equals
    plain decoding."""
    from specdeploy.deploy.build import build
    from specdeploy.loading import load_model
    from specdeploy.ops import ggml_moe_int
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    path, kinds = kq_gguf
    assert_deploys_on_blocks(path, "fast", kinds, min_linears=10)
    dep = build(str(path), kernels="fast", max_batch_size=2, max_seq_len=64, page_size=4,
                max_cache_gib=0.02)
    calls = [n for n in dep.gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "").startswith("linear_on_blocks")]
    untiled = [n.meta["val"].shape[-1] for n in calls if getattr(n.target, "tiled_call", None)
               is None]
    # (the Mamba in_proj's z, x, B, C, dt: 8 heads' dt leave its outputs out of 16s)
    assert len(calls) >= 8 and all(n % 16 for n in untiled), (len(calls), untiled)
    experts = [w for w in load_model(path).ggml_weights.values() if len(w.shape) == 3]
    assert len(experts) == 4 and all(ggml_moe_int.tiles(w, w) for w in experts)
    if kinds & set(gt.TRANSCODED):  # the report says which weights were transcoded
        detail = {i.name: i.detail for i in dep.infos}
        assert "2 with lattice kinds transcoded" in detail["ggml_moe_experts"], detail
        assert "lattice-kind weights transcoded to IQ4_XS tiles" in detail["ggml_linears"]
    assert_mtp_equals_plain(path, max_tokens=16)


def test_kquants_can_stay_on_the_integer_dot_kernel():
    """SPECDEPLOY_GGML_TILED_KQUANTS=0: K-quants are no tiled kind (the deployment keeps them on
    ops/ggml_int.py's kernel), the 32-value kinds still are."""
    from tests.ops.test_ggml_iq3_tiles import run_with

    run_with({"SPECDEPLOY_GGML_TILED_KQUANTS": "0"},
             "from specdeploy.ops import ggml_tiled as g, ggml_moe_int as m\n"
             "assert 'q4_1' in g.TILED_KINDS and m.TILED_KINDS == g.TILED_KINDS\n"
             "assert not set(g.TILED_K_QUANTS) & set(g.TILED_KINDS), g.TILED_KINDS\n")
    assert set(gt.TILED_K_QUANTS) <= set(gt.TILED_KINDS)  # (the default)
