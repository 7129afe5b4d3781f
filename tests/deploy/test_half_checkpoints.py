"""A bf16 / fp16 safetensors checkpoint (what Hugging Face releases ship) deployed on the CPU keeps
its 16-bit values: matrices as F16 / BF16 blocks on the exact kernel, bf16 routed experts as bf16
tensors on the one-call expert kernel; the fp32 model (each value widened exactly) at half the
memory.

Oracles: the plain model loaded from the same checkpoint (fp32 copies, torch's F.linear and expert
loop), which is checked against transformers elsewhere; the deployment with the feature off
(SPECDEPLOY_HALF_BLOCKS=0: the fp32 path as before); the non-speculative path for greedy MTP.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
from specdeploy.checkpoint import CheckpointError
from specdeploy.deploy.build import build
from specdeploy.deploy.passes.ggml_linears import MAX_ROWS
from specdeploy.loading import HALF_BLOCKS_ENV, load_model
from specdeploy.models import llama
from specdeploy.models import nemotron_h as nh
from specdeploy.ops import linear_rows
from specdeploy.ops.ggml_linear import kernel_unavailable
from tests.checkpoint.test_gguf_nemotron_h import MOE
from tests.deploy.conftest import assert_close

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"ggml kernel unavailable: {kernel_unavailable()}")
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def as_dtype(src, out, dtype: torch.dtype):
    """A copy of checkpoint `src` with every floating tensor stored as `dtype`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def llama_half(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("half_llama")
    src = llama.make_tiny(d / "st", seed=3)
    return as_dtype(src, d / "half", request.param), request.param


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def moe_half(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("half_nh")
    src = nh.make_tiny(d / "st", seed=5, mtp_layers=1, hf_config=MOE)
    return as_dtype(src, d / "half", request.param)


def _fp32_2d_bytes(dep) -> int:
    """fp32 bytes of the 2-D / 3-D weights the graph holds (the KV cache aside)."""
    seen = {}
    for name, t in (*dep.gm.named_parameters(), *dep.gm.named_buffers()):
        if t.dim() in (2, 3) and t.dtype == torch.float32 and "cache" not in name:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _steps(dep, ids):
    """Logits of a prefill above MAX_ROWS rows, a 3-row chunk, then two decode rows."""
    pages, pos, out = list(range(16)), 0, []
    for n in (MAX_ROWS + 5, 3, 1, 1):
        seg = Segment(ids[pos:pos + n], pos, pages, 0, n, SEG_NORMAL)
        out.append(dep.forward(build_metadata([seg])).logits)
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_every_matrix_runs_on_its_16_bit_values_and_logits_are_the_fp32_models(
        llama_half, kernels):
    path, dtype = llama_half
    dep = build(str(path), kernels=kernels, **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    layers = llama.tiny_hf_config()["num_hidden_layers"]
    assert info.num_matches == layers * LINEARS_PER_LAYER + 1, info  # + the LM head
    assert "1 embeddings" in info.detail and "F16 / BF16 values" in info.detail, info
    assert _fp32_2d_bytes(dep) == 0
    model = load_model(path)  # the oracle: fp32 copies, torch's linears
    assert not model.ggml_weights
    ids = torch.randint(3, 120, (MAX_ROWS + 10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids[None])[0]
    # fp32 round-off of another summation order; the values themselves are the same
    assert_close(_steps(dep, ids.tolist()), want, rtol=1e-5)
    # the KV cache keeps the model's dtype (this is the fp32 model, not llama.cpp's)
    kv = [t for n, t in dep.gm.named_buffers() if "kv_cache" in n]
    assert kv and all(t.dtype == torch.float32 for t in kv)


def test_off_switch_keeps_the_fp32_path(llama_half, monkeypatch):
    path, _ = llama_half
    monkeypatch.setenv(HALF_BLOCKS_ENV, "0")
    dep = build(str(path), **LIMITS)
    assert {i.name: i for i in dep.infos}["ggml_linears"].num_matches == 0
    assert _fp32_2d_bytes(dep) > 0


def test_a_non_finite_value_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    src = llama.make_tiny(tmp_path / "st", seed=3)
    path = as_dtype(src, tmp_path / "bf16", torch.bfloat16)
    f = next(path.glob("*.safetensors"))
    t = load_file(f)
    key = "model.layers.1.mlp.down_proj.weight"
    t[key][3, 5] = float("inf")
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{key}.*non-finite values"):
        build(str(path), **LIMITS)


def test_16_bit_experts_run_as_stored_and_speculation_stays_lossless(moe_half):
    """A NemotronH MoE checkpoint in bf16 / fp16: its routed experts (and its MTP layer's) run as
    the stored 16-bit tensors on the one-call kernel, matrices on blocks; logits are the fp32
    model's; greedy MTP speculation gives plain decoding's tokens."""
    from specdeploy import LLM, SamplingParams, SpecConfig

    if linear_rows.moe_unavailable() is not None:
        pytest.skip(f"moe_rows: {linear_rows.moe_unavailable()}")
    dep = build(str(moe_half), **LIMITS)
    infos = {i.name: i for i in dep.infos}
    assert infos["ggml_moe_experts"].num_matches == 2, infos["ggml_moe_experts"]
    assert "2 of them one C call each" in infos["ggml_moe_experts"].detail
    assert "16-bit experts as stored" in infos["ggml_moe_experts"].detail
    assert infos["ggml_linears"].num_matches > 0
    assert not [n for n, p in dep.gm.named_parameters() if p.dim() == 3 and "expert" in n]
    model = load_model(moe_half)
    ids = torch.randint(3, 120, (MAX_ROWS + 10,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids[None])[0]
    assert_close(_steps(dep, ids.tolist()), want, rtol=1e-5)
    prompts = [[5, 6, 7, 8] * 4, list(range(10, 30))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(str(moe_half), **LIMITS)
    spec = LLM(str(moe_half), spec=SpecConfig("mtp", 2, controller="off"), **LIMITS)
    want_ids = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want_ids
    assert spec.stats()["draft_tokens"] > 0


@pytest.mark.parametrize("ftype", ["BF16", "F16"])
def test_a_16_bit_ggufs_experts_run_as_stored(ftype, tmp_path):
    """A BF16 / F16 GGUF's stacked experts ([E, N, K] blocks: the 16-bit tensor itself) on the
    one-call expert kernel, no fp32 expert copy; logits are the fp32 model's (gguf-py's values);
    greedy MTP = plain."""
    from tests.checkpoint.gguf_llm import assert_mtp_equals_plain
    from tests.checkpoint.gguf_nemotron_h_layout import Q
    from tests.checkpoint.gguf_nemotron_h_layout import write_gguf as write_nh

    if linear_rows.moe_unavailable() is not None:
        pytest.skip(f"moe_rows: {linear_rows.moe_unavailable()}")
    src = nh.make_tiny(tmp_path / "st", seed=5, mtp_layers=1, hf_config=MOE)
    qtype = getattr(Q, ftype)
    path = write_nh(src, tmp_path / "half.gguf", qtype=qtype, expert_qtype=qtype)
    model = load_model(path)
    stacked = {n: w for n, w in model.ggml_weights.items() if len(w.shape) == 3}
    assert stacked and all(w.kind == ftype.lower() for w in stacked.values())
    dep = build(str(path), **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_moe_experts"]
    assert info.num_matches == 2 and "2 of them one C call each" in info.detail, info
    assert not [n for n, p in dep.gm.named_parameters() if p.dim() == 3 and "expert" in n]
    ids = torch.randint(3, 120, (MAX_ROWS + 10,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids[None])[0]
    assert_close(_steps(dep, ids.tolist()), want, rtol=1e-5)
    assert_mtp_equals_plain(path, max_tokens=16, kernels="fast")


def test_a_16_bit_mtp_layer_drafts_from_its_values(moe_half):
    """The checkpoint's own MTP layer (its matrices deferred as 16-bit blocks): with the default
    draft_quantize ("auto": Q8_0 on the fast CPU path) its matrices are Q8_0 of the file's
    values (filled from the blocks first, never a placeholder's zeros); its experts run as the
    stored 16-bit tensors."""
    from specdeploy import LLM, SpecConfig
    from specdeploy.ops.ggml_linear import dequantize, quantize_q8_0

    llm = LLM(str(moe_half), spec=SpecConfig("mtp", 2), **LIMITS)
    want = dict(load_model(moe_half, with_mtp=True).mtp.named_parameters())
    got = {f"{m}.weight": mod.weight for m, mod in llm.deployed.drafter.named_modules()
           if isinstance(mod, torch.nn.Linear)}  # (the drafter's linears: Q8_0)
    mats = [n for n, p in got.items() if n in want and p.shape[1] % 32 == 0]
    assert mats
    for n in mats:
        assert want[n].any() and torch.equal(got[n], dequantize(quantize_q8_0(want[n]))), n
    infos = {i.name: i for i in llm.deployed.draft.infos}
    assert infos["ggml_moe_experts"].num_matches > 0, infos["ggml_moe_experts"]
