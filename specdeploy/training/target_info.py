"""What drafter training reads of a frozen target, whatever its family (Llama, NemotronH,
Qwen3.5-MoE text or the language model of the VLM layout): its embedding, LM head, final norm,
attention geometry, and the layers whose inputs EAGLE-3 captures."""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.models import llama
from specdeploy.models.drafters.checkpoint_mtp import family_of, mtp_parts
from specdeploy.models.drafters.eagle3 import default_aux_layers
from specdeploy.models.layers import RopeConfig


def is_llama(target: nn.Module) -> bool:
    return isinstance(getattr(target, "cfg", None), llama.Config)


def embedding(target: nn.Module) -> nn.Module:
    return mtp_parts(target)[0] if family_of(target) else target.model.embed_tokens


def head_weight(target: nn.Module) -> torch.Tensor:
    """The LM head's weight [V, H] (Qwen3.5 with tied embeddings: the embedding's)."""
    return (mtp_parts(target)[1] if family_of(target) else target.lm_head).weight


def final_norm(target: nn.Module) -> nn.Module:
    m = target.model
    return m.norm if hasattr(m, "norm") else m.norm_f


def num_layers(target: nn.Module) -> int:
    return len(target.model.layers)


def _completes_a_block(layer: nn.Module) -> bool:
    """Whether the residual stream after `layer` has had a full token-mixing + channel-mixing
    update. NemotronH layers are single mixers (Mamba2, attention, MLP or MoE); only after an
    MLP / MoE layer is the stream what a Llama layer boundary is. Every Qwen3.5 (and Llama)
    decoder layer holds its own MLP / MoE."""
    mixer = getattr(layer, "mixer", None)
    return mixer is None or type(mixer).__name__ in ("MLP", "MoE")


def aux_layers(target: nn.Module) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high captured layers, as *input* layer ids (checkpoint
    convention; deployment captures the output of layer id - 1).

    Llama targets keep `default_aux_layers` (the shipped heads and peers use it). On hybrids:
    - ids are in 1..L-1: the input of layer 0 is the embedding, which is no layer's output, so
      the deployed capture (output of layer id - 1) could not read it;
    - a feature should be a complete layer output: on NemotronH, the stream right after a Mamba
      or attention mixer has not been through its MLP / MoE yet and is a half-layer state, so
      the ids are the layers that follow an MLP / MoE layer (`_completes_a_block`);
    - each of low / middle / high takes the nearest such id to the usual (2, L/2, L-3), distinct
      while there are enough; a stack with too few falls back on any layer boundary.
    """
    n = num_layers(target)
    if is_llama(target):
        return default_aux_layers(n)
    layers = target.model.layers
    complete = [i for i in range(1, n) if _completes_a_block(layers[i - 1])]
    wanted = [min(max(i, 1), n - 1) for i in default_aux_layers(n)]
    picked: list[int] = []
    for w in wanted:
        pool = [i for i in complete if i not in picked] or \
            [i for i in range(1, n) if i not in picked] or picked
        picked.append(min(pool, key=lambda i: (abs(i - w), i)))
    return tuple(sorted(picked))


def eagle3_geometry(target: nn.Module) -> dict:
    """`Eagle3Config` fields that follow the target. The drafter's layer is Llama-style on any
    target: attention with the target's head geometry and its own full-width RoPE (NemotronH
    attention has none and Qwen3.5's is partial / multimodal; a one-layer drafter without
    recurrence needs positions), and a SwiGLU MLP as wide as the target's per-token MLP
    compute (MoE: top-k experts plus the shared expert)."""
    t = target.cfg
    if is_llama(target):
        return dict(intermediate_size=t.intermediate_size, rms_norm_eps=t.rms_norm_eps,
                    rope=t.rope, max_position_embeddings=t.max_position_embeddings)
    hf = getattr(target, "hf_config", None) or {}
    hf = hf.get("text_config", hf)
    if hasattr(t, "n_routed_experts"):  # NemotronH
        moe = t.num_experts_per_tok * t.moe_intermediate_size + \
            t.moe_shared_expert_intermediate_size
        width, eps, rope = max(t.intermediate_size, moe), t.eps, RopeConfig()
    else:  # Qwen3.5 (dense: its MLP's width)
        width = t.num_experts_per_tok * t.moe_intermediate_size + \
            t.shared_expert_intermediate_size if t.num_experts else t.intermediate_size
        eps, rope = t.rms_norm_eps, RopeConfig(theta=t.rope_theta)
    return dict(intermediate_size=width, rms_norm_eps=eps, rope=rope,
                max_position_embeddings=int(hf.get("max_position_embeddings") or 8192))
