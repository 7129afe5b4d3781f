"""What every grammar kind shares: the error a request's grammar raises, and each token's bytes
(the vocabulary the regular grammars, engine/grammar.py, and the context-free ones,
engine/grammar_cfg.py, are built over)."""
from __future__ import annotations


class GrammarError(ValueError):
    """A schema the grammar library cannot compile (the server answers 400)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet (printable stand-ins for bytes) → byte."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes (specials left out: the grammar never emits them). Byte-level
    BPE vocabularies are decoded from their alphabet, SentencePiece ones (byte fallback) from
    their pieces ("▁" a space, <0xNN> one byte); others by decoding the token alone (a
    token that is part of a multi-byte character then cannot be used inside the grammar)."""
    backend = tokenizer.backend
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    vocab = backend.get_vocab(with_added_tokens=True)
    out: dict[int, bytes] = {}
    if type(backend.decoder).__name__ == "ByteLevel":
        dec = _byte_decoder()
        for tok, i in vocab.items():
            if tok not in special and all(c in dec for c in tok):
                out[i] = bytes(dec[c] for c in tok)
        return out
    if getattr(backend.model, "byte_fallback", False):  # SentencePiece: "▁" spaces, <0xNN>
        for tok, i in vocab.items():
            if tok in special:
                continue
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                out[i] = bytes([int(tok[3:5], 16)])
            else:
                out[i] = tok.replace("\u2581", " ").encode()
        return out
    for tok, i in vocab.items():
        if tok in special:
            continue
        text = tokenizer.decode([i])
        if text and "\ufffd" not in text:
            out[i] = text.encode()
    return out
