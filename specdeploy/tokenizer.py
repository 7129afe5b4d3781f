"""Tokenizers from a HF directory (`tokenizer.json`) or a GGUF vocabulary, plus chat templates.

The GGUF path rebuilds the byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and the SentencePiece
BPE ("llama": merges from the pieces' scores, byte fallback) the way transformers does, so ids match
transformers' own GGUF tokenizer.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from specdeploy.chat_template import render
from specdeploy.checkpoint import CheckpointError

__all__ = ["Tokenizer", "load_tokenizer"]

# The split before BPE by llama.cpp's `tokenizer.ggml.pre` name (the regex of the model's own
# tokenizer.json, as llama.cpp's llama-vocab.cpp groups the names); any other gpt2-style
# vocabulary (gpt-2, smollm, default, ...) uses ByteLevel's built-in GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # one digit a piece
_QWEN35_SPLIT = (  # Qwen3.5: combining marks stay with their letters
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral's tekken (Nemo): words split at case changes, one digit a piece
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx",
                     "pixtral", "falcon-h1", "lfm2", "midm-2.0", "jina-v5-nano",
                     "chatglm-bpe", "glm4", "glm5"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# Vocabularies whose pieces that are whole tokens skip BPE (llama.cpp's `ignore_merges`, the
# tokenizer.json flag of Llama 3 and GLM-4): the merges alone may not spell such a token.
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                  "midm-2.0", "lfm2", "jina-v5-nano", "glm4", "glm5")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# OpenAI's harmony vocabulary (gpt-oss): <|return|> (the answer is done) and <|call|> (a tool
# call waits for its result) end a reply; <|end|> only closes one of its messages (the analysis
# before the final answer), so it never stops one (llama.cpp drops it from its EOG tokens too).
_HARMONY_STOPS, _HARMONY_END, _HARMONY_MARK = ("<|return|>", "<|call|>"), "<|end|>", "<|channel|>"


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with the ids and the template the engine needs."""

    def __init__(self, backend, *, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, special_tokens: dict[str, str | None] | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))  # ordered, unique
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render `messages` with the checkpoint's Jinja template (sandboxed, as transformers);
        `kwargs` are template variables (`tools`, `documents`, `enable_thinking`, ...);
        `chat_template` replaces the checkpoint's."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; pass a raw prompt instead")
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        return render(template, messages, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, variables=variables)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """Tokenizer of a HF checkpoint directory or a `.gguf` file; `None` = the default model."""
    if path is None:
        from specdeploy.default_model import default_model_path

        path = default_model_path()
    from specdeploy.checkpoint.hub import resolve_model_path

    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _from_gguf(p)
    if p.is_dir():
        return _from_hf_dir(p)
    raise CheckpointError(f"{p}: expected a checkpoint directory or a .gguf file")


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _from_hf_dir(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    backend = Backend.from_file(str(tok_file))
    tcfg = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")
    mcfg = _read_json(path / "config.json")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    specials = {k: _token_text(tcfg.get(k)) for k in
                ("bos_token", "eos_token", "unk_token", "pad_token")}
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), mcfg.get("eos_token_id")):
        if src is not None:
            eos += src if isinstance(src, list) else [src]
            break
    if specials["eos_token"] and backend.token_to_id(specials["eos_token"]) is not None:
        eos.append(backend.token_to_id(specials["eos_token"]))
    bos = gen.get("bos_token_id", mcfg.get("bos_token_id"))
    if bos is None and specials["bos_token"]:
        bos = backend.token_to_id(specials["bos_token"])
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=harmony_stops(backend, eos),
                     chat_template=template, special_tokens=specials)


def harmony_stops(backend, eos: list[int]) -> list[int]:
    """`eos` with a harmony vocabulary's stops: its <|return|> and <|call|> in, <|end|> out
    (whatever the checkpoint's files declare); other vocabularies' unchanged."""
    stops = [backend.token_to_id(t) for t in _HARMONY_STOPS]
    if None in stops or backend.token_to_id(_HARMONY_MARK) is None:
        return eos
    end = backend.token_to_id(_HARMONY_END)
    return [i for i in eos if i != end] + stops


def _read_json(f: Path) -> dict:
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: malformed JSON ({e})") from None


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _from_gguf(path: Path) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    from specdeploy.checkpoint.gguf import read_header

    md = read_header(path).metadata
    kind = md.get("tokenizer.ggml.model")
    if kind == "llama":
        return _spm_from_gguf(path, md)
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported "
                              "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or []
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # tokens the file writes in plain text (not the byte alphabet) are re-spelled, as transformers
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False,
                                 ignore_merges=md.get("tokenizer.ggml.pre") in _IGNORE_MERGES))
    prefix_space = bool(md.get("tokenizer.ggml.add_space_prefix", False))
    split = _SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= spelled]
    backend.add_special_tokens(control)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

    def tok(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return (i, tokens[i]) if i is not None and 0 <= i < len(tokens) else (None, None)

    bos_id, bos = tok("bos_token_id")
    if md.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return _gguf_tokenizer(backend, md, tokens)


def _gguf_tokenizer(backend, md: dict, tokens: list[str]) -> Tokenizer:
    def tok(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return (i, tokens[i]) if i is not None and 0 <= i < len(tokens) else (None, None)

    bos_id, bos = tok("bos_token_id")
    eos_id, eos = tok("eos_token_id")
    eos_ids = [i for i in (eos_id, md.get("tokenizer.ggml.eot_token_id"),
                           md.get("tokenizer.ggml.eom_token_id")) if i is not None]
    specials = {"bos_token": bos, "eos_token": eos, "unk_token": tok("unknown_token_id")[1],
                "pad_token": tok("padding_token_id")[1]}
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=harmony_stops(backend, eos_ids),
                     chat_template=md.get("tokenizer.chat_template"), special_tokens=specials)


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's merges: every split of a piece into two pieces of the
    vocabulary, best score first (then longer left, longer right), as transformers derives
    them. BPE over these merges is llama.cpp's SPM encoding: the adjacent pair whose union
    scores best merges first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    found = []
    for piece, score in score_of.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found += [(lr, score) for lr in local]
    found.sort(key=lambda m: (m[1], len(m[0][0]), len(m[0][1])), reverse=True)  # stable
    return [lr for lr, _ in found]


def _spm_from_gguf(path: Path, md: dict) -> Tokenizer:
    """`tokenizer.ggml.model == "llama"` (Llama 2, Mistral 7B, Phi-3, ...): SentencePiece BPE
    rebuilt as transformers' GGUF converter does: merges from the pieces' scores, byte fallback
    through the <0xNN> tokens, spaces as "▁" with one added in front of each run of text (as
    llama.cpp; checked against llama.cpp's own expected ids of its Llama / Phi-3 vocabularies)."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or []
    arch = md.get("general.architecture")
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:  # a token of spaces is stored as spaces, looked up as "▁"s (transformers)
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    if "tokenizer.ggml.merges" in md:
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    elif gemma:  # Gemma's scores do not follow its merge order; the file's order does
        merges = _spm_merges(tokens, [-float(i) for i in range(len(tokens))])
    else:
        scores = md.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{path}: SentencePiece GGUF vocabulary without one "
                                  "tokenizer.ggml.scores entry per token")
        merges = _spm_merges(tokens, [float(x) for x in scores])
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = md.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(
        vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk] if gemma and unk is not None and 0 <= unk < len(tokens) else None))
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", not gemma))
    if gemma:  # every space a "▁", none added in front (transformers' GemmaTokenizer)
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        prefix = False
    else:
        # llama.cpp's SPM (and SentencePiece's add_dummy_prefix): a "▁" in front of every run
        # of text, also one that starts with a space or follows a special token, each space
        # one "▁" (transformers' phi3 builder; its Metaspace for "llama" files adds none in
        # front of a space, nor after a special token: " Hi" would be "▁Hi", not "▁▁Hi")
        backend.normalizer = normalizers.Sequence(
            [*([normalizers.Prepend("\u2581")] if prefix else []),
             normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))

    def named(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = named("bos_token_id"), named("eos_token_id")
    # control tokens, and the ones named bos/eos/unk/pad, whole and special; user-defined
    # ones whole but not special (a tokenizer from the same file in transformers)
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    special += [t for t in (bos, eos, named("unknown_token_id"), named("padding_token_id"))
                if t is not None and t not in special]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        def around(seq, tid):
            return " ".join([*([f"{bos}:{tid}"] if add_bos else []), f"{seq}:{tid}",
                             *([f"{eos}:{tid}"] if add_eos else [])])
        pairs = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        backend.post_processor = processors.TemplateProcessing(
            single=around("$A", 0), pair=f"{around('$A', 0)} {around('$B', 1)}",
            special_tokens=list(dict.fromkeys(pairs)))
    return _gguf_tokenizer(backend, md, tokens)


def eos_token_ids(tokenizer, hf_config: dict, path: Path) -> set[int]:
    """EOS from the tokenizer, config.json and generation_config.json (any may list several)."""
    ids: set[int] = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    sources = [hf_config.get("eos_token_id")]
    gen = path / "generation_config.json"
    if path.is_dir() and gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for v in sources:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(t) for t in v)
    backend = getattr(tokenizer, "backend", None)
    return ids if backend is None else set(harmony_stops(backend, sorted(ids)))
