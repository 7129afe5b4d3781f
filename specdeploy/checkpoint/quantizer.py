"""specdeploy's own quantizer: writes ModelOpt FP8 / NVFP4 and HF fine-grained FP8 checkpoints in
the layouts NVIDIA's and Qwen's releases ship (see ops/fp8_linear.py, ops/nvfp4_linear.py).

Excluded as those releases do: the LM head, MTP layers (`mtp*`: the drafter stays bf16), MoE
routers and the shared-expert gate, the vision tower; embeddings, norms and convolutions are
never quantized. NVFP4 also leaves out linears whose input size is not a multiple of 16 (named
one by one in `exclude_modules`). DeepSeek-style MTP layers (DeepSeek-V3, GLM-4.5: trailing
decoder layers `model.layers.{L}`, L >= num_hidden_layers) follow their own releases: HF block
FP8 (DeepSeek-V3 / R1, GLM-4.5-FP8) quantizes the layer's decoder block like every other layer
and keeps `eh_proj` / `shared_head.head` bf16, listing nothing (vLLM and SGLang build those two
unquantized); NVIDIA's ModelOpt exports exclude the whole layer as `model.layers.{L}*`.

Static FP8 activation scales (ModelOpt `input_scale` = amax / 448) are calibrated on the model
itself: a few random-token sequences through the plain fp32 model, recording each linear's input
amax and, for routed experts, the amax of each expert's input and intermediate activations.
"""
from __future__ import annotations

import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specdeploy.checkpoint.quant_exclude import is_drafter_module
from specdeploy.checkpoint.reader import CheckpointError, CheckpointReader, open_checkpoint
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.ops.fp8_linear import FP8_MAX, quantize_fp8_block, quantize_fp8_tensor
from specdeploy.ops.nvfp4_linear import E2M1_MAX, GROUP, quantize_nvfp4

__all__ = ["METHODS", "RELEASE_EXCLUDE", "quantize_checkpoint"]

METHODS = ("fp8", "nvfp4", "fp8-block")
RELEASE_EXCLUDE = ("lm_head", "mtp*", "*.mlp.gate", "*.mixer.gate", "*.shared_expert_gate",
                   "model.visual*")
_NEVER = ("embed", "norm", "conv1d")  # leaves quantized by no release
_MTP_BF16 = (".eh_proj", ".shared_head.head")  # DeepSeek-style MTP layers' bf16 linears
_SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")


def _module(key: str) -> str:
    return key[: -len(".weight")]


def _mtp_layers(modules: list[str], n_layers: int) -> list[str]:
    """DeepSeek-style MTP layers of a checkpoint (`model.layers.{L}`, L >= n_layers)."""
    return sorted({".".join(m.split(".")[:3]) for m in modules
                   if m.startswith("model.layers.") and is_drafter_module(m, n_layers)})


def _exclusions(exclude: tuple[str, ...], modules: list[str], n_layers: int, method: str
                ) -> list[str]:
    """`exclude` as this checkpoint's release would write it: `mtp*` only where it names
    modules (a DeepSeek-style checkpoint has none), ModelOpt's `model.layers.{L}*` per
    DeepSeek-style MTP layer."""
    has_mtp = any(m.startswith("mtp.") for m in modules)
    out = [g for g in exclude if has_mtp or not g.startswith("mtp")]
    if method != "fp8-block":
        out += [f"{layer}*" for layer in _mtp_layers(modules, n_layers)]
    return out


def _quantizable(key: str, t: torch.Tensor) -> bool:
    return (key.endswith(".weight") and t.dim() == 2 and t.dtype.is_floating_point
            and not any(w in key for w in _NEVER))


class _MoeAmax(TorchDispatchMode):
    """Records, per routed-experts call, each expert's input / intermediate amax (by weight)."""

    def __init__(self, amax: dict):
        super().__init__()
        self.amax = amax

    current = ""  # the attention module running (set by a pre-hook), for its k / v amax

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.specdeploy.attention.default and self.current:
            for i, leaf in ((1, "k_scale"), (2, "v_scale")):
                key = (self.current, leaf)
                self.amax[key] = max(self.amax.get(key, 0.0), args[i].abs().max().item())
        if func is torch.ops.specdeploy.moe_experts.default:
            x, ids, _, w_up, _, act = args
            for e in range(w_up.shape[0]):
                rows = (ids == e).any(-1)
                if rows.any():
                    xe = x[rows].float()
                    h = xe @ w_up[e].float().t()
                    if act == "swiglu":
                        g, u = h.chunk(2, -1)
                        h = torch.nn.functional.silu(g) * u
                    else:
                        h = torch.relu(h).square()
                    for key, v in (((w_up.data_ptr(), e), xe), ((args[4].data_ptr(), e), h)):
                        self.amax[key] = max(self.amax.get(key, 0.0), v.abs().max().item())
        return out


def _calibrate(model: nn.Module, vocab: int, seqs: int = 4, tokens: int = 48) -> dict:
    """(weight data_ptr, expert or -1) → input amax over a few random-token sequences."""
    amax: dict = {}
    hooks = []
    def hook(m, inp):
        key = (m.weight.data_ptr(), -1)
        amax[key] = max(amax.get(key, 0.0), inp[0].detach().abs().max().item())

    mode = _MoeAmax(amax)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(hook))
        if hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: setattr(mode, "current", name)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (seqs, tokens), generator=gen)
    try:
        with torch.no_grad(), mode:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return amax


def _sources(reader, model: nn.Module, fam, cfg) -> dict[str, tuple[int, int]]:
    """checkpoint key → (data_ptr of the parameter it loads into, expert index or -1)."""
    log: list[str] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(reader, name)

        def __contains__(self, name):
            return name in reader

        def get(self, name):
            log.append(name)
            return reader.get(name)

    params = fam.checkpoint_to_params(Recording(), cfg, with_mtp=hasattr(model, "mtp"))
    named = dict(model.named_parameters())
    out = {}
    for name, thunk in params.items():
        start = len(log)
        thunk()
        keys = log[start:]
        p = named.get(name)
        if p is None:
            continue
        experts = p.dim() == 3 and len(keys) >= p.shape[0] and len(keys) % p.shape[0] == 0
        per = len(keys) // p.shape[0] if experts else 1
        for i, k in enumerate(keys):
            out[k] = (p.data_ptr(), i // per if experts else -1)
    return out


def _load(src: Path):
    from specdeploy.checkpoint.quant_config import detect_quant_config
    from specdeploy.loading import load_model_from_reader
    from specdeploy.models.registry import module_for_config

    reader = open_checkpoint(src)
    if detect_quant_config(reader.path, reader.config, reader.keys()) is not None:
        raise CheckpointError(f"{src}: already quantized; quantize from a full-precision one")
    hf = reader.config.get("text_config", reader.config)
    mtp = any(int(hf.get(k) or 0) > 0 for k in ("num_nextn_predict_layers",
                                                  "mtp_num_hidden_layers"))
    model = load_model_from_reader(reader, "float32", with_mtp=mtp)
    fam = module_for_config(reader.config)
    return reader, model, fam, fam.Config.from_hf(reader.config)


def quantize_checkpoint(src: str | Path, out: str | Path, method: str,
                        exclude: tuple[str, ...] = RELEASE_EXCLUDE, kv_cache: str | None = None
                        ) -> Path:
    """Write `src` (any loadable checkpoint) quantized with `method` to `out`; returns `out`.
    `kv_cache="fp8"` (ModelOpt methods) also declares an FP8 KV cache with calibrated per-layer
    `k_proj.k_scale` / `v_proj.v_scale` (amax / 448)."""
    if method not in METHODS:
        raise ValueError(f"quantize: unsupported method {method!r}; use one of {METHODS}")
    if kv_cache not in (None, "fp8") or (kv_cache and method == "fp8-block"):
        raise ValueError(f"quantize: kv_cache must be None or 'fp8' (ModelOpt methods), got "
                         f"{kv_cache!r} with {method!r}")
    src, out = Path(src), Path(out)
    reader, model, fam, cfg = _load(src)
    if isinstance(reader, CheckpointReader):  # the released layout, exactly as stored
        tensors = {k: reader.get(k) for k in reader.keys()}
    else:  # GGUF: our parameters in the family's released layout
        tensors = fam.params_to_checkpoint(model.state_dict(), cfg)
    amax = _calibrate(model, cfg.vocab_size) if method == "fp8" or kv_cache else {}
    source = _sources(reader, model, fam, cfg) if method == "fp8" else {}
    n_layers = int(reader.config.get("text_config", reader.config).get("num_hidden_layers") or 0)
    modules = sorted({k.rpartition(".")[0] for k in tensors})
    mtp_layers = _mtp_layers(modules, n_layers)
    exclude = tuple(_exclusions(exclude, modules, n_layers, method))
    excluded, result = list(exclude), {}
    for key, t in tensors.items():
        mod = _module(key) if key.endswith(".weight") else key
        mtp_bf16 = mod.endswith(_MTP_BF16) and any(mod.startswith(m + ".") for m in mtp_layers)
        if not _quantizable(key, t) or mtp_bf16 or any(fnmatchcase(mod, g) for g in exclude):
            result[key] = t
            continue
        if method == "nvfp4" and t.shape[1] % GROUP:
            excluded.append(mod)
            result[key] = t
            continue
        result.update(_quantize_one(key, t.float(), method, amax, source))
    if kv_cache:
        result.update(_kv_scale_tensors(amax, list(tensors)))
    # NOTE: unquantized matrices ship in bf16, as in the releases; vectors (norms, biases, SSM
    # parameters) and scales keep their precision (a shipped drafter head recognises its target
    # by its final norm's sum: drafters_registry; block FP8's 2-D `weight_scale_inv` is fp32 in
    # the releases)
    result = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 and v.dim() >= 2
                  and not k.endswith(_SCALES) else v) for k, v in result.items()}
    config = dict(reader.config)
    config["torch_dtype"] = "bfloat16"
    if method == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": excluded}
    write_checkpoint(out, config, result)
    if method != "fp8-block":
        quant = {"quant_algo": method.upper(), "kv_cache_quant_algo": "FP8" if kv_cache else None,
                 "exclude_modules": excluded}
        if method == "nvfp4":
            quant["group_size"] = GROUP
        hqc = {"producer": {"name": "modelopt", "version": "specdeploy"}, "quantization": quant}
        (out / "hf_quant_config.json").write_text(json.dumps(hqc, indent=2))
    if not src.is_dir():  # a GGUF file: its tokenizer as a HF fast tokenizer
        _write_tokenizer(src, out)
    else:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                    "config.json", "model.safetensors.index.json", "hf_quant_config.json"):
                shutil.copy2(f, out / f.name)
    return out


def _quantize_one(key: str, w: torch.Tensor, method: str, amax: dict, source: dict) -> dict:
    base = key[: -len("weight")]
    if method == "fp8-block":
        q, s = quantize_fp8_block(w)
        return {key: q, base + "weight_scale_inv": s}
    if method == "nvfp4":
        p, s, s2 = quantize_nvfp4(w)
        # NOTE: written for layout fidelity (an FP4 GEMM would quantize activations with it);
        # unused here: no amax calibration pass for NVFP4, the weight-only path ignores it
        return {key: p, base + "weight_scale": s, base + "weight_scale_2": s2,
                base + "input_scale": torch.tensor(1.0 / E2M1_MAX)}
    q, s = quantize_fp8_tensor(w)
    a = amax.get(source.get(key, (0, -1)), 0.0)
    if a <= 0.0:  # never reached in calibration (an expert no token chose): its peers' largest
        ptr = source.get(key, (0, -1))[0]
        a = max([v for (p, _), v in amax.items() if p == ptr] or [1.0])
    return {key: q, base + "weight_scale": s, base + "input_scale": torch.tensor(a / FP8_MAX)}


def _write_tokenizer(src: Path, out: Path) -> None:
    """The GGUF's tokenizer as tokenizer.json + configs; none for a GGUF without one (the
    weights are complete; `LLM` then names the missing tokenizer.json)."""
    from specdeploy.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(src)
    except CheckpointError:
        return
    tok.backend.save(str(out / "tokenizer.json"))
    cfg = {**{k: v for k, v in tok.special_tokens.items() if v is not None},
           "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids}
    (out / "generation_config.json").write_text(json.dumps(gen))


def _kv_scale_tensors(amax: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """`<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` per calibrated attention module, named
    as the checkpoint names that module (found by its k_proj weight)."""
    out = {}
    for (mod, leaf), a in amax.items():
        if not isinstance(mod, str) or mod.startswith("mtp."):
            continue  # the drafter's KV stays at the model dtype
        tail = mod[len("model."):] if mod.startswith("model.") else mod
        ckpt = next((k[: -len(".k_proj.weight")] for k in keys
                     if k.endswith(f"{tail}.k_proj.weight") and not k.startswith("mtp.")), None)
        if ckpt is not None:
            proj = "k_proj" if leaf == "k_scale" else "v_proj"
            out[f"{ckpt}.{proj}.{leaf}"] = torch.tensor(max(a, 1e-6) / FP8_MAX)
    return out
