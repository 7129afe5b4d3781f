"""Structured output: JSON (a schema, or any object), a regular expression or a choice among
strings, as a token-level automaton over the target's vocabulary, used to mask the target's
logits and to cut drafts that leave the grammar. Context-free grammars (`guided_grammar`) are
engine/grammar_cfg.py's, behind the same matcher interface (`advance`, `walk`, `row_masks`).

The grammar library is outlines-core (Rust, no dependencies, CPU wheels): a JSON schema becomes a
regex, the regex an `Index` (a DFA over token ids). We chose it over xgrammar because xgrammar
pulls triton and apache-tvm-ffi into a CPU-only install, and because the `Index` is stateless:
a sequence's matcher is one state id, so walking drafts is reading transitions from a copy of
it, and "rollback" of rejected drafts is simply not advancing the committed state.

Masks are bitmasks ([ceil(V / 32)] int32, bit t = token t allowed), built once per (index,
state) and cached: a JSON automaton has few states and the steps revisit them constantly.
"""
from __future__ import annotations

import json
import threading
from functools import lru_cache

import torch

from specdeploy.engine.grammar_vocab import GrammarError, token_bytes  # noqa: F401 (API)

# Any JSON object for `response_format: {"type": "json_object"}`, values nested two levels.
# NOTE: outlines' own regex for `{"type": "object"}` nests arbitrarily deep and takes seconds to
# compile even for a 2k-token vocabulary; this bounded one compiles in well under a second.
_STR = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_NUM = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = rf"({_STR}|{_NUM}|true|false|null)"
_WS = r"[ \n]?"
_FLAT = (rf"({_SCALAR}|\[{_WS}({_SCALAR}({_WS},{_WS}{_SCALAR})*)?{_WS}\]"
         rf"|\{{{_WS}({_STR}{_WS}:{_WS}{_SCALAR}({_WS},{_WS}{_STR}{_WS}:{_WS}{_SCALAR})*)?"
         rf"{_WS}\}})")
JSON_OBJECT_REGEX = (rf"\{{{_WS}({_STR}{_WS}:{_WS}{_FLAT}({_WS},{_WS}{_STR}{_WS}:{_WS}{_FLAT})*)?"
                     rf"{_WS}\}}")


_REGEX_META = set("\\.^$|?*+()[]{}")


def choice_regex(choices) -> str:
    """One of `choices` exactly: their alternation, each escaped (only the regex
    metacharacters: the grammar library's syntax refuses some escapes Python writes)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in choice)
                          for choice in choices) + ")"


class GrammarCompiler:
    """Compiles JSON grammars for one tokenizer and model vocabulary (thread-safe: the server
    compiles while parsing a request, the engine thread reads the cache)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import outlines_core as oc

        self.vocab_size = vocab_size
        self.eos = sorted(int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size)
        if not self.eos:
            raise GrammarError("structured output needs an end-of-sequence token")
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes(tokenizer).items():
            if i < vocab_size and i not in self.eos:
                by_bytes.setdefault(b, []).append(i)
        self._vocab = oc.Vocabulary(self.eos[0], by_bytes)
        self._tokenizer, self._cfg_tok = tokenizer, None  # guided_grammar's, built on first use
        self._lock = threading.Lock()
        self._cache: dict[str, Grammar] = {}

    def compile(self, schema: str | None) -> Grammar:
        """`schema`: a JSON schema (canonical JSON text), or None for any JSON object."""
        return self.compile_key(("json", schema))

    def compile_key(self, key: tuple[str, str | None]) -> Grammar:
        """`key`: ("json", a JSON schema's canonical text or None for any object) or ("regex",
        a regular expression the whole output must match): `SamplingParams.grammar_key`."""
        kind, text = key
        if kind not in ("json", "regex", "grammar") or (kind != "json"
                                                         and not isinstance(text, str)):
            raise GrammarError(f"unknown grammar {key!r}")
        cache_key = ("" if text is None else text) if kind == "json" else f"{kind}:{text}"
        with self._lock:
            g = self._cache.get(cache_key)
        if g is None:
            g = self._cfg(text) if kind == "grammar" else \
                Grammar(self._index(kind, text), self.vocab_size, self.eos)
            with self._lock:
                self._cache.setdefault(cache_key, g)
                if len(self._cache) > 64:  # bound the memory of one-off schemas
                    self._cache.pop(next(iter(self._cache)))
        return g

    def _cfg(self, text: str):
        """A context-free grammar (engine/grammar_cfg.py, llguidance)."""
        try:
            from specdeploy.engine import grammar_cfg
        except ImportError:  # pragma: no cover (an install without the serve extra)
            raise GrammarError("guided_grammar needs llguidance (pip install llguidance)") \
                from None
        with self._lock:
            if self._cfg_tok is None:
                self._cfg_tok = grammar_cfg.CfgTokenizer(self._tokenizer, self.vocab_size,
                                                         self.eos)
        return grammar_cfg.CfgGrammar(self._cfg_tok, text)

    def _index(self, kind: str, text: str | None):
        import outlines_core as oc

        try:
            if kind == "regex":
                regex = text
            else:
                regex = JSON_OBJECT_REGEX if text is None else _schema_regex(text)
            return oc.Index(regex, self._vocab)
        except Exception as e:  # the library raises ValueError / its own errors
            what = "regular expression" if kind == "regex" else "JSON schema"
            raise GrammarError(f"cannot compile the {what}: {e}") from None


@lru_cache(maxsize=256)
def _schema_regex(schema: str) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    json.loads(schema)
    return build_regex_from_schema(schema)


class Grammar:
    """A compiled grammar: transitions and (cached) allowed-token bitmasks per state."""

    def __init__(self, index, vocab_size: int, eos: list[int]):
        self.index, self.vocab_size, self.eos = index, vocab_size, eos
        self.initial = index.get_initial_state()
        self.words = (vocab_size + 31) // 32
        self._masks: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def next_state(self, state: int, token: int) -> int | None:
        """The state after `token`, None if the grammar forbids it (an end-of-sequence token is
        allowed in a final state and keeps it)."""
        if token in self.eos:
            return state if self.index.is_final_state(state) else None
        return self.index.get_next_state(state, token)

    def matcher(self) -> Matcher:
        return Matcher(self)

    def bitmask(self, state: int) -> torch.Tensor:
        """[words] int32 of the tokens allowed in `state` (EOS ids in final states)."""
        m = self._masks.get(state)
        if m is None:
            allowed = list(self.index.get_allowed_tokens(state) or ())
            if self.index.is_final_state(state):
                allowed += self.eos
            bits = torch.zeros(self.words * 32, dtype=torch.bool)
            if allowed:
                bits[torch.tensor(allowed, dtype=torch.long)] = True
            weights = (1 << torch.arange(32, dtype=torch.int64))
            m = (bits.view(self.words, 32).long() * weights).sum(-1)
            m = torch.where(m >= 2**31, m - 2**32, m).to(torch.int32)  # two's complement
            with self._lock:
                self._masks[state] = m
        return m


class Matcher:
    """One sequence's position in its grammar: the state after its committed tokens."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.initial

    def advance(self, token: int) -> None:
        nxt = self.grammar.next_state(self.state, token)
        if nxt is None:
            raise ValueError(f"response_format: token {token} is not allowed by the grammar")
        self.state = nxt

    def walk(self, drafts: list[int]) -> list[int]:
        """States after each accepted prefix of `drafts` (state before the first draft first),
        stopping before the first draft the grammar forbids: len = 1 + drafts that fit."""
        states = [self.state]
        for t in drafts:
            nxt = self.grammar.next_state(states[-1], t)
            if nxt is None:
                break
            states.append(nxt)
        return states


    def row_masks(self, drafts: list[int], rows: int) -> torch.Tensor:
        """[rows, words] int32: the tokens allowed after the committed tokens and after each
        allowed draft (the last mask repeats past them)."""
        states = self.walk(drafts[:rows - 1])
        # NOTE: a forbidden draft (cut before verification, so only by a bug) gets p = 0 and is
        # rejected: the rows after it are never read
        states += [states[-1]] * (rows - len(states))
        return torch.stack([self.grammar.bitmask(st) for st in states])


def unpack_bitmask(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., words] int32 → [..., vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks[..., None] >> shifts) & 1
    return bits.bool().flatten(-2)[..., :vocab_size]
