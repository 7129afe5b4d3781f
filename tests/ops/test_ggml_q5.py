"""GGUF Q5_0 / Q5_1 weights deploy on their blocks. llama-quantize writes them where a Q4_K /
Q5_K tensor's rows are not in 256s (Nemotron 3 Nano's hidden 2688, Gemma 3 1B's 1152: most of
such a "Q4_K_M" file), and for the Q5_0 / Q5_1 file types. Before, they loaded as fp32 (~6x
their bytes). The kernels themselves are checked in tests/ops/test_ggml_int.py and
test_ggml_linear.py (gguf-py's dequantization as the oracle); here a tiny NemotronH MoE GGUF
with Q5_0 matrices and Q5_1 experts: every one of them runs on its blocks, logits equal the
fp32 model's (read from the same file), greedy MTP speculation equals plain decoding."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def q5_gguf(tmp_path_factory):
    """A tiny NemotronH MoE (hidden 96: rows in 32s, not in 256s) as a GGUF with Q5_0 matrices
    and Q5_1 experts (gguf-py's quantization of the safetensors weights)."""
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    d = tmp_path_factory.mktemp("q5")
    hf = dict(MOE, hidden_size=96, mamba_num_heads=4, mamba_head_dim=24, head_dim=32,
              moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
              moe_latent_size=96)
    src = nh.make_tiny(d / "st", seed=3, mtp_layers=1, hf_config=hf)
    return write_gguf(src, d / "q5.gguf", qtype=Q.Q5_0, expert_qtype=Q.Q5_1)


def test_the_reader_keeps_the_blocks(q5_gguf):
    from specdeploy.checkpoint.gguf import GGUFReader
    from specdeploy.ops.ggml_linear import dequantize

    r = GGUFReader(q5_gguf)
    kinds = {}
    for name in r.keys():
        w = r.get_blocks(name)
        if w is not None:
            kinds[w.kind] = kinds.get(w.kind, 0) + 1
            # the kernels' dequantization = gguf-py's (the reader's fp32 path)
            assert torch.equal(dequantize(w if w.blocks.dim() == 2 else
                                          w._replace(blocks=w.blocks[0], shape=w.shape[1:])),
                               r.get(name) if w.blocks.dim() == 2 else r.get(name)[0]), name
    assert kinds.get("q5_0", 0) >= 8 and kinds.get("q5_1", 0) >= 2, kinds


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_q5_gguf_deploys_on_blocks(q5_gguf, kernels):
    """Every Q5 matrix and expert group runs on its blocks (no fp32 linear but the routers);
    prefill, a 4-row chunk and a decode step's logits equal the fp32 model's: the exact kernel
    within 1e-5, "fast" (8-bit activation blocks) within 5e-2 of the logits' scale (its error
    compounded over the layers of a random model, as tests/ops/test_ggml_kquants.py)."""
    from tests.ops.gguf_deploy_blocks import assert_deploys_on_blocks

    assert_deploys_on_blocks(q5_gguf, kernels, {"q5_0", "q5_1"}, min_linears=8)


def test_greedy_speculation_equals_plain_on_q5(q5_gguf):
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain

    assert_mtp_equals_plain(q5_gguf, max_tokens=16)
