"""Vision-language targets: the exported language model inside an eager wrapper.

The language model (and an MTP drafter) are exported and transformed exactly as text models are
(deploy/build.py); two things differ at export: positions are [3, 1, T] (multimodal RoPE) and
the target takes its input embeddings (`TextFromEmbeds`), so the wrapper can put image features
at the image tokens. `VisionLanguageDeployed` is what the engine sees as the target: per step it
embeds the ids, runs the vision tower (eagerly: shapes change with every image and it runs once
per request, so a graph would buy nothing) for requests whose first image tokens arrive, merges
the rows of the image tokens each chunk feeds, and hands the rest to the graph. Keyword arguments
are split that way: pixels and grids to the tower, ids / positions / cache metadata to the graph.
Everything else (drafting, commit, layout) is the inner deployment's.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdeploy.cache.metadata import BatchMetadata
from specdeploy.deploy.base import StepOutput
from specdeploy.models.qwen3_5_vision import VisionConfig, VisionModel

VISION_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                        "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                        "Gemma3ForConditionalGeneration")


class TextFromEmbeds(nn.Module):
    """The exported target of a VLM: (ids (unused), positions[3,1,T], embeds[1,T,W]) → logits;
    W = H, or (1 + levels) * H with DeepStack (models/qwen3_vl.py: the token's embedding, then
    each level's feature)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, position_ids, hidden):
        return self.inner(None, position_ids, hidden)


def has_vision(hf_config: dict) -> bool:
    return (bool(set(hf_config.get("architectures") or ()) & set(VISION_ARCHITECTURES))
            and "vision_config" in hf_config)


VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>"}


def gguf_vlm_config(cfg: dict, model_path, mmproj) -> dict:
    """The VLM config of a text GGUF and its mmproj (checkpoint/gguf_mmproj.py), laid out as the
    released checkpoint's config.json: the text config nested, the tower's from the mmproj's
    metadata, the vision token ids from the GGUF's vocabulary. Refuses a pair that does not
    fit, naming the file."""
    from pathlib import Path

    from specdeploy.checkpoint import CheckpointError, open_checkpoint
    from specdeploy.checkpoint.gguf import read_header

    path = Path(model_path) if model_path is not None else None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"mmproj: goes with a text GGUF file (llama.cpp's --mmproj); the model "
                         f"is {str(model_path)!r}")
    arch = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
            "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
            "gemma3_text": "Gemma3ForConditionalGeneration"}.get(cfg.get("model_type"))
    if arch is None:
        raise ValueError(f"mmproj: a vision tower goes with a Qwen3.5(-MoE), Qwen3-VL(-MoE) "
                         f"or Gemma 3 text GGUF; {path} is "
                         f"{', '.join(cfg.get('architectures') or ['?'])}")
    text = cfg.get("text_config", cfg)
    mm = open_checkpoint(mmproj)
    if not getattr(mm, "is_mmproj", False):
        raise CheckpointError(f"{mmproj}: not an mmproj GGUF (llama.cpp's vision tower file)")
    if (mm.config.get("projector") == "gemma3") != (arch == "Gemma3ForConditionalGeneration"):
        raise CheckpointError(f"{mmproj}: its projector {mm.metadata.get('clip.projector_type')!r}"
                              f" does not go with {path.name} ({cfg.get('model_type')})")
    if arch == "Gemma3ForConditionalGeneration":
        return _gemma3_gguf_config(cfg, path, mm)
    vision = mm.config["vision_config"]
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise CheckpointError(f"{mmproj}: its projection width {vision['out_hidden_size']} is "
                              f"not {path.name}'s hidden size {text['hidden_size']}: another "
                              "model's tower")
    levels = len(vision.get("deepstack_visual_indexes") or ())
    if levels != int(text.get("num_deepstack_layers", 0)):
        raise CheckpointError(f"{mmproj}: its tower has {levels} DeepStack levels, "
                              f"{path.name} takes {int(text.get('num_deepstack_layers', 0))}: "
                              "another model's tower")
    tokens = read_header(path).metadata.get("tokenizer.ggml.tokens") or []
    where = {t: i for i, t in enumerate(tokens) if t in VISION_TOKENS.values()}
    if VISION_TOKENS["image_token_id"] not in where:
        raise CheckpointError(f"{path}: its vocabulary has no {VISION_TOKENS['image_token_id']} "
                              "token: not a vision-language model's text GGUF")
    ids = {k: where[t] for k, t in VISION_TOKENS.items() if t in where}
    return {**cfg, "architectures": [arch], "vision_config": vision, **ids}


GEMMA3_TOKENS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                 "image_token_index": "<image_soft_token>"}


def _gemma3_gguf_config(cfg: dict, path, mm) -> dict:
    from specdeploy.checkpoint import CheckpointError
    from specdeploy.checkpoint.gguf import read_header

    width = mm.config["text_config"]["hidden_size"]
    if width != cfg["hidden_size"]:
        raise CheckpointError(f"{mm.path}: its projection width {width} is not {path.name}'s "
                              f"hidden size {cfg['hidden_size']}: another model's tower")
    tokens = read_header(path).metadata.get("tokenizer.ggml.tokens") or []
    where = {t: i for i, t in enumerate(tokens) if t in GEMMA3_TOKENS.values()}
    missing = [t for t in GEMMA3_TOKENS.values() if t not in where]
    if missing:
        raise CheckpointError(f"{path}: its vocabulary has no {', '.join(missing)}: not a "
                              "Gemma 3 vision-language model's text GGUF")
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": cfg, "vision_config": mm.config["vision_config"],
            "mm_tokens_per_image": mm.config["mm_tokens_per_image"],
            **{k: where[t] for k, t in GEMMA3_TOKENS.items()}}


_TOWER_PROBE = ("model.visual.blocks.0.attn.qkv.weight", "v.blk.0.attn_qkv.weight")
_GEMMA3_PROBES = tuple(f"{p}encoder.layers.0.self_attn.q_proj.weight" for p in (
    "vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
    "model.vision_tower."))


def tower_dtype(reader, want: str, model_dtype: torch.dtype, device) -> torch.dtype:
    """The vision tower's dtype (`mm_encoder_dtype`). "auto": the model's, except bfloat16 on a
    CPU that multiplies bf16 natively (AMX or AVX512-BF16) when the tower ships in bfloat16: the
    checkpoint's own precision, which transformers and vLLM run it in by default, and ~3x the
    fp32 tower's speed there (a released Qwen3.5 tower's size on a 448 x 448 image, 2 cores with
    AMX: 0.97 vs 2.87 s; bench/vision_tower.py). The language model keeps its dtype."""
    from specdeploy.loading import resolve_dtype

    if want != "auto":
        return resolve_dtype(want)
    if torch.device(device).type != "cpu" or model_dtype == torch.bfloat16:
        return model_dtype
    return torch.bfloat16 if shipped_bf16(reader) and cpu_bf16_matmul() else model_dtype


def shipped_bf16(reader) -> bool:
    """Whether the tower's weights are bfloat16 values: stored in bfloat16 (a safetensors
    checkpoint's or an mmproj GGUF's first block), or an F16 mmproj converted from a bfloat16
    checkpoint (`f16_holds_bf16`: llama.cpp's mmproj-F16 files of released towers)."""
    infos = getattr(reader, "tensor_infos", None)
    if infos is not None:  # GGUF: the stored ggml type (BF16 = 30, F16 = 1)
        info = infos.get(_TOWER_PROBE[1])
        if info is not None and info.ggml_type == 1:
            return f16_holds_bf16(reader)
        return info is not None and info.ggml_type == 30
    probe = next((n for n in (_TOWER_PROBE[0], *_GEMMA3_PROBES) if n in reader), None)
    return probe is not None and reader.get(probe).dtype == torch.bfloat16


def f16_holds_bf16(reader) -> bool:
    """Every normal value of the mmproj's F16 tensors has the 3 low mantissa bits clear: the
    values are bfloat16 values (f16 keeps 10 mantissa bits, bf16 7; data converted from fp32
    sets those bits in 7 of 8 values). Such a tower runs in bf16 exactly as shipped (subnormal
    f16 values, below 6.1e-5, move by < 6e-8 at most)."""
    checked = 0
    for info in reader.tensor_infos.values():
        if info.ggml_type != 1 or len(info.shape) < 2:
            continue
        bits = np.asarray(reader._data[info.offset:info.offset + info.nbytes]).view(np.uint16)
        exp = (bits >> 10) & 0x1F
        if ((bits & 0x7) != 0)[(exp != 0) & (exp != 0x1F)].any():
            return False
        checked += 1
    return checked > 0


def cpu_bf16_matmul() -> bool:
    """This CPU multiplies bf16 natively (AMX tiles or AVX512-BF16 dot products)."""
    from specdeploy.ops.ggml_linear import _cpu_flags

    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def load_vision(reader, dtype: torch.dtype) -> VisionModel:
    """The tower from `model.visual.*`; raises naming the missing tensors."""
    from specdeploy.checkpoint import CheckpointError

    cfg = VisionConfig.from_hf(reader.config)
    with torch.device("meta"):
        tower = VisionModel(cfg)
    names = list(tower.state_dict())
    missing = [f"model.visual.{n}" for n in names if f"model.visual.{n}" not in reader]
    if missing:
        raise CheckpointError(f"{reader.path}: vision tower tensors are missing: "
                              f"{', '.join(missing[:8])}")
    state = {n: reader.get(f"model.visual.{n}").to(dtype) for n in names}
    tower.load_state_dict(state, assign=True)
    return tower.eval().requires_grad_(False)


MAX_TOWER_PATCHES = 16384  # ~75 MiB per fp32 activation at a released tower's width (1152)


class VisionLanguageDeployed:
    """Wraps a `GraphDeployed` / `SpecDeployed` whose target graph was exported from
    `TextFromEmbeds`. `image_token_id` marks the placeholders features replace."""

    def __init__(self, inner, visual: VisionModel, embed_tokens: nn.Module, hf_config: dict,
                 max_image_pixels: int):
        self.inner = inner
        self.visual = visual
        self.embed_tokens = embed_tokens
        self.image_token_id = int(hf_config["image_token_id"])
        # -1: not declared (a video / its wrapper then never matches a prompt token)
        self.video_token_id = int(hf_config.get("video_token_id", -1))
        self.vision_start_id = int(hf_config.get("vision_start_token_id", -1))
        self.vision_end_id = int(hf_config.get("vision_end_token_id", -1))
        self.merge_size = visual.cfg.spatial_merge_size
        # the tower's features beyond the token width (Qwen3-VL's DeepStack levels)
        width = embed_tokens.weight.shape[1]
        self.deepstack_width = visual.feature_width - width
        if self.deepstack_width < 0 or self.deepstack_width % width:
            from specdeploy.checkpoint import CheckpointError

            raise CheckpointError(
                f"vision tower: its features are {visual.feature_width} wide, which is not the "
                f"text model's hidden size {width} (times 1 + its DeepStack levels): "
                "vision_config.out_hidden_size must equal text_config.hidden_size")
        self.vision_peak_bytes = vision_peak_bytes(visual.cfg, max_image_pixels,
                                                   next(visual.parameters()).element_size())
        self.vision_seconds = 0.0  # time spent in the tower (bench/vision_prefill.py)
        # one tower call takes at most this many patches (or one frame): a long video's frames
        # go through in groups (`forward_chunked`), so its peak is a group's, not the video's
        self.max_tower_patches = max(MAX_TOWER_PATCHES, max_image_pixels // (
            visual.cfg.patch_size ** 2))

    def __getattr__(self, name):  # everything else is the inner deployment's
        return getattr(self.__dict__["inner"], name)

    @property
    def target(self):
        return getattr(self.inner, "target", self.inner)

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata) -> StepOutput:
        weight = self.embed_tokens.weight  # meta holds host tensors: ids go to the device
        ids = meta.input_ids if meta.lists is None else torch.tensor(meta.lists.ids)
        embeds = self.embed_tokens(ids.to(weight.device, non_blocking=True))
        if self.deepstack_width:  # DeepStack levels: zero but at the vision tokens
            embeds = torch.cat((embeds, embeds.new_zeros(embeds.shape[0], self.deepstack_width)),
                               -1)
        for first, mm, start, n in meta.mm_rows or ():
            rows = mm.image_rows(start, n)
            if rows is None:
                continue
            feats = self.image_features(mm)
            offsets, idx = rows
            embeds[first + offsets.to(embeds.device)] = feats[idx.to(feats.device)]
        # (under tensor parallelism `inner` is rank 0's Leader: the step goes to every rank)
        return self.inner.forward_embeds(meta, embeds)

    def image_features(self, mm) -> torch.Tensor:
        """The request's image (and video) features, computed on first use and kept with the
        request."""
        if mm.features is None:
            import time

            t0 = time.perf_counter()
            dev = self.embed_tokens.weight.device
            feats = self.visual.forward_chunked(mm.pixel_values.to(dev), mm.grid_thw,
                                                self.max_tower_patches)
            mm.features = feats.to(self.embed_tokens.weight.dtype)
            self.vision_seconds += time.perf_counter() - t0
        return mm.features

    def report(self) -> str:
        return "\n".join([self.inner.report(), f"vision tower: eager, activations peak ~"
                          f"{self.vision_peak_bytes / 2**20:.1f} MiB per max-size image"])


def vision_peak_bytes(cfg: VisionConfig, max_pixels: int, elem: int) -> int:
    """Largest live activations of one tower call on an image of `max_pixels`: the residual
    stream, q/k/v and the MLP's hidden, plus one head's attention scores at a time (SDPA's math
    path materializes [P, P] per head)."""
    p = max(1, max_pixels // cfg.patch_size ** 2)
    d = cfg.hidden_size
    return p * (2 * d + 3 * d + cfg.intermediate_size) * elem + cfg.num_heads * p * p * 4


class Gemma3VisionDeployed(VisionLanguageDeployed):
    """Gemma 3 (models/gemma3_vision.py): 1-D positions, `<start_of_image>` expanded per image
    (vision/gemma3.py), the features merged unscaled over the scaled token embeddings (the
    `embed_tokens` given here scales), no videos."""

    def __init__(self, inner, visual, embed_tokens: nn.Module, hf_config: dict,
                 max_image_pixels: int):
        hf = {**hf_config, "image_token_id": _gemma3_id(hf_config, "image_token")}
        super().__init__(inner, visual, embed_tokens, hf, max_image_pixels)
        self.boi_id = _gemma3_id(hf_config, "boi_token")
        self.eoi_id = _gemma3_id(hf_config, "eoi_token")
        self.tokens_per_image = visual.cfg.mm_tokens_per_image

    def build_prompt(self, ids: list[int], images, what: str, encode):
        from specdeploy.vision.gemma3 import Gemma3Prompt, Gemma3Tokens

        if encode is None:
            raise ValueError(f"{what}: Gemma 3 images need the tokenizer (\\n\\n around each)")
        tokens = Gemma3Tokens(self.boi_id, self.eoi_id, self.image_token_id,
                              self.tokens_per_image, tuple(encode("\n\n")))
        return Gemma3Prompt.expand(list(ids), images, tokens, what)


def _gemma3_id(hf: dict, name: str) -> int:
    """`{name}_index` (the released config.json) or `{name}_id` (transformers v5's names)."""
    for key in (f"{name}_index", f"{name}_id"):
        if hf.get(key) is not None:
            return int(hf[key])
    default = {"image_token": 262_144, "boi_token": 255_999, "eoi_token": 256_000}[name]
    return default


class ScaledEmbedding(nn.Module):
    """Gemma's input embedding: the table times sqrt(H) rounded to its dtype (models/gemma3.py)."""

    def __init__(self, embed: nn.Module, scale: dict):
        super().__init__()
        self.embed = embed
        self.scale = scale

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x * self.scale[x.dtype]
