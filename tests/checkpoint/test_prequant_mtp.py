"""DeepSeek-style MTP layers pre-quantized as the releases ship them (DeepSeek-V3 / R1, GLM-4.5
block FP8: the trailing decoder layer `model.layers.{L}` quantized like every other, `eh_proj`
bf16, no `mtp*` exclusion). Oracle: the checkpoint dequantized independently
(tests/checkpoint/quant_oracle.py) through the eager fp32 model. The target's deployed logits,
the deployed drafter's logits (quantized ops in its graph) and greedy MTP speculation = plain
greedy are each checked against it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specdeploy import LLM, SamplingParams, SpecConfig
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.pipeline import run_transform
from specdeploy.deploy.spec import DraftStep
from specdeploy.loading import load_model
from specdeploy.quantize_cli import make_tiny_quantized
from tests.checkpoint.quant_oracle import dequantize_dir
from tests.checkpoint.test_prequant_logits import assert_close

LIMITS = dict(max_batch_size=4, max_seq_len=96, max_cache_gib=0.02, page_size=8)
# the MTP layer's quantized linears in the drafter graph: attention (GLM q/k/v/o; V3's MLA
# q_a/q_b/kv_a/o: kv_b_proj is absorbed, read dequantized as W_UK / W_UV) + the shared
# expert's 3, and its routed-expert set
DRAFT_MATCHES = {"glm4_moe": 4 + 3 + 1, "deepseek_v3": 4 + 3 + 1}
ARCHS = tuple(DRAFT_MATCHES)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("prequant_mtp"), {}

    def get(arch: str):
        if arch not in cache:
            path = make_tiny_quantized(arch, root / arch, "fp8-block", mtp_layers=1)
            dequantize_dir(path, root / f"{arch}-oracle")
            cache[arch] = path, root / f"{arch}-oracle"
        return cache[arch]

    return get


def _inputs(hidden_size: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 120, (1, 13), generator=g)
    return ids, torch.arange(13)[None], torch.randn(1, 13, hidden_size, generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_layer_written_as_released(ckpt, arch):
    path, _ = ckpt(arch)
    config = json.loads((path / "config.json").read_text())
    qc, n = config["quantization_config"], config["num_hidden_layers"]
    assert not any(g.startswith("mtp") or g.startswith(f"model.layers.{n}")
                   for g in qc["modules_to_not_convert"])
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        keys = set(h.keys())
        mtp = f"model.layers.{n}."
        quantized = [k for k in keys if k.startswith(mtp) and k.endswith(".weight_scale_inv")]
        assert any(".self_attn." in k for k in quantized)
        assert any(".mlp.experts." in k for k in quantized)
        assert any(".mlp.shared_experts." in k for k in quantized)
        for k in quantized:
            assert h.get_tensor(k).dtype == torch.float32, k  # as DeepSeek-V3 ships them
            assert h.get_tensor(k[: -len("_scale_inv")]).dtype == torch.float8_e4m3fn, k
        assert h.get_tensor(mtp + "eh_proj.weight").dtype == torch.bfloat16
        assert mtp + "eh_proj.weight_scale_inv" not in keys


@pytest.mark.parametrize("arch", ARCHS)
def test_target_logits_match_dequantized_oracle(ckpt, arch):
    path, oracle_dir = ckpt(arch)
    model = load_model(path, with_mtp=True)
    ids, pos, _ = _inputs(model.cfg.hidden_size)
    with torch.no_grad():
        want = load_model(oracle_dir)(ids)
    del model.mtp  # (what an MTP deployment does: the drafter leaves the target graph)
    gm = export_model(model, max_tokens=32)
    info, _ = run_transform("prequantized_weights", gm, DeployContext(model=model))
    assert info.num_matches > 0 and not info.skipped
    with torch.no_grad():
        assert_close(gm(ids, pos)[0], want)


@pytest.mark.parametrize("arch", ARCHS)
def test_drafter_logits_match_dequantized_mtp_module(ckpt, arch):
    """The deployed drafter computes on the checkpoint's FP8 tensors (the quantized ops replace
    its linears and experts) and equals the dequantized MTP module run eagerly in fp32."""
    path, oracle_dir = ckpt(arch)
    step = DraftStep(load_model(path, with_mtp=True).mtp)
    ids, pos, hidden = _inputs(step.eagle_drafter.cfg.hidden_size)
    oracle = DraftStep(load_model(oracle_dir, with_mtp=True).mtp)
    with torch.no_grad():
        want = oracle(ids, pos, hidden)[0]
    gm = export_model(step, max_tokens=32, hidden_size=hidden.shape[-1])
    info, _ = run_transform("prequantized_weights", gm, DeployContext(model=step))
    assert info.num_matches == DRAFT_MATCHES[arch]
    assert any(b.dtype == torch.float8_e4m3fn for b in gm.buffers())
    with torch.no_grad():
        assert_close(gm(ids, pos, hidden)[0], want)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_mtp_speculation_equals_plain_greedy(ckpt, arch):
    path, _ = ckpt(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (1, 9, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **LIMITS).generate(prompts, params)]
    llm = LLM(str(path), spec=SpecConfig("mtp", 2, controller="off"), **LIMITS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["draft_steps"] > 0
    draft = next(i for i in llm.deployed.draft.infos if i.name == "prequantized_weights")
    assert draft.num_matches == DRAFT_MATCHES[arch]


def _with_exclusions(src, dst, globs):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] += globs
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mtp_glob_naming_nothing_excludes_nothing_and_real_exclusions_still_refuse(ckpt,
                                                                                  tmp_path):
    """`mtp*` beside a DeepSeek-style MTP layer (our quantizer wrote both before) names no module
    of the checkpoint: it loads with the drafter quantized. A glob that does name the quantized
    MTP layer still contradicts its tensors and is refused, naming the tensor."""
    from specdeploy.checkpoint import CheckpointError

    path, _ = ckpt("glm4_moe")
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    loose = _with_exclusions(path, tmp_path / "loose", ["mtp*"])
    model = load_model(loose, with_mtp=True)
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in model.prequant_weights)
    assert not model.prequant.excluded.get("eagle_drafter.layers.0.self_attn.q_proj")
    bad = _with_exclusions(path, tmp_path / "bad", [f"model.layers.{n}.self_attn*"])
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.self_attn\.q_proj\.weight: "
                                              r"quantized in the checkpoint"):
        load_model(bad, with_mtp=True)


def test_mtp_fp8_tensor_without_its_scales_is_refused_by_name(ckpt, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from specdeploy.checkpoint import CheckpointError

    path, _ = ckpt("deepseek_v3")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    key = f"model.layers.{n}.self_attn.o_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if k != key + "_scale_inv"}
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{key}'? is torch.float8_e4m3fn but has no "
                                              "scales"):
        load_model(bad, with_mtp=True)
