"""Requests as the engine sees them: sampling parameters, sequences and their outputs."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdeploy.engine.detokenizer import IncrementalDetokenizer
from specdeploy.engine.metrics import RequestMetrics
from specdeploy.engine.params_check import check_sampling

if TYPE_CHECKING:
    from specdeploy.engine.lookup import NgramIndex
    from specdeploy.engine.spec_accept import SeqControl


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated at construction."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all
    seed: int | None = None
    stop: str | Seq[str] | None = None
    stop_token_ids: Seq[int] | None = None
    ignore_eos: bool = False
    # vLLM semantics (engine/logits_process.py): penalties before temperature; min_p after it
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids (and stop strings) wait for this many tokens
    presence_penalty: float = 0.0  # over the generated tokens
    frequency_penalty: float = 0.0  # over the generated tokens, per occurrence
    repetition_penalty: float = 1.0  # over prompt + generated: positive / r, negative * r
    logprobs: int | None = None  # the target's raw logprobs of each token, plus the top N
    # vLLM's: the raw logprobs of each prompt token after the first, plus the top N
    # (engine/prompt_logprobs.py; such a request does not start on prefix-cached pages)
    prompt_logprobs: int | None = None
    guided_json: str | dict | None = None  # a JSON schema the output must follow
    json_object: bool = False  # the output is a JSON object (any)
    guided_regex: str | None = None  # a regular expression the whole output must match
    guided_choice: Seq[str] | None = None  # the output is exactly one of these strings
    # a context-free grammar the whole output must follow: GBNF / EBNF (`root ::= ...`, as
    # llama.cpp and vLLM's xgrammar take) or Lark (`start: ...`); engine/grammar_cfg.py
    guided_grammar: str | None = None
    # vLLM's / OpenAI's: token id -> a bias added to its logit (in [-100, 100]; kept as sorted
    # (id, bias) pairs), and the only ids that may be sampled; before the penalties
    logit_bias: dict[int, float] | Seq[tuple[int, float]] | None = None
    allowed_token_ids: Seq[int] | None = None
    # vLLM's: a word's last token is banned where the generated tokens end with the rest of it
    # (each word as written and after a space; engine/logits_process.py `bad_word_ids`)
    bad_words: Seq[str] | None = None
    # vLLM's (its default is True): special tokens (control tokens such as <|im_start|>; the
    # stop token is never in the text) left out of the text. Off here by default.
    skip_special_tokens: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string kept in the text

    def __post_init__(self):
        for name, value in check_sampling(self).items():  # engine/params_check.py: the rules
            object.__setattr__(self, name, value)
        kinds = [k for k in ("guided_json", "json_object", "guided_regex", "guided_choice",
                             "guided_grammar") if getattr(self, k) not in (None, False)]
        if len(kinds) > 1:
            raise ValueError(f"{kinds[0]}: give one structured output kind, not "
                             f"{' and '.join(kinds)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Changes the target's logits before sampling (engine/logits_process.py)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0
                or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def structured(self) -> bool:
        return (self.guided_json is not None or self.json_object
                or self.guided_regex is not None or self.guided_choice is not None
                or self.guided_grammar is not None)

    @property
    def grammar_key(self) -> tuple[str, str | None]:
        """What the grammar compiler compiles (engine/grammar.py `GrammarCompiler.compile_key`):
        ("json", schema text or None for any object), ("regex", a regular expression) or
        ("grammar", a context-free grammar's text)."""
        if self.guided_grammar is not None:
            return "grammar", self.guided_grammar
        if self.guided_regex is not None:
            return "regex", self.guided_regex
        if self.guided_choice is not None:
            from specdeploy.engine.grammar import choice_regex

            return "regex", choice_regex(self.guided_choice)
        return "json", self.guided_json


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, shaped as vLLM's `CompletionOutput`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state as returned to callers. `text`/`token_ids` are cumulative; `delta_*` is
    what the latest step added (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why a request finished with "error" (it alone failed)
    # with SamplingParams.logprobs: per token, {id: logprob} of the sampled token and the top N
    # (top N first, best first; vLLM's shape without its Logprob objects)
    logprobs: list[dict[int, float]] | None = None
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, then {id:
    # logprob} of the top N and the prompt token (vLLM's `prompt_logprobs`), and that token's
    # rank (1: the most likely; None for the first); complete once the prompt is prefilled
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: `out.outputs[0].text` / `.token_ids` / `.logprobs` (one completion per
        request; `cumulative_logprob` sums the sampled tokens' logprobs when they were asked)."""
        lps = self.logprobs
        cum = None if lps is None else sum(e[t] for t, e in zip(self.token_ids, lps) if t in e)
        return [CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason,
                                 cum, None if lps is None else list(lps))]


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class SpecSeqState:
    """A sequence's speculative state between steps (engine/speculative.py): the drafts proposed
    for its next verify, and what the draft sources remember about it."""

    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] q each draft was drawn from
    from_lookup: bool = False  # some drafts came from n-gram lookup
    lookup_n: int | None = None  # drafts its next lookup match makes (None: K)
    lookup_copy: int = 0  # its lookup drafts' copy length (NgramIndex.copied)
    # its last drafts came from the suffix store: each one's estimate (engine/suffix_store.py)
    store_conf: list[float] | None = None
    ngram_index: NgramIndex | None = None
    chain_prob: float = 1.0  # product of the drafter's top probabilities so far
    # the cost controller (engine/spec_control.py): drafter drafts wanted next step (None: K),
    # its acceptance estimates, and the drafter's deferred catch-up (start, ids, captured rows)
    limit: int | None = None
    control: SeqControl | None = None
    behind: tuple[int, list[int], list[torch.Tensor]] | None = None

    def clear(self) -> None:
        self.drafts, self.draft_probs, self.from_lookup, self.limit = [], None, False, None
        self.store_conf = None


_ids = itertools.count()
_arrivals = itertools.count()  # arrival order (request ids may be the caller's)


class Sequence:
    """One request in flight. NOTE: `num_cached` counts tokens whose KV/state is in the cache; the
    tokens still to feed are `all_ids[num_cached:]` (the whole prompt at first, then the last
    sampled token, or prompt + output after a preemption)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer | None, request_id: str | None = None,
                 device: torch.device | str = "cpu"):
        self.request_id = request_id if request_id is not None else str(next(_ids))
        self.arrival = next(_arrivals)
        self.priority = 0  # vLLM's: lower runs first under the "priority" scheduling policy
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.num_cached = 0
        self.pages: list[int] = []
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages (cache/prefix.py)
        self.num_offered_pages = 0  # of `pages`, those already offered to the prefix cache
        # the window page group's block-table row (cache/window.py; 0: slid out) and the
        # index before which every slot is already null
        self.win_pages: list[int] = []
        self.win_first = 0
        self.slot = -1
        self.finish_reason: str | None = None
        self.error: str | None = None  # set with finish_reason "error"
        self.detok = detok
        self.text = ""
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # NOTE: on the device its noise is drawn on (a CPU generator cannot fill CUDA rows)
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.spec = SpecSeqState()
        self.mm = None  # its images (vision/prompt.py MultimodalPrompt), on a VLM target
        self.matcher = None  # grammar state (engine/grammar.py Matcher), structured output
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.new_logprobs: list[dict[int, float]] = []  # this step's, one per new token
        asks = params.prompt_logprobs is not None  # engine/prompt_logprobs.py fills these
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if asks else None
        self.prompt_ranks: list[int | None] = [None] if asks else []
        self.prompt_seen: torch.Tensor | None = None  # [V] bool, for repetition_penalty
        self.bad_words_ids: list[tuple[int, ...]] = []  # params.bad_words, tokenized
        self._emitted_tokens = 0  # for delta_* in outputs
        self._emitted_text = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` (0 <= start) without building all_ids (~1.5 us a call of a
        few hundred tokens, per sequence per step)."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (to be fed to the model)."""
        return len(self) - self.num_cached

    def pending_ids(self, n: int) -> list[int]:
        start = self.num_cached
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:start - p + n]
        return (self.prompt_ids[start:] + self.output_ids)[:n]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def to_output(self) -> RequestOutput:
        out = RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_ids, text=self.text,
            token_ids=list(self.output_ids), finish_reason=self.finish_reason,
            metrics=self.metrics, delta_text=self.text[self._emitted_text:],
            delta_token_ids=self.output_ids[self._emitted_tokens:], error=self.error,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = list(self.prompt_logprobs)
            out.prompt_logprob_ranks = list(self.prompt_ranks)
        self._emitted_tokens = len(self.output_ids)
        self._emitted_text = len(self.text)
        return out
