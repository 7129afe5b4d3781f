"""`BuildOptions`: everything `build` (deploy/build.py) takes besides the model, checked where it
is made, so that a bad option fails before anything loads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.cache.plan import check_budget
from specdeploy.config import SpecConfig
from specdeploy.deploy.passes.ggml_weights import KERNELS
from specdeploy.distributed.config import DistConfig

BACKENDS = ("graph", "eager")
QUANTIZE_METHODS = (None, "int8")
# "fp8" / "fp8_e4m3": float8_e4m3fn at scale 1.0, "fp8_e5m2": float8_e5m2 (vLLM's names; a
# checkpoint's own k/v scales are used where it declares an FP8 KV cache)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class BuildOptions:
    """How to deploy. `quantize="int8"` makes linear weights int8 (weight-only);
    `quant_exclude` replaces the default exclusion globs of the target (deploy/passes/quantize);
    `disabled` names transforms to skip (A/B runs); `vision` (None: whenever the checkpoint has
    a vision tower) deploys a vision-language target (deploy/vlm.py); `dist` the rank this
    process builds (the `shard` transform slices the target and the drafter alike; None: one
    process). `page_size` None: 16 tokens for attention-only targets, the scan chunk (64 for
    Mamba2 / gated delta) for targets with recurrent layers (`cache.plan.default_page_size`).
    `enable_prefix_caching` (vLLM's name): cached KV pages are shared by prompts that start
    alike, and recurrent layers get a checkpoint pool with a checkpoint every
    `checkpoint_every` pages (None: every page when memory allows; cache/plan.py). `mmproj`: the
    vision tower of a text GGUF, llama.cpp's mmproj GGUF (checkpoint/gguf_mmproj.py; Gemma 3's:
    gguf_mmproj_gemma3.py);
    `mm_processor_kwargs` (vLLM's): the image processor's `min_pixels` / `max_pixels`;
    `mm_encoder_dtype` the vision tower's dtype ("auto": deploy/vlm.py `tower_dtype`);
    `limit_mm_per_prompt` (vLLM's): at most this many images / videos in one prompt."""

    dtype: str | torch.dtype = "auto"
    max_batch_size: int = 16
    max_seq_len: int = 2048
    page_size: int | None = None  # None: per architecture (see above)
    max_cache_gib: float | None = None
    # the fraction of the device's total memory this instance may hold (vLLM's knob; exclusive
    # with max_cache_gib; cache/plan.py `cache_budget`)
    gpu_memory_utilization: float | None = None
    spec: SpecConfig | None = None
    compile: bool = False
    quantize: str | None = None
    quant_exclude: tuple[str, ...] | None = None
    disabled: frozenset[str] = frozenset()
    backend: str = "graph"
    device: str | torch.device = "cpu"
    vision: bool | None = None
    kernels: str = "exact"  # GGUF-block linears: "exact" (the fp32 model) or "fast" (int-dot)
    # the target's paged KV: "auto" = bfloat16 with kernels="fast" on an fp32 CPU deployment
    # (attention reads it back exactly as fp32), else the model dtype (the exact path: fp32)
    kv_cache_dtype: str = "auto"
    dist: DistConfig | None = None
    enable_prefix_caching: bool = True
    checkpoint_every: int | None = None  # None: every page when memory allows (cache/plan.py)
    progress: bool = False  # a tqdm bar while the checkpoint's tensors load
    mmproj: str | None = None
    mm_processor_kwargs: dict | None = None
    mm_encoder_dtype: str = "auto"  # the vision tower's (deploy/vlm.py `tower_dtype`)
    limit_mm_per_prompt: dict | None = None  # {"image": N, "video": M}; None: no limit

    def __post_init__(self):
        for name in ("max_batch_size", "max_seq_len", "page_size", "checkpoint_every"):
            v = getattr(self, name)
            if v is None and name in ("page_size", "checkpoint_every"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")
        check_budget(self.max_cache_gib, self.gpu_memory_utilization)
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels: one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.quantize not in QUANTIZE_METHODS:
            raise ValueError(f"quantize: must be None or 'int8', got {self.quantize!r}")
        if self.mm_processor_kwargs is not None:
            from specdeploy.vision.image import check_processor_kwargs

            check_processor_kwargs(self.mm_processor_kwargs)
        if self.limit_mm_per_prompt is not None:
            check_mm_limits(self.limit_mm_per_prompt)
        if self.mm_encoder_dtype != "auto":
            from specdeploy.loading import resolve_dtype

            try:
                resolve_dtype(self.mm_encoder_dtype)
            except ValueError as e:
                raise ValueError(f"mm_encoder_{e}") from None
        if self.mmproj is not None and self.vision is False:
            raise ValueError("mmproj: given with vision=False")
        if isinstance(self.spec, dict):
            object.__setattr__(self, "spec", SpecConfig.from_dict(self.spec))
        if self.backend != "graph" and (self.quantize or self.compile or self.spec or (
                self.dist and self.dist.world_size > 1)):
            raise ValueError("backend: quantize, compile, spec and tensor parallelism need the "
                             "graph backend")
        object.__setattr__(self, "disabled", frozenset(self.disabled))
        object.__setattr__(self, "device", _device(self.device))
        if self.backend != "graph" and self.device.type != "cpu":
            raise ValueError(f"device: the eager reference runner is CPU-only, got {self.device}")
        if self.quant_exclude is not None:
            object.__setattr__(self, "quant_exclude", tuple(self.quant_exclude))


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but this torch sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but only {torch.cuda.device_count()} CUDA "
                             "devices are visible")
    elif dev.type != "cpu":
        raise ValueError(f"device: {device!r}; supported: cpu, cuda, cuda:N")
    return dev


MM_MODALITIES = ("image", "video")


def check_mm_limits(limits) -> None:
    """`limit_mm_per_prompt`: {"image": N, "video": M}, non-negative integers."""
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt: must be a dict, got {type(limits).__name__}")
    for k, v in limits.items():
        if k not in MM_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: {k!r} is not a modality here; supported: "
                             f"{', '.join(MM_MODALITIES)}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"limit_mm_per_prompt: {k} must be a non-negative integer, got "
                             f"{v!r}")
