"""gpt-oss GGUFs (llama.cpp's "gpt-oss"), written here as llama.cpp's converter writes them
(conversion/gpt_oss.py `GptOssModel`: names from gguf-py's own map, `.weight` added to the sinks,
gate / up split from the interleaved columns, expert matrices as [E, out, in], and the released
MXFP4 experts repacked into ggml's MXFP4 blocks: one E8M0 byte, then byte j = element j | element
j + 16 << 4), against the safetensors checkpoints: every parameter equal, bit for bit."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import gpt_oss

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer  # noqa: E402
from tests.models.test_gpt_oss import _mxfp4_checkpoint  # noqa: E402


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF MXFP4 ([..., G, 16] bytes, element 2j in byte j's low nibble; [..., G] E8M0) as ggml
    MXFP4 rows [..., G * 17] (the same E8M0 byte: ggml's doubled table times half the scale)."""
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2)  # [..., G, 32] in order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales[..., None], qs), -1).flatten(-2).numpy()


def write_gpt_oss_gguf(src: Path, out: Path, q8_0: bool = False) -> Path:
    """`src` in llama.cpp's converter layout; `q8_0`: its 2-D weights (attention, router, head,
    embedding) as Q8_0 blocks, as `--outtype q8_0` writes them."""
    c = json.loads((src / "config.json").read_text())
    reader = open_checkpoint(src)  # the raw tensors (no dequantizing wrapper)
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n)
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    add_tokenizer(w, src, c["vocab_size"])
    for key in reader.keys():
        a = reader.get(key)
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):  # MXFP4 as it ships: repacked, gate / up rows apart
            base = key[:-len("_blocks")]
            splits = ((("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
                      if base.endswith("gate_up_proj") else (("down_proj", slice(None)),))
            for proj, rows in splits:
                name = names.get_name(f"{base.rsplit('.', 1)[0]}.{proj}.weight",
                                      try_suffixes=(".weight",))
                data = _ggml_mxfp4(a[:, rows], reader.get(base + "_scales")[:, rows])
                w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            bias = key.endswith("_bias")
            a = a if bias else a.transpose(1, 2)  # [E, H, 2I] -> [E, 2I, H]
            for proj, part in (("gate_proj", a[:, 0::2]), ("up_proj", a[:, 1::2])):
                leaf = proj + (".bias" if bias else ".weight")
                name = names.get_name(f"{key.rsplit('.', 1)[0]}.{leaf}",
                                      try_suffixes=(".weight", ".bias"))
                w.add_tensor(name, part.float().contiguous().numpy())
            continue
        if key.endswith("experts.down_proj"):  # full precision: [E, I, H] -> [E, H, I]
            key, a = key + ".weight", a.transpose(1, 2)
        elif key.endswith("experts.down_proj_bias"):
            key = key.replace("down_proj_bias", "down_proj.bias")
        elif key.endswith("sinks"):
            key += ".weight"
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if q8_0 and a.dim() == 2 and a.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(a.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        w.add_tensor(name, a.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_gpt_oss")
    full = gpt_oss.make_tiny(d / "st", seed=5)
    mxfp4, _, _ = _mxfp4_checkpoint(full, d / "mxfp4")
    return full, mxfp4


def _same_params(gguf_path, src):
    a = load_model(gguf_path, dtype=torch.float32).state_dict()
    b = load_model(src, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


@pytest.mark.parametrize("which", ["full", "mxfp4"])
def test_gguf_equals_the_checkpoint(checkpoints, which, tmp_path):
    src = checkpoints[0] if which == "full" else checkpoints[1]
    path = write_gpt_oss_gguf(src, tmp_path / f"{which}.gguf")
    gg = GGUFReader(path)
    if which == "mxfp4":
        info = gg.tensor_infos["blk.0.ffn_gate_exps.weight"]
        assert info.ggml_type == gguf.GGMLQuantizationType.MXFP4
    ours, want = gpt_oss.Config.from_hf(gg.config), gpt_oss.Config.from_hf(
        json.loads((src / "config.json").read_text()))
    assert (ours.windows, ours.yarn, ours.num_experts, ours.num_experts_per_tok) == (
        want.windows, want.yarn, want.num_experts, want.num_experts_per_tok)
    _same_params(path, src)


def test_mxfp4_gguf_generates_the_checkpoints_tokens(checkpoints, tmp_path):
    _, mxfp4 = checkpoints
    path = write_gpt_oss_gguf(mxfp4, tmp_path / "m.gguf")
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [list(range(30, 50))]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(mxfp4), **kw).generate(prompts, sp)]
    assert [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)] == want
