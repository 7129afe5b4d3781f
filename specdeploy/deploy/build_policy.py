"""What `build` decides from its options and the checkpoint where the user left it to it (deploy/
build.py): lazy per-rank loading, the KV dtype and the drafter's quantization under "auto", and
whether GGUF blocks may load without their fp32 values."""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.deploy.options import BuildOptions


def per_rank_loading(opts: BuildOptions, model: nn.Module | None, model_path=None):
    """A sharded CPU build loads lazily: each rank reads only what it keeps (checkpoint/lazy)."""
    from specdeploy.checkpoint.lazy import LazyWeights

    d = opts.dist
    if model is not None or d is None or d.world_size == 1 or opts.device.type != "cpu" or \
            "shard" in opts.disabled or prequantized(model_path):
        return None
    return LazyWeights()


def prequantized(path) -> bool:
    """A pre-quantized (FP8 / NVFP4) checkpoint. NOTE: it loads whole on every rank: its
    quantized tensors are recorded as the loader reads each weight (checkpoint/prequant.py),
    which lazy loading would defer past `attach`; the shard transform then slices them."""
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.checkpoint.quant_config import detect_quant_config
    from specdeploy.default_model import default_model_path

    reader = open_checkpoint(default_model_path() if path is None else path)
    return detect_quant_config(reader.path, reader.config, reader.keys()) is not None


def kv_dtype(opts: BuildOptions, dtype: torch.dtype, model: nn.Module | None = None
              ) -> torch.dtype | None:
    """The target's KV dtype (None: the model dtype); see BuildOptions.kv_cache_dtype. "auto"
    is bf16 where the fast kernels run a GGUF model's blocks on the CPU (that path is already
    llama.cpp's model, 8-bit activations; llama.cpp keeps an f16 KV), else the model dtype:
    `kernels="fast"` is LLM()'s default and leaves every other checkpoint's numerics alone."""
    if opts.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if opts.kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if opts.kv_cache_dtype != "auto":
        return getattr(torch, opts.kv_cache_dtype)
    fast_cpu = opts.kernels == "fast" and opts.device.type == "cpu" and dtype == torch.float32
    # (a bf16 / fp16 checkpoint's own values as blocks are the fp32 model: it keeps its dtype)
    has_blocks = bool(getattr(model, "ggml_weights", None)) and not getattr(
        model, "half_blocks", False) if model is not None else True
    return torch.bfloat16 if fast_cpu and has_blocks else None


def draft_quantize_auto(opts: BuildOptions, dtype: torch.dtype, model_path=None) -> str | None:
    """SpecConfig's draft_quantize="auto": "q8_0" where the fast kernels run on an fp32 CPU
    deployment (one process, not compiled) with an fp32 drafter, whatever the target's format
    (a draft forward there is bound by reading the drafter's weights and its Python: Q8_0
    blocks on the integer-dot kernels read 4x fewer bytes than fp32), else None (the target's
    precision). Measured on the default model (GGUF), 2 cores AVX2, EAGLE-3 K=3 fixed: 70
    tokens/s with the fp32 drafter, 103 with Q8_0 (plain ~140); on hybrid-demo (fp32
    safetensors; bench/spec_controller.py --model hybrid-demo --methods mtp --k 3 --fixed 1
    --rounds 2, 2 cores AVX-512, 2026-12-06) MTP K=1 / K=3 / controller 1.10 / 1.08 / 1.05x
    plain with the fp32 drafter, 1.15 / 1.18 / 1.13x with Q8_0. Lossless either way: the
    target verifies every draft in its own precision. Not for a pre-quantized checkpoint
    (ModelOpt / FP8): it ships its drafter unquantized on purpose (its exclusions), as is."""
    fast_cpu = opts.kernels == "fast" and opts.device.type == "cpu" and dtype == torch.float32
    fp32_drafter = opts.spec.draft_dtype in (None, "float32")
    # NOTE: one process, not compiled: the paths the Q8_0 drafter has been tested on
    alone = (opts.dist is None or opts.dist.world_size == 1) and not opts.compile
    return "q8_0" if fast_cpu and fp32_drafter and alone and opts.quantize is None and \
        not prequantized(model_path) else None


def defer_blocks(opts: BuildOptions) -> bool:
    """Whether GGUF block-quantized weights may load without their fp32 values: where
    `ggml_linears` will run and read only the blocks (deploy/deferred.py). Not with quantize
    or sharding. A drafter reads the target's placeholders through its own graph (the same
    passes: on the blocks, or filled) or filled first where it copies them (deploy/spec.py
    prepare_drafter). The loader checks the last condition, that the block kernel is built."""
    return (opts.device.type == "cpu" and not opts.compile and opts.quantize is None
            and (opts.dist is None or opts.dist.world_size == 1)
            and "ggml_linears" not in opts.disabled)
