"""`load_model` / `load_tokenizer`: a checkpoint path in, a plain model (or tokenizer) out."""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from specdeploy.checkpoint import CheckpointError, CheckpointReader, open_checkpoint
from specdeploy.checkpoint.lazy import LazyWeights
from specdeploy.checkpoint.prequant import attach as attach_prequant
from specdeploy.checkpoint.prequant import open_prequantized
from specdeploy.checkpoint.reader import RowSlice
from specdeploy.models.registry import module_for_config
from specdeploy.ops.ggml_linear import (
    HALF_KINDS,
    KINDS,
    iq1_m_scales,
    kernel_unavailable,
    nonfinite_values,
    scale_bytes,
)

SKIP_FINITE_ENV = "SPECDEPLOY_SKIP_FINITE_CHECK"  # =1: skip the NaN/inf scan (huge checkpoints)
# =0: a bf16 / fp16 safetensors checkpoint loads as fp32 copies (not its 16-bit values as blocks)
HALF_BLOCKS_ENV = "SPECDEPLOY_HALF_BLOCKS"
# vLLM's spellings too: half = float16, float = float32
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, hf_config: dict | None = None,
                  device: torch.device | str | None = None) -> torch.dtype:
    """`auto` means float32 on the CPU (bf16 matmuls are slower there) and bfloat16 on CUDA
    (what the released checkpoints ship in, and what tensor cores want)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unsupported {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def assign_params(
    model: nn.Module, params: dict[str, Callable[[], torch.Tensor]], dtype: torch.dtype,
    source: str = "checkpoint", check_finite: bool | None = None, progress: bool = False,
    lazy: LazyWeights | None = None,
) -> None:
    """Materialize `model` (built on the meta device) from lazy tensors, one tensor at a time.

    Errors name the missing tensors, the mismatching tensor with both shapes, or a floating
    tensor with NaN/inf values once cast (a corrupt file, or an overflow in the cast): such a
    model would answer garbage, never an error. `check_finite` None = on unless
    $SPECDEPLOY_SKIP_FINITE_CHECK=1 (one extra pass over the weights). `progress`: a tqdm bar
    over the tensors (a big checkpoint takes minutes). `lazy`: nothing is read yet; each
    parameter becomes a placeholder that the `shard` transform reads its rank's slice of
    (checkpoint/lazy.py), with the same checks then.
    """
    if check_finite is None:
        check_finite = os.environ.get(SKIP_FINITE_ENV) != "1"
    expected = dict(model.named_parameters())
    expected.update(_persistent_buffers(model))
    missing = [n for n in expected if n not in params and expected[n].is_meta]
    if missing:
        more = f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""
        shown = ", ".join(missing[:12]) + more
        raise CheckpointError(f"{source}: missing tensors for {len(missing)} parameters: {shown}")
    items = params.items()
    if progress:
        from tqdm import tqdm

        items = tqdm(items, total=len(params), desc="loading tensors", unit="tensor",
                     dynamic_ncols=True)
    for name, thunk in items:
        if name not in expected:
            continue  # e.g. MTP weights when the MTP head is not built
        want = expected[name]
        to = dtype if want.dtype.is_floating_point else want.dtype

        def load(name=name, thunk=thunk, shape=tuple(want.shape), to=to):
            return _checked(name, thunk(), shape, to, source, check_finite)

        t = load() if lazy is None else lazy.placeholder(name, want.shape, to, load)
        _set_tensor(model, name, t, is_param=isinstance(want, nn.Parameter))


def _dropped_leading_ones(got: tuple, want: tuple) -> bool:
    """Whether `want` is `got` with size-1 dims in front."""
    extra = len(want) - len(got)
    return extra > 0 and want[extra:] == got and all(d == 1 for d in want[:extra])


def _checked(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, source: str,
             check_finite: bool) -> torch.Tensor:
    if tuple(t.shape) != shape and _dropped_leading_ones(tuple(t.shape), shape):
        # NOTE: llama.cpp's tools write a tensor with ggml_n_dims dims, its trailing size-1
        # dims dropped (in HF order: leading): a file re-quantized by llama-quantize (the
        # published Q4_K_M ones) stores Qwen3.5-MoE's shared_expert_gate [1, H] as [H]
        t = t.reshape(shape)
    if tuple(t.shape) != shape:
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(t.shape)}, model expects {shape}")
    t = t.to(dtype)
    if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(
            f"{source}: tensor {name!r} has non-finite values (NaN or inf) as {t.dtype}; "
            f"set {SKIP_FINITE_ENV}=1 to load it anyway")
    return t


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a checkpoint stores; computed ones (rotary inv_freq) are rebuilt by init_buffers."""
    out = {}
    for mod_name, mod in model.named_modules():
        for leaf, buf in mod._buffers.items():
            if buf is not None and leaf not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{leaf}" if mod_name else leaf] = buf
    return out


def _set_tensor(model: nn.Module, name: str, t: torch.Tensor, is_param: bool) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if is_param:
        setattr(mod, leaf, nn.Parameter(t, requires_grad=False))
    else:
        mod._buffers[leaf] = t


def load_model(
    path: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
    with_mtp: bool = False, progress: bool = False, lazy: LazyWeights | None = None,
    defer_blocks: bool = False,
) -> nn.Module:
    """Load a plain model from a HF directory or a `.gguf` file; `None` = the default model.

    Returns the family's `Model` in eval mode; `model(input_ids[B,T])` gives logits [B,T,V].
    `lazy`: placeholders for every weight, read later (per-rank loading, checkpoint/lazy.py).
    `defer_blocks`: see `load_model_from_reader`.
    """
    if path is None:
        from specdeploy.default_model import default_model_path

        path = default_model_path()
    reader = open_checkpoint(path)
    return load_model_from_reader(reader, dtype, with_mtp=with_mtp, progress=progress,
                                  lazy=lazy, defer_blocks=defer_blocks)


def refuse_mmproj(reader) -> None:
    """An mmproj GGUF given as the model: it is the text GGUF's vision tower."""
    if getattr(reader, "is_mmproj", False):
        raise CheckpointError(f"{reader.path}: an mmproj file (a vision tower) is not a model: "
                              f"deploy the text GGUF with mmproj={str(reader.path)!r}")


def load_model_from_reader(
    reader: CheckpointReader, dtype: str | torch.dtype = "auto", with_mtp: bool = False,
    progress: bool = False, lazy: LazyWeights | None = None, defer_blocks: bool = False,
) -> nn.Module:
    """`defer_blocks` (fp32 GGUF loads only; `build` asks for it where the `ggml_linears`
    transform computes with the blocks): block-quantized weights are never dequantized here but
    left as zero placeholders that take no memory, listed in `model.ggml_deferred`; whatever
    still reads one after the pipeline gets it filled from the blocks (deploy/deferred.py). The
    eager model itself is then not usable as it is."""
    refuse_mmproj(reader)
    fam = module_for_config(reader.config)
    cfg = fam.Config.from_hf(reader.config)
    torch_dtype = resolve_dtype(dtype, reader.config)
    with torch.device("meta"):
        model = fam.Model(cfg, with_mtp=with_mtp) if with_mtp else fam.Model(cfg)
    # NOTE: a pre-quantized checkpoint reads its weights dequantized (with their scales, never
    # without) and keeps the quantized tensors for the deploy pass (checkpoint/prequant.py)
    reader, prequant = open_prequantized(reader, _num_layers(reader.config), model)
    params = fam.checkpoint_to_params(reader, cfg, with_mtp=with_mtp) if with_mtp else \
        fam.checkpoint_to_params(reader, cfg)
    if prequant is not None:
        params = reader.wrap_params(params, prequant)
    # GGUF Q4_0 / Q4_1 / Q8_0 / MXFP4 / K-quant weights also keep their blocks: the deploy
    # pipeline's CPU kernels compute with them (deploy/passes/ggml_linears.py); only for fp32
    # loads, whose values they match exactly. Per-rank loading too: the kernels find blocks by
    # the loaded tensor, and the shard transform cuts a weight's blocks with its slice
    # (deploy/shard_slice.py)
    blocks = _ggml_weights(model, reader, params) if torch_dtype == torch.float32 else {}
    deferred, half = {}, False
    if (defer_blocks and not blocks and torch_dtype == torch.float32 and prequant is None
            and lazy is None and os.environ.get(HALF_BLOCKS_ENV) != "0"
            and kernel_unavailable() is None):
        blocks = half_weights(model, params)
        half = bool(blocks)
    # NOTE: the kernel is asked for only when there are blocks (no warning for other formats)
    if defer_blocks and prequant is None and blocks and kernel_unavailable() is None:
        deferred = _defer_blocks(model, blocks, params, reader.path)
    assign_params(model, params, torch_dtype, source=str(reader.path), progress=progress,
                  lazy=lazy)
    _init_nonpersistent(model)
    if prequant is not None:
        attach_prequant(model, prequant)
    model.hf_config = reader.config  # NOTE: the raw dict; deployment reads eos / limits from it
    model.ggml_weights, model.ggml_deferred = blocks, deferred
    model.half_blocks = half  # (a bf16 / fp16 checkpoint's values as they are stored: the fp32
    # model, so deploy/build_policy.kv_dtype keeps its fp32 KV)
    return model.eval()


def half_weights(model: nn.Module, params: dict) -> dict:
    """param name -> F16 / BF16 blocks (ggml_linear's "f16" / "bf16" kinds: the stored 16-bit
    values, rows of 32) for the matrices [N, K] and stacked experts [E, N, K] of a bf16 / fp16
    checkpoint loaded as fp32 on the CPU: the fp32 model exactly (each value widened exactly) at
    half the memory, and a decode step reads half the bytes. Taken from each parameter's
    loaded value (after its family's transforms), so nothing is bypassed; values read here
    stay for assign_params (`params` updated), others are not read twice. A parameter no block
    kernel reads after the pipeline is filled from these (deploy/deferred.py)."""
    from specdeploy.ops.ggml_linear import make_weight

    out = {}
    for name, p in model.named_parameters():
        if p.dim() not in (2, 3) or name not in params or p.shape[-1] % 32:
            continue
        t = params[name]()
        kind = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(t.dtype)
        if kind is not None and tuple(t.shape) == tuple(p.shape):
            # NOTE: a copy: safetensors' tensors are views of the file's mapping, and one kept
            # would keep every page of it that loading touched resident (a MoE's experts,
            # copied when stacked, twice: as blocks and as file pages)
            t = t.clone(memory_format=torch.contiguous_format)
            out[name] = make_weight(kind, t.view(torch.uint8).view(*t.shape[:-1], -1),
                                    tuple(t.shape))
        else:
            params[name] = lambda t=t: t  # NOTE: read once (assign_params checks and casts it)
    return out


def _defer_blocks(model: nn.Module, blocks: dict, params: dict, source
                  ) -> dict[str, torch.Tensor]:
    """Placeholders for the parameters with `blocks` (taken out of `params`); their blocks'
    fp16 scales are checked finite, as assign_params checks loaded values."""
    out, aliases = {}, {}
    for alias, p in model.named_parameters(remove_duplicate=False):  # tied heads: every name
        aliases.setdefault(id(p), []).append(alias)
    params_of = dict(model.named_parameters())
    for name, w in blocks.items():
        if name not in params:
            continue
        where = scale_bytes(w.kind)  # (None: MXFP4's E8M0 scales, all finite; IQ1_M's d)
        per_block = w.blocks.view(w.shape[0], -1, KINDS[w.kind][1])
        scales = (iq1_m_scales(per_block) if w.kind == "iq1_m" else None if where is None
                  else per_block[..., where])
        if w.kind in HALF_KINDS and nonfinite_values(w):
            raise CheckpointError(f"{source}: tensor {name!r} has non-finite values (NaN or "
                                  f"inf) as {w.kind}")
        if scales is not None and not bool(
                torch.isfinite(scales.contiguous().view(torch.float16)).all()):
            raise CheckpointError(f"{source}: tensor {name!r} has non-finite block scales")
        out[name] = placeholder(w.shape)
        p = nn.Parameter(out[name], requires_grad=False)
        for alias in aliases[id(params_of[name])]:
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, p)
        del params[name]
    return out


def placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 zeros of `shape` over fresh anonymous memory: no page is resident until written."""
    from specdeploy.cache.handlers import lazy_zeros

    return lazy_zeros(shape, torch.float32, "cpu")


def _num_layers(hf: dict) -> int:
    return int(hf.get("text_config", hf).get("num_hidden_layers") or 0)


def _ggml_weights(model: nn.Module, reader, params: dict) -> dict:
    """param name -> GGMLWeight for the parameters whose checkpoint tensors have GGUF blocks:
    looked up by the key its loader reads (`from_keys`; else the parameter's own name), stacked
    experts from one tensor or from one per expert (rows joined: gate then up)."""
    get_blocks = getattr(reader, "get_blocks", None)
    if get_blocks is None:
        return {}
    out = {}
    for name, p in model.named_parameters():
        if p.dim() not in (2, 3):
            continue
        src = getattr(params.get(name), "source", name)
        if isinstance(src, RowSlice):
            w = _row_blocks(get_blocks(src.key), src.start, src.stop)
        else:
            w = get_blocks(src) if isinstance(src, str) else _expert_blocks(get_blocks, src)
        if w is not None and w.shape == tuple(p.shape):
            out[name] = w
    return out


def _row_blocks(w, start: int, stop: int):
    """Rows start..stop-1 of a 2-D weight's blocks (blocks never straddle a row), or None."""
    from specdeploy.ops.ggml_linear import GGMLWeight

    if w is None or len(w.shape) != 2 or not 0 <= start < stop <= w.shape[0]:
        return None
    return GGMLWeight(w.kind, w.blocks[start:stop], (stop - start, w.shape[1]), w.gather)


def _expert_blocks(get_blocks, rows: list[list[str]]):
    """Stacked [E, N, K] blocks from per-expert tensors (each expert's keys' rows joined), or
    None unless every one has blocks of one kind and shape."""
    from specdeploy.ops.ggml_linear import concat_rows, make_weight

    per = []
    for keys in rows:
        ws = [get_blocks(k) for k in keys]
        if any(w is None for w in ws):
            return None
        try:
            per.append(ws[0] if len(ws) == 1 else concat_rows(ws))
        except ValueError:  # mixed kinds / widths: no one block layout
            return None
    if len({(w.kind, w.shape) for w in per}) != 1:
        return None
    return make_weight(per[0].kind, torch.stack([w.blocks for w in per]),
                       (len(per), *per[0].shape))


def _init_nonpersistent(model: nn.Module) -> None:
    """Buffers that are computed, not stored (e.g. rotary inv_freq), are rebuilt on the CPU."""
    hook = getattr(model, "init_buffers", None)
    if hook is not None:
        hook()
