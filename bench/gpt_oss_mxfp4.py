"""A random mid-size gpt-oss checkpoint with MXFP4 experts, as gpt-oss is released
(`quantization_config` mxfp4: `*_blocks` / `*_scales` for the experts, everything else in full
precision), for bench/vs_llamacpp_moe.py `--archs gpt_oss`: llama.cpp's converter keeps MXFP4
experts from such a checkpoint (ggml type 39), so both tools run the experts as released.

Written without ever holding the experts in fp32 (at this shape they would be ~3 GB): the other
parameters come from the model built on the meta device, drawn as gpt_oss.make_tiny draws them.
"""
from __future__ import annotations

from pathlib import Path

import torch

# gpt-oss-20b's attention (heads of 64, 4 kv heads, biases, sinks, windows of 128 every other
# layer) and routing (top 4, softmax over the chosen) at hidden 1024, 32 experts of width 1024,
# 8 layers: ~0.85B parameters, ~0.12B active a token; ~0.45 GB of MXFP4 experts
GPT_OSS = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=4096,
               num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
               max_position_embeddings=4096,
               layer_types=["sliding_attention", "full_attention"] * 4,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 4096})
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # gpt-oss-20b's modules_to_not_convert


def make_mxfp4(out: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    from specdeploy.checkpoint.tiny import write_checkpoint, write_tiny_tokenizer
    from specdeploy.models import gpt_oss

    hf = {**gpt_oss.tiny_hf_config(), **GPT_OSS, **(overrides or {})}
    hf["quantization_config"] = {"quant_method": "mxfp4",
                                 "modules_to_not_convert": NOT_CONVERTED}
    cfg = gpt_oss.Config.from_hf(hf)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in gpt_oss.Model(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in shapes.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue  # MXFP4 below
        r = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.1 * r
        elif name.endswith(("sinks", "embed_tokens.weight")):
            params[name] = r
        elif name.endswith("bias"):
            params[name] = 0.1 * r
        else:
            params[name] = r * shape[-1] ** -0.5
    tensors = gpt_oss.params_to_checkpoint(params, cfg)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        # transformers' MXFP4 layout: [E, N, K / 32, 16] nibbles, [E, N, K / 32] E8M0 scales;
        # 2^-8 .. 2^-6 times E2M1's values: rows of about the 1 / sqrt(K) size of the others
        for proj, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            tensors[key + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen,
                                                     dtype=torch.uint8)
            tensors[key + "_scales"] = torch.randint(119, 122, (e, n, k // 32), generator=gen,
                                                     dtype=torch.uint8)
    write_checkpoint(out, hf, tensors)
    write_tiny_tokenizer(out, hf["vocab_size"])
    return Path(out)
