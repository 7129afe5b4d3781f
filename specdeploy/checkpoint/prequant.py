"""Loading pre-quantized checkpoints: every weight read together with its scales, never without.

`QuantizedReader` wraps a `CheckpointReader`. The model families read tensors by name as usual;
a quantized weight (`X.weight` with its `X.weight_scale*` siblings) comes back *dequantized*
(fp32, exactly the value the quantized ops compute with), so the plain model is the
weight-dequantized model and every family loads without knowing about quantization. Meanwhile
the reader keeps the quantized tensors: `wrap_params` records which ones each model parameter was
built from (one, a row-stack of q/k/v or gate/up, or one per expert for fused 3-D experts), and
`attach` hands them to the model as `prequant_weights` (parameter name → Fp8Weight /
Nvfp4Weight), where the deploy pass `prequantized_weights` swaps the quantized ops in.

A float8 / uint8 weight without scales, or scales of the wrong shape, is an error naming it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from specdeploy.checkpoint.quant_config import QuantConfig, detect_quant_config
from specdeploy.checkpoint.quant_exclude import (
    DRAFTER_ROOT,
    ExclusionMap,
    map_exclusions,
    target_module_name,
)
from specdeploy.checkpoint.reader import CheckpointError
from specdeploy.ops.fp8_linear import Fp8Weight, dequantize_fp8, row_scales_from_blocks
from specdeploy.ops.nvfp4_linear import GROUP, Nvfp4Weight, dequantize_nvfp4

__all__ = ["PrequantInfo", "QuantizedReader", "open_prequantized"]


@dataclass
class PrequantInfo:
    """What a pre-quantized checkpoint gave the model (for the deploy pass and its report)."""

    config: QuantConfig
    exclusions: ExclusionMap
    weights: dict = field(default_factory=dict)  # param name → Fp8Weight | Nvfp4Weight
    input_scales: dict = field(default_factory=dict)  # param name → fp32 scalar (FP8 only)
    excluded: dict = field(default_factory=dict)  # our module name → why (checkpoint glob)
    kv_scales: dict = field(default_factory=dict)  # our attention module → (k_scale, v_scale)


class QuantizedReader:
    """A `CheckpointReader` whose quantized weights read dequantized; see the module docstring."""

    def __init__(self, reader, qcfg: QuantConfig):
        self._r, self.qcfg = reader, qcfg
        self.config, self.path = reader.config, reader.path
        self._log: list[tuple[str, object, torch.Tensor | None]] = []
        # compressed-tensors NVFP4 stores `X.weight` as `X.weight_packed`: the families read
        # `X.weight`, so that name stands for it
        self._packed = qcfg.method == "ct_nvfp4"

    def keys(self) -> list[str]:
        keys = self._r.keys()
        if self._packed:
            keys = keys + [k[:-len("_packed")] for k in keys if k.endswith(".weight_packed")]
        return keys

    def __contains__(self, name: str) -> bool:
        return name in self._r or (self._packed and name.endswith(".weight")
                                   and name + "_packed" in self._r)

    def has_prefix(self, prefix: str) -> bool:
        return self._r.has_prefix(prefix)

    def missing(self, names) -> list[str]:
        return [n for n in self._r.missing(names) if n not in self]

    @staticmethod
    def _base(name: str) -> str:
        """Scale names are `X.weight_scale` for `X.weight` and `X_weight_scale` for a fused 3-D
        expert tensor `X` (`experts.gate_up_proj_weight_scale`)."""
        return name[: -len("weight")] if name.endswith(".weight") else name + "_"

    def is_quantized(self, name: str) -> bool:
        suffix = {"fp8_block": "weight_scale_inv", "ct_nvfp4": "weight_packed"}.get(
            self.qcfg.method, "weight_scale")
        return self._base(name) + suffix in self._r

    def get(self, name: str) -> torch.Tensor:
        if not self.is_quantized(name):
            t = self._r.get(name)
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (
                    t.dtype == torch.uint8 and name.endswith(".weight")):
                raise CheckpointError(f"{self.path}: tensor {name!r} is {t.dtype} but has no "
                                      f"scales ({self.qcfg.method} checkpoint)")
            return t
        qw, in_scale = self._quantized(name)
        self._log.append((name, qw, in_scale))
        if isinstance(qw, Fp8Weight):
            return dequantize_fp8(*qw)
        return dequantize_nvfp4(*qw)

    def get_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """`get(name)[rows]` of a 2-D weight, the quantized form recorded with the same rows
        (every format here keeps its scales per row: the selection is exact). For checkpoints
        whose fused projections a family splits (models/qwen3_next.py)."""
        t = self.get(name)
        if self.is_quantized(name):
            logged, qw, in_scale = self._log.pop()
            rows_of = [f[rows] if isinstance(f, torch.Tensor) else f for f in qw]
            self._log.append((logged, type(qw)(*rows_of), in_scale))
        return t[rows]

    def _per_matrix(self, key: str, lead: tuple, what: str) -> torch.Tensor:
        """A per-tensor scale (one per expert for a fused [E, N, K] tensor) as fp32 `lead`."""
        s = self._r.get(key).float()
        if s.numel() == 1:
            return s.reshape(()).expand(lead).contiguous() if lead else s.reshape(())
        _check(tuple(s.shape) == lead, self.path, key, f"{what} of shape () or {lead}, got "
               f"{tuple(s.shape)}")
        return s

    def _quantized(self, name: str):
        base, m = self._base(name), self.qcfg.method
        if m == "ct_fp8":
            return self._ct_fp8(name, base)
        w = self._r.get(base + "weight_packed" if m == "ct_nvfp4" else name)
        lead, n = tuple(w.shape[:-2]), w.shape[-2]
        if m in ("fp8", "fp8_block"):
            _check(w.dtype == torch.float8_e4m3fn, self.path, name, f"float8_e4m3fn, got {w.dtype}")
            k = w.shape[-1]
            if m == "fp8":
                s = self._per_matrix(base + "weight_scale", lead, "a per-tensor scale")
                scale, block_k = s[..., None, None].expand(*lead, n, 1).contiguous(), k
            else:
                bn, block_k = self.qcfg.block_size
                s = self._r.get(base + "weight_scale_inv")
                want = (*lead, -(-n // bn), -(-k // block_k))
                _check(tuple(s.shape) == want, self.path, base + "weight_scale_inv",
                       f"shape {want} for weight {tuple(w.shape)}, got {tuple(s.shape)}")
                scale = (torch.stack([row_scales_from_blocks(b, n, bn) for b in s])
                         if lead else row_scales_from_blocks(s, n, bn))
            in_scale = None
            if self.qcfg.static_activations and base + "input_scale" in self._r:
                in_scale = self._r.get(base + "input_scale").float().max()
            return Fp8Weight(w, scale, block_k), in_scale
        _check(w.dtype == torch.uint8, self.path, name, f"uint8 (packed E2M1), got {w.dtype}")
        s = self._r.get(base + "weight_scale")
        want = (*lead, n, w.shape[-1] * 2 // GROUP)
        _check(s.dtype == torch.float8_e4m3fn and tuple(s.shape) == want, self.path,
               base + "weight_scale", f"float8_e4m3fn {want}, got {s.dtype} {tuple(s.shape)}")
        if m == "ct_nvfp4":  # w = E2M1 * scale / global scale
            s2 = 1.0 / self._per_matrix(base + "weight_global_scale", lead, "weight_global_scale")
        else:
            s2 = self._per_matrix(base + "weight_scale_2", lead, "weight_scale_2")
        return Nvfp4Weight(w, s, s2[..., None].expand(*lead, n).contiguous()), None

    def _ct_fp8(self, name: str, base: str):
        """compressed-tensors FP8: `weight_scale` by the config's strategy (its docstring)."""
        w, q = self._r.get(name), self.qcfg
        _check(w.dtype == torch.float8_e4m3fn and w.dim() == 2, self.path, name,
               f"a 2-D float8_e4m3fn weight, got {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        s = self._r.get(base + "weight_scale").float()
        bn, bk = q.block_size
        want = {"tensor": (1,), "channel": (n, 1), "group": (n, -(-k // bk)),
                "block": (-(-n // bn), -(-k // bk))}[q.strategy]
        ok = tuple(s.shape) == want or (q.strategy == "tensor" and s.numel() == 1) or (
            q.strategy == "channel" and tuple(s.shape) == (n,))
        _check(ok, self.path, base + "weight_scale", f"per-{q.strategy} scales of shape {want} "
               f"for weight {tuple(w.shape)}, got {tuple(s.shape)}")
        if q.strategy == "tensor":
            scale, block_k = s.reshape(()).expand(n, 1).contiguous(), k
        elif q.strategy == "channel":
            scale, block_k = s.reshape(n, 1), k
        elif q.strategy == "group":
            scale, block_k = s, bk
        else:
            scale, block_k = row_scales_from_blocks(s, n, bn), bk
        in_scale = None
        if q.static_activations:
            _check(base + "input_scale" in self._r, self.path, base + "input_scale",
                   "a static activation scale (input_activations dynamic false)")
            in_scale = self._r.get(base + "input_scale").float().max()
        return Fp8Weight(w, scale, block_k), in_scale

    def wrap_params(self, params: dict[str, Callable[[], torch.Tensor]], info: PrequantInfo
                    ) -> dict[str, Callable[[], torch.Tensor]]:
        """Each thunk also records the quantized tensors it read into `info`."""
        def wrap(name: str, thunk: Callable[[], torch.Tensor]):
            def run() -> torch.Tensor:
                start = len(self._log)
                t = thunk()
                reads = self._log[start:]
                del self._log[start:]
                if reads:
                    info.weights[name], scale = _combine(name, reads, t.shape)
                    if scale is not None:
                        info.input_scales[name] = scale
                return t
            return run

        return {name: wrap(name, thunk) for name, thunk in params.items()}


def _check(ok: bool, path, name: str, want: str) -> None:
    if not ok:
        raise CheckpointError(f"{path}: tensor {name!r}: expected {want}")


def _cat(parts: list, dim: int):
    kind = type(parts[0])
    if kind is Fp8Weight:
        if len({p.block_k for p in parts}) != 1:
            raise CheckpointError("cannot stack fp8 weights of different input sizes")
        return Fp8Weight(torch.cat([p.weight for p in parts], dim),
                         torch.cat([p.scale for p in parts], dim), parts[0].block_k)
    return Nvfp4Weight(*(torch.cat([getattr(p, f) for p in parts], dim) for f in kind._fields))


def _stack(parts: list):
    kind = type(parts[0])
    if kind is Fp8Weight:
        return Fp8Weight(torch.stack([p.weight for p in parts]),
                         torch.stack([p.scale for p in parts]), parts[0].block_k)
    return Nvfp4Weight(*(torch.stack([getattr(p, f) for p in parts]) for f in kind._fields))


def _combine(name: str, reads: list, shape: torch.Size):
    """The quantized form of a parameter built from `reads` (checkpoint order): 2-D = the rows of
    every read stacked; 3-D [E, ...] = E equal groups of reads, each row-stacked."""
    qws = [q for _, q, _ in reads]
    if len({type(q) for q in qws}) != 1:
        raise CheckpointError(f"{name}: built from weights of mixed quantization formats")
    scales = [s for _, _, s in reads if s is not None]
    # NOTE: one static activation scale per parameter: the largest (vLLM / TensorRT-LLM do
    # the same for fused q/k/v, gate/up and MoE experts)
    in_scale = torch.stack(scales).max() if scales else None
    if len(qws) == 1 and qws[0].weight.dim() == len(shape):  # stored as the model holds it
        qw = qws[0]
    elif len(shape) == 2:
        qw = _cat(qws, 0)
    elif len(shape) == 3 and len(qws) % shape[0] == 0:
        per = len(qws) // shape[0]
        qw = _stack([_cat(qws[e * per:(e + 1) * per], 0) for e in range(shape[0])])
    else:
        raise CheckpointError(f"{name}: cannot rebuild a {tuple(shape)} parameter from "
                              f"{len(qws)} quantized tensors ({reads[0][0]}, ...)")
    if qw.weight.shape[-2] != shape[-2]:
        raise CheckpointError(f"{name}: quantized rows {qw.weight.shape[-2]} != {shape[-2]}")
    return qw, in_scale


def _quantizable_modules(model: nn.Module) -> list[str]:
    """Our names of the target's linear / expert modules (2-D+ weights outside embeddings)."""
    out = set()
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not name.startswith("mtp.") and "embed" not in name:
            out.add(name.rpartition(".")[0])
    return sorted(out)


def open_prequantized(reader, n_layers: int, model: nn.Module
                      ) -> tuple[object, PrequantInfo | None]:
    """(reader to load from, PrequantInfo or None) for `reader`'s checkpoint; `model` is the
    (meta-device) model being loaded, for the exclusion checks."""
    qcfg = detect_quant_config(reader.path, reader.config, reader.keys())
    if qcfg is None:
        return reader, None
    if qcfg.method == "ct_int":  # GGUF blocks: the loader's block path, not this one
        from specdeploy.checkpoint.ct_int import IntReader

        return IntReader(reader, qcfg), None
    if qcfg.method == "mxfp4":  # exact in fp32 / bf16: the plain model, nothing to swap in
        from specdeploy.checkpoint.mxfp4 import Mxfp4Reader

        return Mxfp4Reader(reader, qcfg), None
    ckpt_modules = sorted({k.rpartition(".")[0] for k in reader.keys()})
    excl = map_exclusions(qcfg.exclude, ckpt_modules, n_layers, _quantizable_modules(model))
    info = PrequantInfo(qcfg, excl, kv_scales=_kv_scales(reader) if qcfg.kv_cache else {})
    return QuantizedReader(reader, qcfg), info


def _kv_scales(reader) -> dict[str, tuple[float, float]]:
    """ModelOpt's per-layer FP8 KV scales (`<attn>.k_proj.k_scale`, `<attn>.v_proj.v_scale`, or
    directly `<attn>.k_scale`) by our attention module name; a layer without them uses 1.0."""
    out: dict[str, list[float]] = {}
    for key in reader.keys():
        for i, leaf in enumerate((".k_scale", ".v_scale")):
            if key.endswith(leaf):
                mod = key[: -len(leaf)]
                for sub in (".k_proj", ".v_proj", ".attn"):
                    mod = mod[: -len(sub)] if mod.endswith(sub) else mod
                ours = target_module_name(mod)
                out.setdefault(ours, [1.0, 1.0])[i] = float(reader.get(key).float().max())
    return {m: (k, v) for m, (k, v) in out.items()}


def prequant_kv_dtype(model: nn.Module) -> torch.dtype | None:
    """float8_e4m3fn when the model's checkpoint declares an FP8 KV cache, else None."""
    info = getattr(model, "prequant", None)
    return torch.float8_e4m3fn if info is not None and info.config.kv_cache == "FP8" else None


def attach(model: nn.Module, info: PrequantInfo) -> None:
    """Give the model its quantized weights; check them against the checkpoint's exclusions
    (a weight both quantized and excluded contradicts the config); record what was excluded."""
    for name in info.weights:
        ours = name.rpartition(".")[0]
        why = info.exclusions.why(_deploy_name(ours))
        if why is not None:
            raise CheckpointError(f"{name}: quantized in the checkpoint, but its "
                                  f"exclude_modules glob {why} excludes it")
    for mod in _quantizable_modules(model) + _mtp_modules(model):
        why = info.exclusions.why(_deploy_name(mod))
        if why is not None:
            info.excluded[_deploy_name(mod)] = why
    model.prequant = info
    model.prequant_weights = dict(info.weights)
    model.prequant_input_scales = dict(info.input_scales)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # the drafter graph (DraftStep.eagle_drafter) finds its own here
        mtp.prequant_weights = {n[4:]: w for n, w in info.weights.items() if n.startswith("mtp.")}
        mtp.prequant_input_scales = {n[4:]: s for n, s in info.input_scales.items()
                                     if n.startswith("mtp.")}


def _mtp_modules(model: nn.Module) -> list[str]:
    return sorted({n.rpartition(".")[0] for n, p in model.named_parameters()
                   if n.startswith("mtp.") and p.dim() >= 2})


def _deploy_name(name: str) -> str:
    """Our parameter-module name in the deployment: `mtp.X` lives at `eagle_drafter.X`."""
    return DRAFTER_ROOT + name[3:] if name == "mtp" or name.startswith("mtp.") else name
