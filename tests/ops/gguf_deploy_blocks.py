"""The shared check of a tiny NemotronH MoE GGUF deploying on its blocks (tests/ops/
test_ggml_kquants.py, test_ggml_q5.py, test_ggml_iq4_q2k_q3k.py)."""
from __future__ import annotations

import torch

from tests.deploy.conftest import assert_close


def assert_deploys_on_blocks(path, kernels: str, kinds: set[str], min_linears: int) -> None:
    """Every block matrix (of `kinds`) and both expert groups run on their blocks, no fp32 linear
    but the routers (F32 in the file); a prefill, a 4-row chunk and a decode step's logits equal
    the fp32 model read from the same file, the largest error relative to the logits' scale:
    the exact kernel within 1e-5, "fast" (8-bit activation blocks, llama.cpp's model) within
    5e-2 (its error compounded over the layers of a random model; measured 2.2% for K-quants)."""
    from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.loading import load_model

    model = load_model(path)
    got = {w.kind for w in model.ggml_weights.values()}
    assert got == kinds, got
    # (an fp32 KV cache: "fast" would keep it in bf16 for a GGUF model on the CPU)
    dep = build(str(path), kernels=kernels, kv_cache_dtype="float32", max_batch_size=2,
                max_seq_len=64, page_size=4, max_cache_gib=0.02)
    infos = {i.name: i for i in dep.infos}
    assert infos["ggml_moe_experts"].num_matches == 2, infos["ggml_moe_experts"]
    assert infos["ggml_linears"].num_matches >= min_linears, infos["ggml_linears"]
    fp32 = [n.args[1].target for n in dep.gm.graph.nodes
            if n.target is torch.ops.aten.linear.default]
    assert all("mixer_gate" in t for t in fp32), fp32
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids)[0]
    assert want.std() > 1e-3 and torch.isfinite(want).all()
    pos, pages = 0, list(range(16))
    for n in (21, 4, 1):
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, SEG_NORMAL)
        assert_close(dep.forward(build_metadata([seg])).logits, want[pos:pos + n],
                     rtol=1e-5 if kernels == "exact" else 5e-2)
        pos += n
