"""gpt-oss (`GptOssForCausalLM`): logits = transformers' class in fp32 (on our tiny checkpoint, on
one transformers' `save_pretrained` wrote, on an MXFP4 checkpoint dequantized by this file's own
E2M1 decoder); the sinks and the sliding windows move the logits far more than the tolerance;
greedy = `generate`; n-gram speculation lossless; bad checkpoints named.

Tolerance: max |ours - transformers| <= 1e-4 * max |logit| (fp32; sums in other orders)."""
from __future__ import annotations

import json

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer
from specdeploy.loading import load_model
from specdeploy.models import gpt_oss

transformers = pytest.importorskip("transformers")
RTOL = 1e-4
LIMITS = dict(max_batch_size=4, max_seq_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = gpt_oss.make_tiny(tmp_path_factory.mktemp("gpt_oss"), seed=3)
    hf = _hf(path)
    return path, hf


def _hf(path, **overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **overrides).eval()


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 124, (b, t), generator=torch.Generator().manual_seed(seed))


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("b,t", [(1, 1), (1, 37), (2, 70)])
def test_logits_equal_transformers(tiny, b, t):
    path, hf = tiny
    ids = _ids(b, t, seed=t)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = load_model(path, dtype=torch.float32)(ids)
    assert _err(got, want) <= RTOL
    assert want.abs().mean() > 0.1


def test_sinks_and_windows_change_the_logits(tiny):
    """Without its sinks, or with full attention everywhere, transformers' own model gives
    logits far outside the tolerance: a model ignoring either could not pass the test above."""
    path, hf = tiny
    ids = _ids(1, 40, seed=1)  # 40 > the window of 8
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        no_sinks = _hf(path)
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert _err(no_sinks(input_ids=ids).logits, want) > 100 * RTOL
        full = _hf(path, layer_types=["full_attention"] * 4)
        assert _err(full(input_ids=ids).logits, want) > 100 * RTOL


# gpt-oss-20b's config.json as released (v4 style: `rope_scaling`, `rope_theta` at the top)
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                     "original_max_position_embeddings": 4096, "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088}


@pytest.mark.parametrize("truncate", [False, True])
def test_released_config_and_its_yarn_equal_transformers(truncate):
    """The released config read as transformers reads it; YaRN's inverse frequencies bit-equal
    to transformers' and its attention factor equal (truncate: the releases' False, and True)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = {**RELEASED_20B, "rope_scaling": {**RELEASED_20B["rope_scaling"], "truncate": truncate}}
    ref = transformers.GptOssConfig(**{k: v for k, v in hf.items()
                                       if k not in ("architectures", "model_type")})
    cfg = gpt_oss.Config.from_hf(hf)
    assert cfg.windows == tuple(128 if t == "sliding_attention" else 0 for t in ref.layer_types)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.swiglu_limit, cfg.qkv_bias or
            cfg.attention_bias) == (32, 4, 7.0, True)
    rotary = GptOssRotaryEmbedding(ref)
    assert torch.equal(cfg.yarn.inv_freq(64), rotary.inv_freq)
    assert cfg.yarn.scaling == rotary.attention_scaling


def test_a_checkpoint_transformers_wrote(tmp_path):
    """Random weights through transformers' own `save_pretrained` (its layout, its names)."""
    cfg = transformers.GptOssConfig(**{k: v for k, v in gpt_oss.tiny_hf_config().items()
                                       if k not in ("architectures", "model_type",
                                                    "torch_dtype")})
    model = transformers.GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name or name.endswith("bias") else p.shape[-1] ** -0.5
            scale = 1.0 if name.endswith("sinks") else scale
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, cfg.vocab_size)
    ids = _ids(2, 30, seed=4)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = load_model(tmp_path, dtype=torch.float32)(ids)
    assert _err(got, want) <= RTOL


def test_greedy_equals_generate_and_ngram_is_lossless(tiny):
    path, hf = tiny
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    got = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, sp)]
    hf.generation_config.eos_token_id = None
    for p, ours in zip(prompts, got):
        t = torch.tensor([p])
        assert ours == hf.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    spec = LLM(path, spec={"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 2, "controller": "off"}, **LIMITS)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == got
    assert spec.stats()["draft_steps"] > 0


def test_two_ranks_give_the_one_process_tokens(tiny):
    """Heads (and their sinks) split over 2 ranks, the MoE replicated."""
    path, _ = tiny
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    want = [o.token_ids for o in LLM(path, **LIMITS).generate(prompts, sp)]
    tp = LLM(path, tensor_parallel_size=2, dist_timeout=60, **LIMITS)
    try:
        assert [o.token_ids for o in tp.generate(prompts, sp)] == want
    finally:
        tp.shutdown()


# ---- MXFP4 as released ----------------------------------------------------------------------


def _e2m1(code: int) -> float:
    """E2M1 from its bits (sign 3, exponent 2-1 with bias 1, mantissa 0; exponent 0 subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def _dequantize(blocks, scales):
    """[E, N, G, 16] bytes (low nibble first), [E, N, G] E8M0 -> [E, N, G * 32] fp32."""
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    lo, hi = table[(blocks & 15).long()], table[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), -1).flatten(-2)  # element 2j from byte j's low nibble
    return (vals * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2).float()


def _mxfp4_checkpoint(src, out, break_tensor: str | None = None):
    """`src`'s tiny checkpoint with random MXFP4 experts, as gpt-oss ships them."""
    from safetensors.torch import load_file

    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    tensors = load_file(str(src / "model.safetensors"))
    e, h, i = hf["num_local_experts"], hf["hidden_size"], hf["intermediate_size"]
    g = torch.Generator().manual_seed(11)
    for layer in range(hf["num_hidden_layers"]):
        for proj, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[key]
            tensors[key + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g,
                                                     dtype=torch.uint8)
            # 2^-7 .. 2^-3 times E2M1's +-6: weights of the tiny model's size
            tensors[key + "_scales"] = torch.randint(120, 125, (e, n, k // 32), generator=g,
                                                     dtype=torch.uint8)
    if break_tensor is not None:
        t = tensors[break_tensor]  # half its rows
        tensors[break_tensor] = t[:, : t.shape[1] // 2].contiguous()
    write_checkpoint(out, hf, tensors)
    write_tiny_tokenizer(out, hf["vocab_size"])
    return out, hf, tensors


def test_mxfp4_checkpoint_equals_transformers_on_its_dequantized_weights(tiny, tmp_path):
    path, _ = tiny
    out, hf, tensors = _mxfp4_checkpoint(path, tmp_path / "mxfp4")
    state = {}
    for key, t in tensors.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):  # stored [E, N, K]: transformers holds [E, K, N]
            base = key[:-len("_blocks")]
            t = _dequantize(t, tensors[base + "_scales"]).transpose(1, 2)
            key = base
        state[key] = t
    cfg = transformers.GptOssConfig(**{k: v for k, v in hf.items() if k not in (
        "architectures", "model_type", "torch_dtype", "quantization_config")})
    ref = transformers.GptOssForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if not m.endswith("inv_freq")]
    ref.config._attn_implementation = "eager"
    ours = load_model(out, dtype=torch.float32)
    # exact: our experts are the independent decoder's values (gate rows = even columns)
    w = state["model.layers.1.mlp.experts.gate_up_proj"].transpose(1, 2)
    got = ours.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(got, torch.cat((w[:, 0::2], w[:, 1::2]), 1))
    ids = _ids(2, 45, seed=6)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert _err(ours(ids), want) <= RTOL
    # bf16 holds the MXFP4 values exactly too
    bf16 = load_model(out, dtype=torch.bfloat16).model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(bf16.float(), got)


def test_mxfp4_tensor_of_the_wrong_shape_is_named(tiny, tmp_path):
    path, _ = tiny
    bad = "model.layers.2.mlp.experts.down_proj_scales"
    out, _, _ = _mxfp4_checkpoint(path, tmp_path / "bad", break_tensor=bad)
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        load_model(out, dtype=torch.float32)


def test_mxfp4_tensors_without_the_config_are_named(tiny, tmp_path):
    path, _ = tiny
    out, hf, _ = _mxfp4_checkpoint(path, tmp_path / "noconfig")
    del hf["quantization_config"]
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj_blocks is there: MXFP4"):
        load_model(out, dtype=torch.float32)


def test_missing_sinks_are_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.sinks"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.self_attn\.sinks"):
        load_model(tmp_path, dtype=torch.float32)


def test_experts_of_the_wrong_shape_are_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[key] = tensors[key][:7].contiguous()  # an expert short
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.") + r" must be \[8, 64, 64\]"):
        load_model(tmp_path, dtype=torch.float32)


def test_make_tiny_cli(tmp_path):
    from specdeploy.cli import main

    assert main(["make-tiny", "--arch", "gpt_oss", "--out", str(tmp_path / "d")]) == 0
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["GptOssForCausalLM"]
