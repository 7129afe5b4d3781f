"""The step loop: schedule → propose → forward → verify → commit → append → draft → emit.

`step` is the whole loop in one screen; its hooks are what speculative decoding overrides:
`_segments` (what each sequence feeds: its pending tokens, or its last token and drafts),
`_verify` (the tokens each sequence gains: one sampled token here, accepted drafts plus a bonus
token with a drafter; one host synchronisation for the batch), `_commit` (how many tokens each
sequence now has cached, and any state promotion) and `_after_step` (drafting for the next
step). `_append` checks stops token by token, so a stop inside a multi-token run cuts it there.

Prefix caching (cache/prefix.py) adds two calls around the forward: `_prefix_before` restores
the recurrent states of admitted hits and asks the recurrent ops for checkpoints at the page
boundaries the step's NORMAL segments cross; `_prefix_after` registers the pages that are now
full of committed tokens.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import torch

from specdeploy.cache.metadata import SEG_NORMAL, Segment, build_metadata
from specdeploy.deploy.base import DeployedModel, StepOutput
from specdeploy.engine import prompt_logprobs
from specdeploy.engine.decode_burst import burst_len, run_burst
from specdeploy.engine.detokenizer import IncrementalDetokenizer
from specdeploy.engine.metrics import EngineStats
from specdeploy.engine.params_check import check_request
from specdeploy.engine.request import RequestOutput, SamplingParams, Sequence
from specdeploy.engine.sample_rows import sample_isolated
from specdeploy.engine.scheduler import ScheduledSeq, Scheduler, block_manager

log = logging.getLogger("specdeploy.engine")


class Engine:
    """Runs requests on a `DeployedModel`. `tokenizer` may be None (token ids only, no text)."""

    def __init__(self, deployed: DeployedModel, tokenizer=None, *, max_batch_size: int = 16,
                 max_num_tokens: int = 512, eos_token_ids: Iterable[int] = (), seed: int = 0):
        self.deployed = deployed
        self.tokenizer = tokenizer
        layout = deployed.layout
        self.blocks = block_manager(layout)  # (with the prefix cache and window page group)
        self.prefix = self.blocks.prefix
        # a finishing sequence's last pages are cached unless a drafter still owes their rows
        self._cache_on_finish = True
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_num_tokens,
                                   recurrent=layout.recurrent)
        if layout.recurrent and max_num_tokens < layout.page_size:
            log.warning(
                "max_num_tokens=%d is under a page (%d tokens): prompts longer than it are cut "
                "inside scan chunks, whose sums then depend on where the cuts fall (greedy "
                "speculative output may then differ from plain at near-ties)", max_num_tokens,
                layout.page_size)
        self.max_seq_len = deployed.max_seq_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.device = getattr(deployed, "device", torch.device("cpu"))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._grammar = None  # engine/grammar.py GrammarCompiler, built on first use
        self._grammar_lock = threading.Lock()
        self.threads = None  # engine/threads.py ThreadGovernor (LLM(threads="auto")), or None
        # decode steps run as bursts of up to this many graph replays, one host sync
        # each (engine/decode_burst.py; vLLM's num_scheduler_steps); 1: every step alone
        self.num_scheduler_steps = 1

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, mm=None, priority: int = 0) -> str:
        """Queue a request; raises ValueError (naming the parameter) if it can never run. `mm`
        (vision/prompt.py `MultimodalPrompt`) carries its images; `prompt_ids` are then its
        expanded ids. `priority`: lower runs first (the scheduler's policy "priority"; any
        other value than 0 is refused under "fcfs", as vLLM)."""
        params = params or SamplingParams()
        prompt_ids = check_request(self, prompt_ids, params, priority, mm)
        n = len(prompt_ids)
        matcher = None
        if params.structured:
            matcher = self.grammar_compiler().compile_key(params.grammar_key).matcher()
        if request_id is not None and request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        detok = None
        if self.tokenizer is not None:
            decode = self.tokenizer.decode
            if params.skip_special_tokens:
                def decode(ids, _d=self.tokenizer.decode):
                    return _d(ids, skip_special_tokens=True)
            detok = IncrementalDetokenizer(decode, prompt_ids)
        seq = Sequence(prompt_ids, params, detok, request_id, self.device)
        seq.priority = priority
        seq.mm = mm
        seq.matcher = matcher
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: needs the model's tokenizer")
            from specdeploy.engine.logits_process import bad_word_ids

            seq.bad_words_ids = bad_word_ids(self.tokenizer, params.bad_words)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += n
        return seq.request_id

    def grammar_compiler(self):
        """The structured-output compiler for this tokenizer (thread-safe: the server compiles
        a request's schema while parsing it, so a bad schema is a 400 and the engine thread
        finds it compiled)."""
        with self._grammar_lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("response_format: structured output needs a tokenizer")
                try:
                    from specdeploy.engine.grammar import GrammarCompiler
                except ImportError:
                    raise ValueError("response_format: structured output needs outlines-core "
                                     "(pip install outlines-core)") from None
                self._grammar = GrammarCompiler(self.tokenizer, self.deployed.vocab_size,
                                                self.eos_token_ids)
            return self._grammar

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        self._aborted.append(seq)
        self.stats.num_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch. Returns outputs of the sequences that gained
        tokens or finished this step (aborted ones included)."""
        t0 = time.perf_counter()
        touched = self._aborted
        self._aborted = []
        batch = self.scheduler.schedule()
        if batch and self.num_scheduler_steps > 1 and self._burst(batch, touched):
            return self._emit(touched, t0)
        if batch:
            segs = self._segments(batch)  # propose
            wide = prompt_logprobs.widen(batch, segs)  # None: no prompt logprobs this step
            self._prefix_before(batch, segs)
            meta = build_metadata(segs)  # host tensors: the deployment copies what it needs
            gov = self.threads
            if gov is not None:
                gov.before_step(meta.num_tokens)
            tf = time.perf_counter()
            out = self.deployed.forward(meta)  # forward
            if wide is not None:  # the prompt logprobs, then the rows the engine expects
                out = prompt_logprobs.take(wide, batch, segs, out)
            tokens = self._verify(batch, segs, out)  # verify (the step's one host sync)
            if gov is None or not gov.trialing:  # a trial step's time is another count's
                self._timed(segs, meta.num_tokens, time.perf_counter() - tf)
            if gov is not None:
                gov.after_step(meta.num_tokens, time.perf_counter() - tf)
            cached = self._commit(batch, segs, tokens)  # commit
            now = time.perf_counter()
            for sched, new in zip(batch, tokens):  # append
                seq = sched.seq
                if seq.finished:  # its verification failed (`fail`): it alone
                    touched.append(seq)
                elif new:
                    try:
                        self._append(seq, new, now)
                    except Exception as e:  # detokenizing / stop checks: fail it alone
                        self.fail(seq, e)
                    touched.append(seq)
            self._after_step(batch, segs, cached, out)  # draft the next step
            seen = {id(seq) for seq in touched}
            # NOTE: a sequence whose drafting failed (`fail`) mid-prefill gained no token: it
            # finished all the same, and its output must leave (else generate() waits on it)
            touched += [s.seq for s in batch if s.seq.finished and id(s.seq) not in seen]
            self._prefix_after(batch)
            self.stats.forward_time_s += time.perf_counter() - tf
            self._count_step(meta.num_tokens, len(batch))
        return self._emit(touched, t0)

    def _burst(self, batch: list[ScheduledSeq], touched: list[Sequence]) -> bool:
        """A burst of decode steps (engine/decode_burst.py) in place of this step;
        False when it cannot be one (nothing has run)."""
        n = burst_len(self, batch)
        tf = time.perf_counter()
        tokens = run_burst(self, batch, n) if n else None
        if tokens is None:
            return False
        now = time.perf_counter()
        for sched, new in zip(batch, tokens):
            seq = sched.seq
            for t in new:  # one at a time, as steps would (a stop drops the rest)
                seq.num_cached += 1  # the token fed before `t` is cached
                try:
                    self._append(seq, [t], now)
                except Exception as e:  # detokenizing / stop checks: fail it alone
                    self.fail(seq, e)
                if seq.finished:
                    break
            touched.append(seq)
        self._prefix_after(batch)
        self.stats.forward_time_s += time.perf_counter() - tf
        for _ in tokens[0]:
            self._count_step(len(batch), len(batch))
        return True

    def _timed(self, segs: list[Segment], rows: int, seconds: float) -> None:
        """A step's forward and verification took `seconds` (SpecEngine's controller learns
        from it)."""

    # ---- prefix caching ---------------------------------------------------------------------
    def _prefix_before(self, batch: list[ScheduledSeq], segs: list[Segment]) -> None:
        """Restore admitted hits' recurrent states (before anything could reuse their
        checkpoint slots), then plan this step's checkpoints of NORMAL segments."""
        if self.prefix is None:
            return
        if self.blocks.restores:
            slots, ckpts = zip(*self.blocks.restores)
            self.blocks.restores = []
            dev = self.device
            self.deployed.restore_states(torch.tensor(slots, device=dev),
                                         torch.tensor(ckpts, device=dev))
        for seg, s in zip(segs, batch):
            if seg.kind == SEG_NORMAL:
                seg.ckpt = self._checkpoints(s.seq, seg.cache_len, len(seg.token_ids))

    def _checkpoints(self, seq: Sequence, start: int, n: int) -> list[tuple[int, int]]:
        """(offset, slot) of each checkpointed boundary that tokens start..start+n-1 cross."""
        out = []
        for b in self.prefix.boundaries(start, n):
            slot = self.prefix.take_checkpoint(seq, b)
            if slot is not None:
                out.append((b - 1 - start, slot))
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. after writing the cache behind the engine's back);
        False when prefix caching is off."""
        self.blocks.reset_prefix_cache()
        return self.prefix is not None

    def _prefix_after(self, batch: list[ScheduledSeq]) -> None:
        if self.prefix is None:
            return
        for s in batch:
            if not s.seq.finished:
                self.prefix.register(s.seq, s.seq.num_cached)
        self.prefix.end_step()

    def _count_step(self, num_tokens: int, batch_size: int) -> None:
        self.stats.num_steps += 1
        self.stats.forward_tokens += num_tokens
        self.stats.max_running = max(self.stats.max_running, batch_size)

    def _emit(self, touched: list[Sequence], t0: float) -> list[RequestOutput]:
        """Outputs of the sequences a step touched; finished ones leave the engine."""
        self.stats.num_preemptions = self.scheduler.num_preemptions
        outputs = [s.to_output() for s in touched]
        for s in touched:
            if s.finished:
                self._seqs.pop(s.request_id, None)
        wall = time.perf_counter() - t0
        self.stats.step_time_s += wall
        self._stepped(wall)
        return outputs

    def _stepped(self, seconds: float) -> None:
        """The whole step took `seconds` (SpecEngine's controller learns its overhead)."""

    def _segments(self, batch: list[ScheduledSeq]) -> list[Segment]:
        segs = [Segment(token_ids=s.seq.pending_ids(s.num_tokens), cache_len=s.seq.num_cached,
                        pages=s.seq.pages, slot=s.seq.slot, num_logits=int(s.samples),
                        mm=s.seq.mm, win_pages=s.seq.win_pages)
                for s in batch]
        if not any(s.num_logits for s in segs):
            segs[-1].num_logits = 1  # NOTE: keeps N ≥ 1 for runners that cannot return [0, V]
        return segs

    def _verify(self, batch: list[ScheduledSeq], segs: list[Segment], out: StepOutput
                ) -> list[list[int]]:
        """Sample one token per sequence whose prefill completed; [] for mid-prefill chunks."""
        rows = [i for i, s in enumerate(batch) if s.samples]
        if not rows:
            return [[] for _ in batch]
        # Logit rows follow segment order, one per sampling segment (a forced row, see
        # `_segments`, only exists when nothing samples).
        logits = out.logits[: len(rows)]
        seqs = [batch[i].seq for i in rows]
        ids = sample_isolated(logits.float(), seqs, self.eos_token_ids, self.generator)
        result: list[list[int]] = [[] for _ in batch]
        for i, t in zip(rows, ids):
            if isinstance(t, Exception):
                self.fail(batch[i].seq, t)
            else:
                result[i] = [t]
        return result

    def _commit(self, batch: list[ScheduledSeq], segs: list[Segment],
                tokens: list[list[int]]) -> list[int]:
        """Every fed token is now cached. Returns the count per sequence."""
        for s in batch:
            s.seq.num_cached += s.num_tokens
        return [s.num_tokens for s in batch]

    def _after_step(self, batch: list[ScheduledSeq], segs: list[Segment], cached: list[int],
                    out: StepOutput) -> None:
        """Nothing to draft without a drafter."""

    # ---- appending and stopping -----------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int], now: float) -> None:
        p = seq.params
        m = seq.metrics
        new_lp, seq.new_logprobs = seq.new_logprobs, []
        for j, t in enumerate(tokens):
            if seq.matcher is not None:  # raises if the grammar forbids t: it alone fails
                seq.matcher.advance(t)
            seq.output_ids.append(t)
            if seq.logprobs is not None and j < len(new_lp):
                seq.logprobs.append(new_lp[j])
            self.stats.generated_tokens += 1
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            if (not p.ignore_eos and t in self.eos_token_ids) or t in p.stop_token_ids:
                self._finish(seq, "stop")  # the stop token is kept in token_ids, not in text
                return
            if seq.detok is not None:
                prev = len(seq.text)
                seq.text += seq.detok.add(t)
                # NOTE: vLLM checks stop strings only from min_tokens on, like stop tokens
                if p.stop and len(seq.output_ids) >= p.min_tokens and \
                        self._check_stop_strings(seq, prev):
                    return
            if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_seq_len:
                if seq.detok is not None:
                    seq.text += seq.detok.flush()
                self._finish(seq, "length")
                return

    def _check_stop_strings(self, seq: Sequence, prev: int) -> bool:
        for s in seq.params.stop:
            # Only text that just arrived (plus len(s)-1 before it) can complete a new match.
            at = seq.text.find(s, max(0, prev - len(s) + 1))
            if at >= 0:
                seq.text = seq.text[:at + (len(s) if seq.params.include_stop_str_in_output
                                           else 0)]
                self._finish(seq, "stop")
                return True
        return False

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish `seq` alone with finish_reason "error" (its pages are freed; the others and
        the engine's state are untouched). Subclasses call it for their per-sequence work."""
        log.error("request %s failed", seq.request_id, exc_info=exc)
        seq.error = f"{type(exc).__name__}: {exc}"
        if not seq.finished:
            self._finish(seq, "error")
        self.stats.num_errors += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.metrics.finish_time = time.perf_counter()
        if self.prefix is not None and self._cache_on_finish and seq.pages:
            self.prefix.register(seq, seq.num_cached)
        self.scheduler.finish(seq)
        self.stats.num_finished += 1

    def stats_dict(self) -> dict:
        d = self.stats.as_dict()
        d["num_waiting"] = len(self.scheduler.waiting)
        d["num_running"] = len(self.scheduler.running)
        d["free_pages"] = self.blocks.num_free  # cached pages nobody holds are free to reuse
        d["num_pages"] = self.blocks.num_pages
        w = self.blocks.window
        if w is not None:  # the sliding-window page group (cache/window.py)
            d.update(num_win_pages=w.num_pages, free_win_pages=w.num_free, win_pages_slid=w.slid,
                     page_bytes=self.deployed.layout.page_bytes,
                     win_page_bytes=self.deployed.layout.win_page_bytes)
        if self.prefix is not None:
            d.update(self.prefix.stats(), checkpoint_bytes=self.deployed.layout.checkpoint_bytes)
        if self.threads is not None:
            d.update(self.threads.as_dict())
        return d
