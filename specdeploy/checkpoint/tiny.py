"""Writing tiny random checkpoints in the layout of released ones (for tests and `make-tiny`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_checkpoint(
    out: str | Path, config: dict, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 0
) -> Path:
    """Write `config.json` + safetensors (sharded with an index when over `max_shard_bytes`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    if not max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def write_tiny_tokenizer(out: str | Path, vocab_size: int,
                         specials_at: dict[int, str] | None = None,
                         chat_template: str = CHAT_TEMPLATE) -> None:
    """A byte-level BPE-free tokenizer (WordLevel over characters + specials) with a chat template.

    Ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, then printable characters; the remaining
    ids up to `vocab_size` are unused filler tokens so the model's vocab and the tokenizer agree,
    except the extra special tokens `specials_at` (id → text, e.g. a VLM's image tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    i = len(vocab)
    specials_at = specials_at or {}
    while i < vocab_size:
        vocab[specials_at.get(i, f"<|filler_{i}|>")] = i
        i += 1
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials + [specials_at[i] for i in sorted(specials_at)])
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": 2, "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen))
