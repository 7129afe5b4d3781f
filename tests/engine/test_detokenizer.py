"""Incremental detokenization equals a full decode, multi-byte characters split anywhere."""
from __future__ import annotations

import random

import pytest

from specdeploy.engine.detokenizer import IncrementalDetokenizer


class ByteChunkTokenizer:
    """Tokens are byte strings of 1-3 bytes (like byte-level BPE), cut without regard for UTF-8."""

    def __init__(self, vocab: list[bytes]):
        self.vocab = vocab

    def decode(self, ids):
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


def _stream(rng: random.Random, text: str) -> tuple[list[bytes], list[int]]:
    data = text.encode()
    chunks, i = [], 0
    while i < len(data):
        n = rng.randint(1, 3)
        chunks.append(data[i:i + n])
        i += n
    vocab = sorted(set(chunks))
    return vocab, [vocab.index(c) for c in chunks]


@pytest.mark.parametrize("seed", range(20))
def test_incremental_equals_full_decode(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n" + "é漢字😀ß€" + "\u0301"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
    vocab, ids = _stream(rng, text)
    tok = ByteChunkTokenizer(vocab)
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.add(i) for i in ids]
    out = "".join(pieces) + detok.flush()
    assert out == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_are_flushed():
    vocab = [b"a", b"\xe6", b"\xbc", b"b"]  # a lone partial character, then more text
    tok = ByteChunkTokenizer(vocab)
    for ids in ([0, 1, 2], [0, 1, 2, 3], [1, 3, 1]):
        detok = IncrementalDetokenizer(tok.decode)
        out = "".join(detok.add(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids)


def test_prompt_context_is_not_emitted():
    vocab = [b"x", b"y", b"\xc3", b"\xa9"]
    tok = ByteChunkTokenizer(vocab)
    detok = IncrementalDetokenizer(tok.decode, prompt_ids=[0, 1, 0])
    assert [detok.add(i) for i in (2, 3, 1)] == ["", "é", "y"]
