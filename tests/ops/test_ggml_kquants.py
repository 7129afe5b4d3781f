"""GGUF K-quants (Q4_K / Q5_K / Q6_K) on the exact block kernel (ops/ggml_kernels.c), and a
K-quant GGUF deployed with its linears and experts on their blocks.

Oracles: transformers' GGUF dequantizer (`transformers.integrations.gguf.dequant`, its own
implementation of the layouts) for the values, F.linear over them for the products, the plain
model loaded from the same file for the deployment, and the non-speculative path for greedy
speculative decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy.ops.ggml_linear import dequantize, ggml_linear, kernel_unavailable, make_weight
from tests.checkpoint.test_gguf import Q, _quant_bytes
from tests.deploy.conftest import assert_close

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")
transformers = pytest.importorskip("transformers")
KQ = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}


def _weight(kind: str, rows: int, cols: int, seed: int):
    data = _quant_bytes(KQ[kind], rows, cols, np.random.default_rng(seed))
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1).copy())
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    values = hf_dequantize(raw.reshape(-1), int(KQ[kind])).reshape(rows, cols)
    return make_weight(kind, raw, (rows, cols)), values


@pytest.mark.parametrize("kind", sorted(KQ))
def test_values_and_products(kind):
    w, values = _weight(kind, 37, 512, seed=len(kind))
    assert torch.equal(dequantize(w), values)  # bit for bit
    rows = torch.tensor([5, 0, 36])
    assert torch.equal(dequantize(w, rows), values[rows])
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    y = ggml_linear(x, w)
    assert_close(y, x @ values.t(), rtol=1e-6)  # fp32, other summation order
    for r in range(9):  # batch invariance: a row alone gives the same bits
        assert torch.equal(ggml_linear(x[r:r + 1], w)[0], y[r])


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="q4_k blocks"):
        make_weight("q4_k", torch.zeros(4, 144, dtype=torch.uint8), (4, 255))


def test_reordered_columns():
    """Blocks holding the columns in another order (`cols`: W[:, j] = stored[:, cols[j]]): the
    values and the products are those of the reordered matrix; a non-permutation is refused."""
    w, values = _weight("q4_k", 7, 512, seed=3)
    cols = torch.randperm(512, generator=torch.Generator().manual_seed(0))
    gw = make_weight("q4_k", w.blocks, (7, 512), cols)
    assert torch.equal(dequantize(gw), values[:, cols])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    assert_close(ggml_linear(x, gw), x @ values[:, cols].t(), rtol=1e-6)
    with pytest.raises(ValueError, match="permutation of 512 columns"):
        make_weight("q4_k", w.blocks, (7, 512), torch.zeros(512, dtype=torch.long))


@pytest.fixture(scope="module")
def kq_gguf(tmp_path_factory):
    """A tiny NemotronH MoE with every matrix's width a multiple of 256, as a GGUF with Q4_K
    matrices and Q6_K experts (tests/checkpoint/gguf_nemotron_h_layout.py: random valid
    blocks, as gguf-py cannot quantize to K-quants; the oracle reads the same file)."""
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    d = tmp_path_factory.mktemp("kq")
    hf = dict(MOE, hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, head_dim=64,
              moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
              moe_latent_size=256)
    src = nh.make_tiny(d / "st", seed=3, mtp_layers=1, hf_config=hf)
    return write_gguf(src, d / "kq.gguf", qtype=Q.Q4_K, expert_qtype=Q.Q6_K)


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_kquant_gguf_deploys_on_blocks(kq_gguf, kernels):
    """Every K-quant matrix and expert group runs on its blocks; prefill, a 4-row chunk and
    decode steps' logits equal the plain model's: the fp32 kernel within 1e-5; "fast" (8-bit
    activation blocks, llama.cpp's model: each product within its rounding bound, tests above)
    within 5e-2 of the logits' scale, its error compounded over 6 layers of a random model
    (measured 2.2%)."""
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    assert_deploys_on_blocks(kq_gguf, kernels, {"q4_k", "q6_k"}, min_linears=10)


def test_greedy_speculation_equals_plain_on_kquants(kq_gguf):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    assert_mtp_equals_plain(kq_gguf, max_tokens=16)


# ---- the integer-dot ("fast") kernel on K-quants: the oracles of tests/ops/test_ggml_int.py ----
def _kq_offsets(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per value, the offset -dmin * m_g of its 32-value group (gguf-py's own scale unpacking;
    0 for Q6_K), float64 [n, k]."""
    import gguf

    if kind == "q6_k":
        return np.zeros((n, k))
    blocks = raw.reshape(-1, 144 if kind == "q4_k" else 176)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    _, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    m = -(dmin * mins.astype(np.float32)).astype(np.float64)  # [blocks, 8]
    return np.repeat(m, 32, axis=1).reshape(n, k)


INT_SHAPES = [(3, 256), (17, 512), (40, 768)]


@pytest.mark.parametrize("kind", sorted(KQ))
def test_int_kernel_within_the_activation_bound(kind):
    from specdeploy.ops import ggml_int as gi
    from tests.ops.test_ggml_int import _errors, _x

    for isa in gi.supported_isas():
        for n, k in INT_SHAPES:
            w, values = _weight(kind, n, k, seed=n)
            m = _kq_offsets(kind, w.blocks.numpy(), n, k)
            for rows in (1, 2, 5, 8):
                x = _x(rows, k, seed=rows) * 0.05
                err, err_emul, bound, fp32 = _errors(gi.ggml_linear_int(x, w, isa=isa), x,
                                                     values.double().numpy(), m)
                assert (err_emul <= fp32).all(), (isa, (err_emul / fp32).max())
                assert (err <= bound + fp32).all(), (isa, ((err - fp32) / bound).max())


@pytest.mark.parametrize("kind", sorted(KQ))
def test_int_kernel_isa_and_batch_invariant(kind):
    from specdeploy.ops import ggml_int as gi
    from tests.ops.test_ggml_int import _x

    w, _ = _weight(kind, 33, 512, seed=7)
    # AVX-512: 8 rows in one group, more (>= KQ_WIDE_MIN_ROWS) on the 16-output
    # tiles (33 outputs: tiles of 16 and partial ones on each thread); AVX2: groups of 4, more
    # (>= KQ_WIDE8_MIN_ROWS) on 8-output tiles
    x = _x(40, 512, seed=8)
    ys = {isa: gi.ggml_linear_int(x, w, isa=isa) for isa in gi.supported_isas()}
    first = next(iter(ys.values()))
    for isa, y in ys.items():
        assert torch.equal(y, first), isa  # every ISA path: the same bits
        for n in (2, 3, 8):  # row groups of 2 (outputs in pairs on AVX2), 3, and 4
            assert torch.equal(gi.ggml_linear_int(x[:n], w, isa=isa), y[:n]), (isa, n)
        for r in range(40):
            assert torch.equal(gi.ggml_linear_int(x[r:r + 1], w, isa=isa)[0], y[r])
