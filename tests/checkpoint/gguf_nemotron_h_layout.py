"""A tiny NemotronH safetensors checkpoint written as llama.cpp's converter writes its GGUF
(convert_hf_to_gguf.py, NemotronHModel / GraniteHybridModel / Mamba2Model), for the tests.

Tensor names come from gguf-py's own map (`gguf.get_tensor_name_map`, not the reader's); the
MTP block's names, which gguf-py 0.19 does not map yet, and the value changes follow the
converter: A_log -> -exp(A_log) as [heads, 1], D as [heads, 1], conv1d without its middle axis,
the grouped norm as [groups, d_inner / groups], q/k rows permuted as for llama's RoPE, routed
experts stacked, the MTP head folded into one trailing block.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH

from specdeploy.checkpoint import open_checkpoint

Q = gguf.GGMLQuantizationType
MTP_NAMES = {"mtp.layers.0.enorm.weight": "nextn.enorm.weight",
             "mtp.layers.0.hnorm.weight": "nextn.hnorm.weight",
             "mtp.layers.0.eh_proj.weight": "nextn.eh_proj.weight",
             "mtp.layers.1.norm.weight": "post_attention_norm.weight",
             "mtp.layers.1.final_layernorm.weight": "nextn.shared_head_norm.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _kinds(cfg: dict) -> str:
    return cfg["hybrid_override_pattern"]


def _converted(src: Path) -> tuple[dict[str, np.ndarray], dict, MODEL_ARCH]:
    """{GGUF name: fp32 array (torch order)}, the HF config, the GGUF architecture."""
    reader = open_checkpoint(src)
    cfg = reader.config
    kinds = _kinds(cfg)
    n, nextn = len(kinds), cfg.get("num_nextn_predict_layers", 0)
    arch = MODEL_ARCH.NEMOTRON_H_MOE if "E" in kinds else MODEL_ARCH.NEMOTRON_H
    names = gguf.get_tensor_name_map(arch, n + nextn)
    out, experts = {}, defaultdict(dict)
    for key in reader.keys():
        w = reader.get(key).numpy().astype(np.float32)
        hf = key
        if key.startswith("mtp.layers."):  # folded into block n
            if key in MTP_NAMES:
                out[f"blk.{n}.{MTP_NAMES[key]}"] = w
                continue
            hf = f"backbone.layers.{n}." + key.split(".", 3)[3]
        bid = int(hf.split(".")[2]) if hf.startswith("backbone.layers.") else None
        if ".mixer.experts." in hf:
            experts[(bid, hf.rsplit(".", 2)[1])][int(hf.split(".")[5])] = w
            continue
        if hf.endswith(".dt_bias"):
            hf = hf[: -len(".dt_bias")] + ".dt.bias"
        elif hf.endswith("e_score_correction_bias"):
            hf = hf[: -len("_bias")] + ".bias"
        if hf.endswith(".A_log"):
            w = -np.exp(w).reshape(-1, 1)
        elif hf.endswith(".D"):
            w = w.reshape(-1, 1)
        elif hf.endswith("mixer.conv1d.weight"):
            w = w.squeeze()
        elif hf.endswith("mixer.norm.weight"):
            w = w.reshape(cfg["n_groups"], -1)
        elif hf.endswith("q_proj.weight"):
            w = permute(w, cfg["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            w = permute(w, cfg["num_key_value_heads"])
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        out[name] = w
    for (bid, proj), by_e in experts.items():
        stacked = np.stack([by_e[e] for e in range(len(by_e))])
        out[names.get_name(f"model.layers.{bid}.mlp.experts.{proj}.weight",
                           try_suffixes=(".weight",))] = stacked
    return out, cfg, arch


def write_gguf(src: Path, out: Path, qtype=Q.F32, expert_qtype=Q.F32,
               tokenizer: bool = True) -> Path:
    """`src` (nemotron_h.make_tiny) as a GGUF; 2-D weights in `qtype`, stacked experts in
    `expert_qtype` where their rows divide into blocks (else F32, as llama.cpp falls back)."""
    tensors, cfg, arch = _converted(src)
    kinds = _kinds(cfg)
    n, nextn = len(kinds), cfg.get("num_nextn_predict_layers", 0)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    attn = [k == "*" for k in kinds] + [True] * nextn
    ffn_kind = "E" if arch == MODEL_ARCH.NEMOTRON_H_MOE else "-"
    ffn = [k == ffn_kind for k in kinds] + [True] * nextn
    ff = cfg["moe_intermediate_size"] if ffn_kind == "E" else cfg["intermediate_size"]
    w.add_block_count(n + nextn)
    w.add_context_length(2**20)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if a else 0 for a in attn])
    w.add_feed_forward_length([ff if f else 0 for f in ffn])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    w.add_ssm_group_count(cfg["n_groups"])
    if ffn_kind == "E":
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
        w.add_expert_shared_count(1)
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        if cfg.get("moe_latent_size"):
            w.add_moe_latent_size(cfg["moe_latent_size"])
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if tokenizer:
        add_tokenizer(w, src, cfg["vocab_size"])
    for name, a in sorted(tensors.items()):
        quantized_or_f32(w, name, a, qtype, expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# (gguf-py cannot quantize to them)
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS,
            Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,  # random blocks (gguf-py cannot write)
            Q.TQ1_0, Q.TQ2_0)  # (it can: its d = max |w| would inflate a random model's weights)


def quantized_or_f32(w, name: str, a: np.ndarray, qtype, expert_qtype) -> None:
    """Adds tensor `name`: stacked experts in `expert_qtype`, other matrices in `qtype` (as
    llama-quantize: not norms, the grouped SSM norm stored 2-D, nor the routers), where their
    rows divide into blocks; else F32. gguf-py cannot quantize to K-quants: those tensors get
    random valid blocks of small values instead (`random_kquant`), not `a`'s."""
    q = (expert_qtype if name.endswith("_exps.weight") else
         qtype if a.ndim == 2 and "norm" not in name and "ffn_gate_inp" not in name else Q.F32)
    if q == Q.F32 or a.shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
        w.add_tensor(name, a)
    elif q == Q.F16:
        w.add_tensor(name, a.astype(np.float16))
    elif q in K_QUANTS:
        rng = np.random.default_rng(sum(map(ord, name)))
        w.add_tensor(name, random_kquant(q, a.shape, rng), raw_dtype=q)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)


# the IQ1 / IQ2 / IQ3 kinds: d's divisor keeping values near the others' (|value| <= d * 31 *
# {43 / 8, 62 / 4, 15, 9 / 8} at the largest scale and codebook value)
IQ_D_DIV = {Q.IQ2_XXS: 4, Q.IQ2_XS: 4, Q.IQ2_S: 4, Q.IQ3_XXS: 12, Q.IQ3_S: 12, Q.IQ1_S: 1,
            Q.IQ1_M: 1, Q.TQ1_0: 0.1, Q.TQ2_0: 0.1}  # (TQ: values -1..2 times d, d last)


def random_kquant(qtype, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant (and IQ4_NL / IQ4_XS, IQ1-IQ3) blocks for a tensor of `shape`, centred as a
    quantizer's would be, values below ~0.02 (fp16 d = dmin of 1e-4..3e-4). Q4_K / Q5_K: every
    sub-block's scale sc and min m with m ~ sc * (levels - 1) / 2 (sub-blocks 0-3: sc 8 / m 60
    for Q4_K, 4 / 62 for Q5_K; 4-7: 2 / 15 and 1 / 15); Q6_K: int8 sub-block scales in
    [-8, 8]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    lead, n = shape[:-1], shape[-1] // block
    raw = rng.integers(0, 256, (*lead, n, size), dtype=np.uint8)
    small = rng.uniform(1e-4, 3e-4, (*lead, n, 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.IQ4_NL:  # d, then any nibbles (table values up to 127: d / 8 keeps them small)
        raw[..., 0:2] = (small.view(np.float16) / 8).view(np.uint8)
    elif qtype == Q.IQ4_XS:  # d, then 6-bit scales ls - 32 in -32..31 (any bits), nibbles
        raw[..., 0:2] = (small.view(np.float16) / 64).view(np.uint8)
    elif qtype == Q.Q3_K:  # any bits, d last (values -4..3 times 6-bit scales - 32)
        raw[..., 108:110] = (small.view(np.float16) / 16).view(np.uint8)
    elif qtype == Q.Q2_K:  # any scale / min nibbles, then d, dmin (m ~ sc * 3 / 2: centred)
        raw[..., 0:16] = (rng.integers(4, 16, (*lead, n, 16)) | rng.integers(6, 12, (*lead, n, 16))
                          << 4).astype(np.uint8)
        raw[..., 80:82] = raw[..., 82:84] = small
    elif qtype in IQ_D_DIV:  # any bits (codebook indices, signs, scales), then a small d
        d = (small.view(np.float16) / IQ_D_DIV[qtype]).view(np.uint16)[..., 0]
        if qtype == Q.IQ1_M:  # d's four nibbles are the top nibbles of the scales' uint16s
            sc = raw[..., 48:56].copy().view(np.uint16)
            for j in range(4):
                sc[..., j] = (sc[..., j] & 0x0FFF) | (((d >> 4 * j) & 0xF) << 12)
            raw[..., 48:56] = sc.view(np.uint8)
        elif qtype in (Q.TQ1_0, Q.TQ2_0):
            raw[..., size - 2:size] = d[..., None].view(np.uint8)
        else:
            raw[..., 0:2] = d[..., None].view(np.uint8)
    elif qtype == Q.Q6_K:
        raw[..., 192:208] = rng.integers(-8, 9, (*lead, n, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = small
    else:  # d = dmin, then the packed 6-bit scales / mins
        raw[..., 0:2] = raw[..., 2:4] = small
        lo_sc, lo_m, hi_sc, hi_m = (8, 60, 2, 15) if qtype == Q.Q4_K else (4, 62, 1, 15)
        raw[..., 4:8], raw[..., 8:12], raw[..., 12:16] = lo_sc, lo_m, (hi_m << 4) | hi_sc
    return raw.reshape(*lead, n * size)


def add_tokenizer(w, src: Path, vocab_size: int, pre: str = "default") -> None:
    """The tiny character tokenizer (checkpoint/tiny.py) as a gpt2 one with no merges: its
    single characters are byte-level tokens already."""
    import json

    spec = json.loads((src / "tokenizer.json").read_text())
    tokens = [""] * vocab_size
    for t, i in spec["model"]["vocab"].items():
        tokens[i] = t
    special = {a["content"] for a in spec.get("added_tokens", ()) if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special or t.startswith("<|filler")
                       else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([])
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    w.add_chat_template(tc["chat_template"])


def wide_moe_gguf(d: Path, qtype, expert_qtype) -> Path:
    """tests/ops/test_ggml_kquants.py's tiny NemotronH MoE with every width a multiple of 256
    (the 256-value kinds' super-blocks) as a GGUF: matrices in `qtype`, experts in
    `expert_qtype` (random valid blocks for the kinds gguf-py cannot write)."""
    from specdeploy.models import nemotron_h as nh
    from tests.checkpoint.test_gguf_nemotron_h import MOE

    hf = dict(MOE, hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, head_dim=64,
              moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
              moe_latent_size=256)
    src = nh.make_tiny(d / "st", seed=3, mtp_layers=1, hf_config=hf)
    return write_gguf(src, d / "model.gguf", qtype=qtype, expert_qtype=expert_qtype)
