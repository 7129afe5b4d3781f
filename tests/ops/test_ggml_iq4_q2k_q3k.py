"""GGUF IQ4_NL / IQ4_XS weights (ggml's non-linear 4-bit types: the IQ4_XS file type, and IQ4_NL
where its rows are not in 256s), Q3_K and Q2_K ones (the Q3_K_S / M / L and Q2_K file types) run
on their blocks, as the other block kinds. Before, they loaded as fp32 (~7-11x their bytes).
gguf-py cannot quantize to them: the blocks are random valid ones (tests/checkpoint/
gguf_nemotron_h_layout.py `random_kquant`), the oracle gguf-py's own dequantization of the same
bytes:

1. the kernels' dequantization (embedding rows, prefill GEMMs) equals gguf-py's bit for bit;
2. the exact kernel = a float64 matmul over those values within fp32 round-off;
3. the integer-dot kernel ("fast") = the stated algorithm re-done in float64 (tests/ops/
   test_ggml_int.py `_errors`) within fp32 round-off, inside the 8-bit activation bound; every
   ISA path the same bits; rows batch- and thread-invariant;
4. tiny NemotronH MoE GGUFs with IQ4_XS matrices and IQ4_NL experts, all Q3_K, all Q2_K,
   deploy on them, their logits the fp32 model's, and greedy MTP speculation equals plain decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_int as gi
from specdeploy.ops import ggml_linear as gl

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, random_kquant  # noqa: E402
from tests.ops.test_ggml_int import _errors, _x  # noqa: E402

KINDS = {"iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS, "q3_k": Q.Q3_K, "q2_k": Q.Q2_K}
SHAPES = [(1, 256), (33, 512), (40, 768)]


def _weight(kind: str, n: int, k: int, seed: int = 0):
    raw = random_kquant(KINDS[kind], (n, k), np.random.default_rng(seed))
    deq = gguf.quants.dequantize(raw, KINDS[kind]).reshape(n, k)
    return gl.make_weight(kind, torch.from_numpy(raw), (n, k)), deq


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantization_is_gguf_pys(kind):
    for n, k in SHAPES:
        gw, deq = _weight(kind, n, k, seed=n)
        assert np.abs(deq).max() > 0  # (not all zero)
        assert torch.equal(gl.dequantize(gw), torch.from_numpy(deq))
        rows = torch.tensor([n - 1, 0])
        assert torch.equal(gl.dequantize(gw, rows), torch.from_numpy(deq[[n - 1, 0]]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_exact_kernel(kind):
    """fp32 sums in another order: within 1e-6 of each output's condition scale; a row alone =
    the same row in any batch."""
    for n, k in SHAPES:
        gw, deq = _weight(kind, n, k, seed=n + 1)
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(n))
        y = gl.ggml_linear(x, gw)
        w = torch.from_numpy(deq).double()
        scale = x.double().abs() @ w.abs().T
        assert ((y.double() - x.double() @ w.T).abs() / scale).max() < 1e-6
        for r in (0, 5, 16):
            assert torch.equal(gl.ggml_linear(x[r:r + 1], gw)[0], y[r])


@pytest.mark.parametrize("kind", list(KINDS))
def test_int_kernel_oracle_isas_and_batch_invariance(kind):
    for n, k in SHAPES:
        gw, deq = _weight(kind, n, k, seed=n + 2)
        x = _x(17, k, seed=n)
        ys = {isa: gi.ggml_linear_int(x, gw, isa=isa) for isa in gi.supported_isas()}
        first = next(iter(ys.values()))
        for isa, y in ys.items():
            assert torch.equal(y, first), isa  # every ISA path: the same bits
            err, err_emul, bound, fp32 = _errors(y, x, deq.astype(np.float64),
                                                 np.zeros((n, k)))
            assert (err_emul <= fp32).all(), (isa, (err_emul / fp32).max())
            assert (err <= bound + fp32).all(), (isa, ((err - fp32) / bound).max())
            for rows in (1, 2, 3, 8):
                assert torch.equal(gi.ggml_linear_int(x[:rows], gw, isa=isa), y[:rows])
            assert torch.equal(gi.ggml_linear_int(x[9:10], gw, isa=isa)[0], y[9])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gi.ggml_linear_int(x, gw, isa="scalar"), first)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", params=[(Q.IQ4_XS, Q.IQ4_NL), (Q.Q3_K, Q.Q3_K), (Q.Q2_K, Q.Q2_K)],
                ids=["iq4_xs+iq4_nl", "q3_k", "q2_k"])
def iq4_gguf(request, tmp_path_factory):
    """A tiny NemotronH MoE (widths in 256s) with (matrices, experts) in those types."""
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    d = tmp_path_factory.mktemp("iq4")
    hf = dict(MOE, hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, head_dim=64,
              moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
              moe_latent_size=256)
    src = nh.make_tiny(d / "st", seed=3, mtp_layers=1, hf_config=hf)
    qtype, expert_qtype = request.param
    return write_gguf(src, d / "iq4.gguf", qtype=qtype, expert_qtype=expert_qtype)


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_iq4_gguf_deploys_on_blocks(iq4_gguf, kernels):
    """As tests/ops/test_ggml_q5.py: every IQ4 matrix and expert group on its blocks, the
    logits of a prefill, a 4-row chunk and a decode step = the fp32 model's (exact: 1e-5;
    fast: 5e-2 of the logits' scale)."""
    from specdeploy.loading import load_model
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    kinds = {w.kind for w in load_model(iq4_gguf).ggml_weights.values()}
    assert kinds in ({"iq4_xs", "iq4_nl"}, {"q3_k"}, {"q2_k"}), kinds
    assert_deploys_on_blocks(iq4_gguf, kernels, kinds, min_linears=8)


def test_greedy_speculation_equals_plain_on_iq4(iq4_gguf):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    assert_mtp_equals_plain(iq4_gguf, max_tokens=16)


@pytest.mark.parametrize("kind", ["iq4_xs", "q3_k"])
def test_wide_rows_are_the_per_output_bits(kind):
    """From KQ_WIDE8_MIN_ROWS rows IQ4_XS and Q3_K take the 8-output tiles on AVX2 (their signed
    values through |w| and x with w's sign): each row the bits of the same row alone (1-row
    path)."""
    gw, deq = _weight(kind, 37, 768, seed=9)
    x = _x(40, 768, seed=9)
    for isa in gi.supported_isas():
        y = gi.ggml_linear_int(x, gw, isa=isa)
        for r in (0, 17, 39):
            assert torch.equal(gi.ggml_linear_int(x[r:r + 1], gw, isa=isa)[0], y[r]), (isa, r)
        _, err_emul, _, fp32 = _errors(y, x, deq.astype(np.float64), np.zeros((37, 768)))
        assert (err_emul <= fp32).all()
