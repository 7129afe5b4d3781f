"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level tokenizers split multi-byte characters across tokens; decoding a partial character
gives U+FFFD. We decode a short window `ids[prefix:]`, compare it with the decode of
`ids[prefix:read]` (already emitted) and emit the difference only when it does not end in U+FFFD.
The prefix window keeps context so that tokenizers that strip a leading space still decode right.
"""
from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int] | None = None,
                 context: int = 5):
        self._decode = decode
        # A few prompt tokens as context: the first output token decodes as it would mid-text.
        self.ids: list[int] = list(prompt_ids[-context:]) if prompt_ids else []
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            # NOTE: compare by position, not by startswith: a window that shifted can re-decode
            # the prefix identically, which is all we rely on.
            new = full[len(prefix_text):]
            self.prefix = self.read
            self.read = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """At the end of a request: whatever is left, replacement characters included."""
        if self.read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):]
