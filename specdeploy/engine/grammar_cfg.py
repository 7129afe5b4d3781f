"""Context-free grammars for structured output (`guided_grammar`, vLLM's field): the whole reply
must be a sentence of the grammar. GBNF / EBNF (`root ::= ...`, as llama.cpp's grammars and
vLLM's xgrammar backend take) or Lark (`start: ...`, as its guidance backend takes).

The parser is llguidance (Rust, no dependencies; an Earley parser with a lexer over the
tokenizer's byte tries, built for token masks). Where engine/grammar.py's regular grammars are
stateless indexes (a sequence's position is one state id), a context-free one needs a stack:
each sequence holds an `LLMatcher`, advanced by its committed tokens. Speculation still works
as with the regular grammars: drafts are checked without moving the committed position
(`validate_tokens`), and a verify step's row masks come from consuming the drafts one at a
time and rolling them back (`row_masks`).
"""
from __future__ import annotations

import threading

import torch

from specdeploy.engine.grammar_vocab import GrammarError, token_bytes


def to_lark(text: str) -> str:
    """The grammar in Lark syntax (GBNF / EBNF converted; a Lark grammar as it is)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter's own parse errors
        raise GrammarError(f"cannot parse the grammar: {e}") from None


class CfgTokenizer:
    """llguidance's view of the tokenizer, from the same token bytes the regular grammars use
    (grammar.py `token_bytes`: so both allow the same tokens for the same language); special
    tokens and ids past the tokenizer's vocabulary are never text. Built once per engine, on
    first use."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        self.vocab_size, self.eos = vocab_size, eos
        self._tokenizer = tokenizer
        self._tok = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._tok is None:
                import llguidance as llg

                self._tok = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(
                    self._tokenizer, self.vocab_size, self.eos)), n_vocab=self.vocab_size,
                    eos_token=list(self.eos))
            return self._tok


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: every id's bytes, the special ids, encode."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        text = token_bytes(tokenizer)
        self.tokens = [text.get(i, f"<[{i}]>".encode()) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if i not in text]
        self.eos_token_id, self.bos_token_id = eos[0], None
        self._encode = tokenizer.encode

    def __call__(self, s):
        if isinstance(s, bytes):  # NOTE: llguidance probes with bytes; we take text
            raise TypeError("text, not bytes")
        return list(self._encode(s, add_special_tokens=False))


class CfgGrammar:
    """A compiled context-free grammar; `matcher()` starts a sequence on it."""

    def __init__(self, tokenizer: CfgTokenizer, text: str):
        import llguidance as llg

        self.tok, self.eos = tokenizer, frozenset(tokenizer.eos)
        self.vocab_size = tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.grammar = llg.LLMatcher.grammar_from_lark(to_lark(text))
        err = llg.LLMatcher.validate_grammar(self.grammar, tokenizer.get())
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"cannot compile the grammar: {err}")

    def matcher(self) -> CfgMatcher:
        return CfgMatcher(self)


class CfgMatcher:
    """One sequence's parse state: the committed tokens consumed."""

    def __init__(self, grammar: CfgGrammar):
        import llguidance as llg

        self.grammar = grammar
        self.m = llg.LLMatcher(grammar.tok.get(), grammar.grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"cannot start the grammar: {self.m.get_error()}")

    def advance(self, token: int) -> None:
        if token in self.grammar.eos:  # the reply ends: the grammar must be complete
            if not self.m.is_accepting():
                raise ValueError(f"guided_grammar: the reply ended (token {token}) before the "
                                 "grammar was complete")
            return
        if not self.m.consume_token(token):
            raise ValueError(f"guided_grammar: token {token} is not allowed by the grammar")

    def walk(self, drafts: list[int]) -> list[int]:
        """1 + the drafts the grammar allows in a row (their positions; only the count is
        read), the committed position unchanged."""
        return list(range(self._fits(drafts) + 1))

    def _fits(self, drafts: list[int]) -> int:
        eos = self.grammar.eos
        for i, t in enumerate(drafts):
            if t in eos:  # an end of reply fits where the drafts before it complete the grammar
                k = self.m.validate_tokens(list(drafts[:i])) if i else 0
                return k if k < i else i + self._accepting_after(list(drafts[:i]))
        return self.m.validate_tokens(list(drafts))

    def _accepting_after(self, prefix: list[int]) -> int:
        if not prefix:
            return int(self.m.is_accepting())
        ok = self.m.consume_tokens(prefix)
        done = ok and self.m.is_accepting()
        self.m.rollback(len(prefix))
        return int(done)

    def row_masks(self, drafts: list[int], rows: int) -> torch.Tensor:
        """[rows, words] int32: the tokens allowed after the committed tokens and after each
        allowed draft (the last mask repeats past them and past an end of reply)."""
        fed = []
        for t in drafts[:min(self._fits(drafts), rows - 1)]:
            if t in self.grammar.eos:
                break
            fed.append(t)
        masks = [self._mask()]
        for t in fed:
            self.m.consume_token(t)  # NOTE: validated above
            masks.append(self._mask())
        if fed:
            self.m.rollback(len(fed))
        masks += [masks[-1]] * (rows - len(masks))
        return torch.stack(masks)

    def _mask(self) -> torch.Tensor:
        raw = self.m.compute_bitmask()
        return torch.frombuffer(bytearray(raw), dtype=torch.int32)[:self.grammar.words].clone()
