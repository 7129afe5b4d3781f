"""GGUF reader: dequantization per type, llama.cpp's q/k permutation, the default model's logits.

The default-model check compares against logits that transformers' own GGUF loader produced
(`tests/checkpoint/data/smollm2_q4_1_golden.npz`, written by running this file as a script):
transformers parses GGUF with `gguf.GGUFReader` and needs 30-70 s for this file on a 2-core
machine, too slow for every run. `SPECDEPLOY_LIVE_ORACLE=1` runs the live comparison instead.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader, hf_name
from specdeploy.default_model import DEFAULT_GGUF, default_model_path
from specdeploy.loading import load_model
from specdeploy.models import llama

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
GOLDEN = Path(__file__).parent / "data" / "smollm2_q4_1_golden.npz"
PROMPT = [{"role": "user", "content": "Explain speculative decoding in two sentences: what does "
           "the draft model propose, and how does the target model verify it losslessly?"}]


def _quant_bytes(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid raw blocks for `qtype` (K-quants: random bits with sane fp16 scales)."""
    if qtype in (Q.F32, Q.F16):
        dtype = np.float32 if qtype == Q.F32 else np.float16
        return rng.standard_normal((rows, cols)).astype(dtype)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        raw[..., 0:4] = scales.reshape(rows, cols // block, 4)
    elif qtype == Q.Q6_K:  # d last
        raw[..., 208:210] = scales[..., :2]
    return raw.reshape(rows, -1)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, int]],
           metadata: dict | None = None, arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)  # uint8 data: shape in bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K,
                                   Q.Q6_K])
def test_dequantize_matches_transformers(tmp_path, qtype):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rows, cols = 6, 512
    data = _quant_bytes(qtype, rows, cols, np.random.default_rng(int(qtype)))
    meta = {"llama.attention.head_count": 2, "llama.embedding_length": cols, "llama.vocab_size": 8,
            "llama.feed_forward_length": 8, "llama.block_count": 1}
    path = _write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (data, qtype)}, meta)
    got = GGUFReader(path).get("model.layers.0.mlp.up_proj.weight")
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
    if qtype in (Q.F32, Q.F16):
        want = torch.from_numpy(data.astype(np.float32))
    else:
        want = hf_dequantize(raw, int(qtype)).reshape(rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation of q/k rows (interleaved RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _tiny_llama_gguf(src: Path, out: Path, qtype=Q.F32, rope_freqs=None,
                    extra_meta: dict | None = None) -> Path:
    """Convert a tiny safetensors Llama to GGUF the way llama.cpp does (names, permutation)."""
    reader = open_checkpoint(src)
    cfg = reader.config
    inverse = {}
    for name in reader.keys():
        for stem, hf in [("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"),
                         ("output", "lm_head")]:
            if name == f"{hf}.weight":
                inverse[name] = f"{stem}.weight"
        if name.startswith("model.layers."):
            n = name.split(".")[2]
            for short in ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                          "ffn_gate", "ffn_up", "ffn_down"]:
                if hf_name(f"blk.{n}.{short}.weight") == name:
                    inverse[name] = f"blk.{n}.{short}.weight"
    tensors = {}
    for name, gname in inverse.items():
        w = reader.get(name).numpy()
        if "attn_q" in gname:
            w = _permute(w, cfg["num_attention_heads"])
        elif "attn_k" in gname:
            w = _permute(w, cfg["num_key_value_heads"])
        q = qtype if w.ndim == 2 else Q.F32
        data = w if q == Q.F32 else gguf.quants.quantize(w, q)
        tensors[gname] = (data, q)
    if rope_freqs is not None:  # llama.cpp's form of llama3 rope scaling
        tensors["rope_freqs.weight"] = (rope_freqs.numpy().astype(np.float32), Q.F32)
    meta = {"llama.attention.head_count": cfg["num_attention_heads"],
            "llama.attention.head_count_kv": cfg["num_key_value_heads"],
            "llama.embedding_length": cfg["hidden_size"], "llama.block_count":
            cfg["num_hidden_layers"], "llama.feed_forward_length": cfg["intermediate_size"],
            "llama.context_length": cfg["max_position_embeddings"],
            "llama.rope.freq_base": float(cfg["rope_theta"]),
            "llama.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "llama.attention.key_length": cfg["head_dim"], **(extra_meta or {})}
    return _write(out, tensors, meta)


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_llama_gguf_equals_safetensors(tmp_path, tie):
    src = llama.make_tiny(tmp_path / "st", seed=3, config_overrides={"tie_word_embeddings": tie})
    path = _tiny_llama_gguf(src, tmp_path / "tiny.gguf")
    reader = GGUFReader(path)
    assert reader.config["tie_word_embeddings"] is tie
    assert ("lm_head.weight" in reader) is not tie
    ours, ref = load_model(path), load_model(src)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids), rtol=0, atol=1e-5)


def test_llama3_rope_as_gguf_freq_factors(tmp_path):
    from specdeploy.models.layers import RopeConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    src = llama.make_tiny(tmp_path / "st", seed=5, config_overrides={"rope_scaling": scaling})
    hf = open_checkpoint(src).config
    freqs = RopeConfig.from_hf({**hf, "rope_scaling": None}).inv_freq(16) / RopeConfig.from_hf(
        hf).inv_freq(16)
    assert not torch.allclose(freqs, torch.ones_like(freqs))
    path = _tiny_llama_gguf(src, tmp_path / "l3.gguf", rope_freqs=freqs)
    assert "freq_factors" in GGUFReader(path).config["rope_parameters"]
    ids = torch.arange(60).reshape(1, 60) % 128
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(ids), load_model(src)(ids), rtol=0, atol=1e-5)


def test_yarn_rope_from_gguf_metadata(tmp_path):
    """llama.cpp's converter writes a YaRN `rope_scaling` (Qwen2.5 / Qwen3 long context) as
    rope.scaling.* keys: the model equals the safetensors one with the same scaling."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    src = llama.make_tiny(tmp_path / "st", seed=6, config_overrides={
        "rope_scaling": scaling, "max_position_embeddings": 256})
    path = _tiny_llama_gguf(src, tmp_path / "yarn.gguf", extra_meta={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 16})
    assert GGUFReader(path).config["rope_scaling"]["rope_type"] == "yarn"
    ids = torch.arange(60).reshape(1, 60) % 128
    with torch.no_grad():
        got, want = load_model(path)(ids), load_model(src)(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        plain = load_model(_tiny_llama_gguf(src, tmp_path / "plain.gguf"))(ids)
    assert (plain - want).abs().max() > 1e-2  # (the scaling matters at these positions)


def test_tiny_llama_gguf_q8_0_close(tmp_path):
    src = llama.make_tiny(tmp_path / "st", seed=4)
    ours, ref = load_model(_tiny_llama_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)), load_model(src)
    ids = torch.arange(40).reshape(2, 20)
    with torch.no_grad():
        a, b = ours(ids), ref(ids)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_truncated_and_corrupt_gguf(tmp_path):
    src = default_model_path()
    data = src.read_bytes()
    for size, what in [(len(data) // 2, "truncated GGUF file"), (4096, "truncated"),
                       (10, "truncated")]:
        bad = tmp_path / f"cut{size}.gguf"
        bad.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=what):
            load_model(bad)
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"NOPE" + data[4:4096])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_checkpoint(bad)


def test_unsupported_gguf_architecture(tmp_path):
    path = _write(tmp_path / "x.gguf", {"a.weight": (np.ones((2, 2), np.float32), Q.F32)},
                  arch="mamba")
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'mamba'.*llama"):
        GGUFReader(path)


def test_default_model_config_and_keys():
    reader = GGUFReader(default_model_path())
    cfg = reader.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    dims = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"])
    assert dims == (30, 576, 3)
    assert "model.layers.29.self_attn.k_proj.weight" in reader and "lm_head.weight" not in reader
    assert reader.get("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


def test_default_model_matches_transformers_golden(default_model):
    golden = np.load(GOLDEN)
    ids = torch.from_numpy(golden["input_ids"])[None]
    assert ids.shape[1] >= 32
    with torch.no_grad():
        logits = default_model(ids)[0]
    cols = torch.from_numpy(golden["columns"])
    torch.testing.assert_close(logits[:, cols], torch.from_numpy(golden["logits_columns"]),
                               rtol=0, atol=1e-3)
    torch.testing.assert_close(logits[-1], torch.from_numpy(golden["logits_last"]),
                               rtol=0, atol=1e-3)
    assert logits.argmax(-1).tolist() == golden["argmax"].tolist()


@pytest.mark.skipif(not os.environ.get("SPECDEPLOY_LIVE_ORACLE"), reason="slow: 30-70 s")
def test_default_model_matches_transformers_live(default_model, tmp_path):
    ids, want = _transformers_oracle(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(default_model(ids), want, rtol=0, atol=1e-3)


def _transformers_oracle(tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copy(default_model_path(), tmp / DEFAULT_GGUF)  # transformers wants dir + file name
    tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=DEFAULT_GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=DEFAULT_GGUF,
                                                 dtype=torch.float32).eval()
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        return ids, model(ids).logits


if __name__ == "__main__":  # regenerate the golden file: python tests/checkpoint/test_gguf.py
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ids, logits = _transformers_oracle(Path(d))
    logits = logits[0].numpy()
    columns = np.sort(np.random.default_rng(0).choice(logits.shape[1], 512, replace=False))
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, input_ids=ids[0].numpy(), columns=columns,
                        logits_columns=logits[:, columns], logits_last=logits[-1],
                        argmax=logits.argmax(-1))
    print(f"wrote {GOLDEN} ({ids.shape[1]} tokens)", file=sys.stderr)
