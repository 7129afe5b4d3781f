"""compressed-tensors checkpoints (llm-compressor's output; vLLM's `quant_method:
"compressed-tensors"`): the FP8 and NVFP4 layouts, read as the same weights as ModelOpt's.

config.json `quantization_config`: {"quant_method": "compressed-tensors", "format",
"quantization_status": "compressed", "config_groups": {name: {"targets", "weights",
"input_activations", "format"?}}, "ignore": [module names, or "re:<regex>" matched from the
start of the name], "kv_cache_scheme"}. Per quantized linear `X`:
- `float-quantized` FP8 (weights {num_bits 8, type float, symmetric}): `X.weight` float8_e4m3fn
  [N, K], `X.weight_scale` by strategy: "tensor" [1], "channel" [N, 1], "group" [N, K / g],
  "block" [ceil(N / bn), ceil(K / bk)] (block_structure [bn, bk]); w = weight * scale. Static
  activations (input_activations dynamic false, strategy tensor): `X.input_scale`; dynamic ones
  (per token / group) run weight-only here, as HF's dynamic FP8 does (no FP8 units).
- `nvfp4-pack-quantized` (weights {num_bits 4, type float, strategy tensor_group, group_size
  16}): `X.weight_packed` uint8 [N, K / 2] (E2M1 codes, the low nibble first),
  `X.weight_scale` float8_e4m3fn [N, K / 16], `X.weight_global_scale` fp32 [1];
  w = E2M1 * weight_scale / weight_global_scale (ModelOpt's weight_scale_2 is 1 / global).
- `kv_cache_scheme` {num_bits 8, type float, strategy tensor}: an FP8 KV cache with per-layer
  `self_attn.k_scale` / `v_scale`.
- integer weights (type int, symmetric, strategy group or channel): `pack-quantized` 4 or 8
  bits without activation quantization (W4A16, W8A16), `int-quantized` 8 bits with dynamic
  int8 activations (W8A8, run weight-only): checkpoint/ct_int.py, as GGUF Q4_0 / Q8_0 blocks.
`naive-quantized`, MX formats, static integer activations, asymmetric or group-reordered
(`actorder: group`, a `g_idx`) weights and mixed groups are refused by name.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from specdeploy.checkpoint.reader import CheckpointError

FORMATS = ("float-quantized", "nvfp4-pack-quantized", "pack-quantized", "int-quantized")
_FP8_STRATEGIES = ("tensor", "channel", "group", "block")


def parse(qc: dict, where: str, keys: Iterable[str], unsupported, make):
    """The QuantConfig (`make(**fields)`) of a compressed-tensors `quantization_config`;
    `unsupported(where, what)` builds the refusal naming what is not supported."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise unsupported(where, f"compressed-tensors with quantization_status {status!r} "
                          "(only 'compressed': weights stored quantized)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: config_groups must be a non-empty object")
    kinds = {_group_kind(name, g, qc.get("format"), where, unsupported)
             for name, g in groups.items()}
    if len(kinds) != 1:
        raise unsupported(where, f"compressed-tensors with mixed schemes {sorted(kinds)}")
    kind = kinds.pop()
    kv = _kv_scheme(qc.get("kv_cache_scheme"), where, unsupported)
    exclude = _ignored_modules(qc.get("ignore") or [], keys, where)
    if kind[0] == "nvfp4":
        return make(method="ct_nvfp4", exclude=exclude, group_size=16, kv_cache=kv)
    if kind[0] == "int":
        _, bits, group, packed = kind
        return make(method="ct_int", exclude=exclude, group_size=group, kv_cache=kv, bits=bits,
                    packed=packed)
    _, strategy, block, static = kind
    return make(method="ct_fp8", exclude=exclude, strategy=strategy, kv_cache=kv,
                block_size=block, static_activations=static)


def _group_kind(name: str, g: dict, top_format, where: str, unsupported) -> tuple:
    at = f"{where} config_groups.{name}"
    if not isinstance(g, dict):
        raise CheckpointError(f"{at}: expected an object")
    fmt = g.get("format") or top_format
    w, a = g.get("weights"), g.get("input_activations")
    if g.get("output_activations"):
        raise unsupported(at, "compressed-tensors with output_activations")
    if not isinstance(w, dict):
        raise unsupported(at, "compressed-tensors without weight quantization")
    if fmt not in FORMATS:
        what = "integer weights" if w.get("type") == "int" else "weights"
        raise unsupported(at, f"compressed-tensors format {fmt!r} ({what} {w.get('num_bits')}"
                          f"-bit; supported: {', '.join(FORMATS)})")
    if w.get("symmetric") is False:
        raise unsupported(at, "compressed-tensors with asymmetric weights (zero points)")
    if w.get("actorder") not in (None, "static", "weight"):  # "group": columns permuted
        raise unsupported(at, f"compressed-tensors with actorder {w.get('actorder')!r}")
    if fmt in ("pack-quantized", "int-quantized"):
        return _int(fmt, w, a, at, unsupported)
    if w.get("type") != "float":
        raise unsupported(at, f"compressed-tensors {fmt} with weight type {w.get('type')!r}")
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if fmt == "nvfp4-pack-quantized":
        if bits != 4 or strategy != "tensor_group" or w.get("group_size") != 16:
            raise unsupported(at, f"compressed-tensors {fmt} with weights {bits}-bit "
                              f"{strategy!r} group {w.get('group_size')!r} (only 4-bit "
                              "tensor_group 16)")
        return ("nvfp4",)
    if bits != 8 or strategy not in _FP8_STRATEGIES:
        raise unsupported(at, f"compressed-tensors FP8 with weights {bits}-bit strategy "
                          f"{strategy!r} (supported: 8-bit {', '.join(_FP8_STRATEGIES)})")
    block = (1, 1)
    if strategy == "block":
        b = w.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0
                                                            for x in b)):
            raise CheckpointError(f"{at}: block_structure must be two positive ints, got {b!r}")
        block = (b[0], b[1])
    elif strategy == "group":
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0:
            raise CheckpointError(f"{at}: group_size must be a positive int, got {gs!r}")
        block = (1, gs)
    static = False
    if a is not None:
        if a.get("num_bits") != 8 or a.get("type") != "float":
            raise unsupported(at, f"compressed-tensors FP8 with {a.get('num_bits')}-bit "
                              f"{a.get('type')} activations")
        static = a.get("dynamic") is False
        if static and a.get("strategy") != "tensor":
            raise unsupported(at, f"compressed-tensors static activations by "
                              f"{a.get('strategy')!r} (only per tensor)")
    return ("fp8", strategy, block, static)


def _int(fmt: str, w: dict, a, at: str, unsupported) -> tuple:
    bits, strategy, gs = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    allowed = (4, 8) if fmt == "pack-quantized" else (8,)
    if w.get("type") != "int" or bits not in allowed or strategy not in ("group", "channel"):
        raise unsupported(at, f"compressed-tensors {fmt} with {bits}-bit {w.get('type')} "
                          f"weights by {strategy!r} (only int{'4 or 8' if len(allowed) > 1 else 8}"
                          " by group or channel)")
    if fmt == "pack-quantized" and a is not None:
        raise unsupported(at, "compressed-tensors pack-quantized with quantized activations")
    if fmt == "int-quantized" and a is not None and (
            a.get("type") != "int" or a.get("num_bits") != 8 or a.get("dynamic") is not True):
        raise unsupported(at, "compressed-tensors int-quantized with static or non-int8 "
                          "activations (only dynamic int8)")
    if strategy == "group" and (not isinstance(gs, int) or gs <= 0):
        raise CheckpointError(f"{at}: group_size must be a positive int, got {gs!r}")
    return ("int", bits, gs if strategy == "group" else 0, fmt == "pack-quantized")


def _kv_scheme(kv, where: str, unsupported) -> str | None:
    if kv is None:
        return None
    if not isinstance(kv, dict) or kv.get("num_bits") != 8 or kv.get("type") != "float" \
            or kv.get("strategy", "tensor") != "tensor":
        raise unsupported(where, f"compressed-tensors kv_cache_scheme {kv!r} (only 8-bit float "
                          "per tensor)")
    return "FP8"


def _ignored_modules(ignore, keys: Iterable[str], where: str) -> tuple[str, ...]:
    """The checkpoint's module names `ignore` names (exact names; "re:" patterns matched from
    the start, as compressed-tensors does), as exclusion globs: a name has no glob characters."""
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise CheckpointError(f"{where}: ignore must be a list of strings, got {ignore!r}")
    modules = sorted({k.rpartition(".")[0] for k in keys})
    out = set()
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                pat = re.compile(entry[3:])
            except re.error as e:
                raise CheckpointError(f"{where}: ignore entry {entry!r}: {e}") from None
            out.update(m for m in modules if pat.match(m))
        else:
            out.add(entry)
    return tuple(sorted(g for g in out if not any(c in g for c in "*?[")))
