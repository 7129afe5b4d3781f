"""compressed-tensors checkpoints (llm-compressor's FP8 and NVFP4 layouts) deploy as they ship.

The checkpoints are written by the compressed-tensors library's own compressors, and the oracle
is the same library's decompression (tests/checkpoint/ct_layout.py): the deployed quantized
graph's logits equal those of the plain model built from the library-decompressed weights.
Tolerance: 1e-4 of the logits' scale (fp32 reassociation, as tests/checkpoint/
test_prequant_logits.py; NVFP4's global scale is applied as a reciprocal multiplier, within an
ulp of the library's division)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.quant_config import UnsupportedQuantization, detect_quant_config
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.pipeline import run_transform
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h_blocks, qwen3_5_blocks
from specdeploy.quantize_cli import make_tiny_quantized
from tests.checkpoint.quant_oracle import fake_quant_hooks
from tests.checkpoint.test_prequant_logits import EXPECTED, assert_close

ct_layout = pytest.importorskip("tests.checkpoint.ct_layout")

CASES = [("llama", k) for k, v in ct_layout.KINDS.items() if v[0] is not None] + [
    ("qwen3_5_moe", "fp8-channel"), ("qwen3_5_moe", "nvfp4"), ("nemotron_h", "fp8-tensor"),
    ("qwen3_vl_moe", "fp8-channel"), ("qwen3_next", "nvfp4"), ("qwen3_next", "fp8-tensor")]


@pytest.fixture(scope="module")
def ct_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    cache = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in cache:
            method = ct_layout.KINDS[kind][0]
            src = root / f"{arch}-{method}"
            if not src.exists():
                make_tiny_quantized(arch, src, method, mtp_layers=0 if arch == "llama" else 1)
            cache[arch, kind] = ct_layout.write_ct(src, root / f"{arch}-ct-{kind}", kind)
        return cache[arch, kind]

    return get


@pytest.mark.parametrize("arch, kind", CASES)
def test_deployed_logits_match_the_library_decompressed_model(ct_ckpt, tmp_path, arch, kind):
    path = ct_ckpt(arch, kind)
    in_scales = ct_layout.dequantize_ct_dir(path, tmp_path / "oracle")
    assert bool(in_scales) == (kind == "fp8-tensor")  # static activations: only that scheme
    oracle = load_model(tmp_path / "oracle")
    g = torch.Generator().manual_seed(5)
    ids, pos = torch.randint(3, 120, (1, 23), generator=g), torch.arange(23)[None]
    with torch.no_grad(), fake_quant_hooks(oracle, in_scales,
                                           (nemotron_h_blocks, qwen3_5_blocks)):
        want = oracle(ids)
    model = load_model(path)
    assert model.prequant.config.method == ("ct_nvfp4" if kind == "nvfp4" else "ct_fp8")
    gm = export_model(model, max_tokens=64)
    info, _ = run_transform("prequantized_weights", gm, DeployContext(model=model))
    assert info.num_matches == EXPECTED[arch] and not info.skipped
    dtypes = {t.dtype for t in gm.buffers()}
    assert (torch.uint8 if kind == "nvfp4" else torch.float8_e4m3fn) in dtypes
    with torch.no_grad():
        got = gm(ids, pos)[0]
    assert_close(got, want)


def test_ignore_regexes_become_exclusions(ct_ckpt):
    """`ignore` ("re:" patterns from llm-compressor recipes) names the modules left in full
    precision: the LM head and the MoE routers here; one of them quantized anyway is refused."""
    path = ct_ckpt("qwen3_5_moe", "nvfp4")
    model = load_model(path)
    excluded = set(model.prequant.excluded)
    assert "lm_head" in excluded
    assert {f"model.layers.{i}.mlp.gate" for i in range(2)} <= excluded
    assert not any(n.endswith("in_proj_qkv") for n in excluded)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*layers\\.0\\.linear_attn\\.in_proj_qkv$")
    bad = path.with_name(path.name + "-bad")
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="in_proj_qkv.*quantized in the checkpoint"):
        load_model(bad)


def _qc(weights: dict, acts=None, fmt="float-quantized", **top) -> dict:
    return {"quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"g": {"targets": ["Linear"], "weights": weights,
                                "input_activations": acts}}, "ignore": ["lm_head"], **top}}


FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
KEYS = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]


def test_config_fields(tmp_path):
    q = detect_quant_config(tmp_path, _qc(FP8_W, {"num_bits": 8, "type": "float",
                                                  "dynamic": True, "strategy": "token"}), KEYS)
    assert (q.method, q.strategy, q.static_activations, q.kv_cache) == (
        "ct_fp8", "channel", False, None)
    q = detect_quant_config(tmp_path, _qc(
        {**FP8_W, "strategy": "block", "block_structure": [128, 64]},
        {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"},
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"},
        ignore=["lm_head", "re:.*mlp\\.gate$"]), KEYS)
    assert (q.strategy, q.block_size, q.static_activations, q.kv_cache) == (
        "block", (128, 64), True, "FP8")
    assert q.exclude == ("lm_head", "model.layers.0.mlp.gate")
    assert "per-block weight scales 128x64, static" in q.describe()
    nv = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
          "group_size": 16}
    q = detect_quant_config(tmp_path, _qc(nv, None, "nvfp4-pack-quantized"), KEYS)
    assert (q.method, q.group_size) == ("ct_nvfp4", 16)


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("qc, match", [
    (_qc({**INT4, "num_bits": 8}, None, "naive-quantized"), "format 'naive-quantized'"),
    (_qc({**FP8_W, "num_bits": 4, "group_size": 32}, None, "mxfp4-pack-quantized"),
     "format 'mxfp4-pack-quantized'"),
    (_qc({**FP8_W, "symmetric": False}), "asymmetric"),
    (_qc({**FP8_W, "actorder": "group"}), "actorder 'group'"),
    (_qc(FP8_W, {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "channel"}),
     "static activations by 'channel'"),
    (_qc(FP8_W, kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}),
     "kv_cache_scheme"),
    (_qc(FP8_W, quantization_status="frozen"), "quantization_status 'frozen'"),
    (_qc({**FP8_W, "num_bits": 4, "strategy": "tensor_group", "group_size": 32}, None,
         "nvfp4-pack-quantized"), "only 4-bit tensor_group 16"),
])
def test_unsupported_schemes_are_refused_by_name(tmp_path, qc, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        detect_quant_config(tmp_path, qc, KEYS)


def test_mixed_groups_and_malformed_fields(tmp_path):
    qc = _qc(FP8_W)
    qc["quantization_config"]["config_groups"]["h"] = {
        "targets": ["re:.*down_proj"], "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                    "group_size": 16}}
    with pytest.raises(UnsupportedQuantization, match="mixed schemes"):
        detect_quant_config(tmp_path, qc, KEYS)
    with pytest.raises(CheckpointError, match="block_structure"):
        detect_quant_config(tmp_path, _qc({**FP8_W, "strategy": "block",
                                           "block_structure": [0, 8]}), KEYS)
    with pytest.raises(CheckpointError, match="ignore entry 're:\\('"):
        detect_quant_config(tmp_path, _qc(FP8_W, ignore=["re:("]), KEYS)


# ---- W4A16 (pack-quantized int4) as GGUF Q4_0 blocks ---------------------------------------
LIMITS = dict(max_batch_size=2, max_seq_len=64, page_size=4, max_cache_gib=0.01)


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    from specdeploy.models.registry import family_module

    root = tmp_path_factory.mktemp("w4a16")
    plain = family_module("llama").make_tiny(root / "plain", seed=1, mtp_layers=0)
    return lambda kind: ct_layout.write_ct(plain, root / kind, kind)


@pytest.mark.parametrize("kind, blocks", [("w4a16", 14), ("w4a16-channel", 14),
                                          ("w4a16-g16", 0), ("w8a16", 14), ("w8a8", 14)])
def test_int_weights_deploy_on_gguf_blocks(w4a16, tmp_path, kind, blocks):
    """Groups of 32 (or whole rows) with bfloat16 scales are Q4_0 / Q8_0 blocks exactly (the
    codes -8 and -128 included): every quantized linear runs on them; groups of 16 are not
    (fp32 weights). Prefill and decode / verify steps' logits equal the library-decompressed
    model's (fp32, other summation order: 1e-5)."""
    from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.ops.ggml_linear import kernel_unavailable

    path = w4a16(kind)
    ct_layout.dequantize_ct_dir(path, tmp_path / "oracle")
    oracle = load_model(tmp_path / "oracle")
    model = load_model(path)
    assert len(model.ggml_weights) == blocks
    assert {w.kind for w in model.ggml_weights.values()} <= {"q8_0" if "w8" in kind else "q4_0"}
    if kind == "w8a8":
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as h:
            q = h.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert q.dtype == torch.int8 and int(q.min()) == -128  # the sign trick's edge case
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = oracle(ids)[0]
        assert torch.equal(model(ids)[0], want)  # the eager model: the exact weights
    if blocks and kernel_unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {kernel_unavailable()}")
    dep = build(str(path), kernels="exact", **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_linears"]
    assert info.num_matches == blocks, info
    pos, pages = 0, list(range(16))
    for n, seg_kind in ((21, SEG_NORMAL), (1, SEG_NORMAL), (4, SEG_EXTEND), (1, SEG_NORMAL)):
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, seg_kind)
        assert_close(dep.forward(build_metadata([seg])).logits, want[pos:pos + n], rtol=1e-5)
        pos += n


def test_int_config_and_refusals(tmp_path):
    q = detect_quant_config(tmp_path, _qc(INT4, None, "pack-quantized"), KEYS)
    assert (q.method, q.bits, q.group_size, q.packed) == ("ct_int", 4, 128, True)
    assert "W4A16" in q.describe() and "Q4_0" in q.describe()
    q = detect_quant_config(tmp_path, _qc({**INT4, "num_bits": 8}, {
        "num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}, "int-quantized"),
        KEYS)
    assert (q.bits, q.packed) == (8, False) and "W8A8, run weight-only" in q.describe()
    ch = {**INT4, "strategy": "channel", "group_size": None}
    assert detect_quant_config(tmp_path, _qc(ch, None, "pack-quantized"), KEYS).group_size == 0
    for qc, match in ((_qc({**INT4, "num_bits": 2}, None, "pack-quantized"), "2-bit int"),
                      (_qc(INT4, None, "int-quantized"), "int-quantized with 4-bit"),
                      (_qc({**INT4, "num_bits": 8}, {"num_bits": 8, "type": "int",
                                                    "dynamic": False}, "int-quantized"),
                       "static or non-int8 activations"),
                      (_qc(INT4, {"num_bits": 8, "type": "int"}, "pack-quantized"),
                       "quantized activations"),
                      (_qc({**INT4, "actorder": "group"}, None, "pack-quantized"),
                       "actorder 'group'")):
        with pytest.raises(UnsupportedQuantization, match=match):
            detect_quant_config(tmp_path, qc, KEYS)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe"])
def test_int_experts_deploy_on_gguf_blocks(tmp_path, family):
    """W4A16 MoE checkpoints in their released layouts (`backbone.*` / `model.language_model.*`,
    one tensor per expert): each stacked expert parameter gets the experts' Q4_0 blocks (gate
    and up rows joined for Qwen3.5), the linears theirs; deployed, the experts run on them
    (`ggml_moe_experts`) and the logits equal the library-decompressed model's (fp32, other
    summation order: 1e-5)."""
    from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
    from specdeploy.deploy.build import build
    from specdeploy.models.registry import family_module
    from specdeploy.ops.ggml_linear import kernel_unavailable

    fam = family_module(family)
    hf = fam.tiny_hf_config()
    # every quantized matrix's input width a multiple of the group (32): the shared expert's
    (hf.get("text_config") or hf)["shared_expert_intermediate_size" if family == "qwen3_5_moe"
                                  else "moe_shared_expert_intermediate_size"] = 64
    plain = fam.make_tiny(tmp_path / "plain", seed=2, hf_config=hf)
    path = ct_layout.write_ct(plain, tmp_path / "ct", "w4a16")
    ct_layout.dequantize_ct_dir(path, tmp_path / "oracle")
    oracle, model = load_model(tmp_path / "oracle"), load_model(path)
    stacked = {n: w for n, w in model.ggml_weights.items() if len(w.shape) == 3}
    moe = sum(t == "moe" for t in getattr(model.cfg, "block_types", ())) or \
        model.cfg.num_hidden_layers
    assert len(stacked) == 2 * moe and {w.kind for w in stacked.values()} == {"q4_0"}
    assert len(model.ggml_weights) > len(stacked)  # the 2-D linears too, by their keys
    ids = torch.randint(3, 120, (1, 26), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = oracle(ids)[0]
        assert torch.equal(model(ids)[0], want)
    if kernel_unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {kernel_unavailable()}")
    # (the text model: the writer here quantized the vision tower's proj too, which a released
    # W4A16 VLM leaves alone)
    dep = build(str(path), kernels="exact", vision=False, **LIMITS)
    info = {i.name: i for i in dep.infos}["ggml_moe_experts"]
    assert info.num_matches == moe, info
    pos, pages = 0, list(range(16))
    for n in (21, 1, 4):
        seg = Segment(ids[0, pos:pos + n].tolist(), pos, pages, 0, n, SEG_NORMAL)
        assert_close(dep.forward(build_metadata([seg])).logits, want[pos:pos + n], rtol=1e-5)
        pos += n
