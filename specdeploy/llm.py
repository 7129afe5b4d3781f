"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specdeploy.config import SpecConfig
from specdeploy.engine import Engine, RequestOutput, SamplingParams
from specdeploy.tokenizer import eos_token_ids

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

Prompt = str | list[int]


class LLM:
    """Load a checkpoint (HF directory or `.gguf`; None = the embedded default model), deploy it
    and generate with continuous batching.

    Args:
        max_batch_size: sequences decoded together (state slots).
        max_seq_len: prompt + output tokens per sequence.
        max_num_tokens: tokens fed per step (longer prompts are prefilled in chunks).
        backend: "graph" (the deployed, cached program) or "eager" (the uncached reference).
        progress: print loading stages to stderr.
        enable_prefix_caching: share the KV pages (and recurrent-state checkpoints) of prompts
            that start alike (vLLM's name); `stats()` reports queries and hits.
        checkpoint_every: pages between recurrent-state checkpoints (hybrid models): a hit
            ends on a checkpointed boundary; fewer checkpoints cost less to write. None: the
            fewest pages spanning whole scan chunks (their states come free with the scan).
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto",
                 max_batch_size: int = 16, max_seq_len: int = 2048,
                 spec: SpecConfig | dict | None = None, page_size: int = 16,
                 max_cache_gib: float | None = None, max_num_tokens: int = 512,
                 backend: str = "graph", progress: bool = False, seed: int = 0,
                 quantize: str | None = None, compile: bool = False,
                 enable_prefix_caching: bool = True, checkpoint_every: int | None = None):
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens: must be a positive integer, got {max_num_tokens!r}")
        from specdeploy.deploy.build import BuildOptions, build

        options = BuildOptions(dtype=dtype, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, page_size=page_size,
                               max_cache_gib=max_cache_gib, spec=spec, backend=backend,
                               quantize=quantize, compile=compile,
                               enable_prefix_caching=enable_prefix_caching,
                               checkpoint_every=checkpoint_every)
        self.spec = spec = options.spec
        log = _stderr_log if progress else (lambda msg: None)
        if model is None:
            from specdeploy.default_model import default_model_path

            model = default_model_path()
        self.model_path = Path(model)
        t0 = time.perf_counter()
        log(f"loading tokenizer from {self.model_path}")
        from specdeploy.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        log(f"loading and deploying the model (backend={backend}, dtype={dtype})")
        self.deployed = build(self.model_path, options)
        lay = self.deployed.layout
        log(f"ready in {time.perf_counter() - t0:.1f}s: {lay.num_pages} pages x {lay.page_size} "
            f"tokens, {lay.num_slots} slots, cache {lay.total_bytes / 2**20:.1f} MiB")
        engine_cls = Engine
        if spec is not None:
            from specdeploy.engine.speculative import SpecEngine as engine_cls
        self.engine = engine_cls(
            self.deployed, self.tokenizer, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, seed=seed,
            eos_token_ids=eos_token_ids(self.tokenizer, self.deployed.hf_config, self.model_path))

    # ---- prompts --------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids")
        return list(prompt)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(self._encode(p), sp))
        except Exception:
            for rid in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort(rid)
            self.engine.step()
            raise
        return ids

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs are in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: no prompts given")
        sp = sampling_params or SamplingParams()
        params = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
        ids = self._add_all(prompts, params)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise ValueError("messages: empty conversation")
        return self.generate([self.chat_ids(c) for c in convs], sampling_params)

    def chat_ids(self, conversation: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        if not isinstance(out, str):
            return list(out)
        # The template already wrote any BOS/special tokens as text (as transformers does).
        return list(self.tokenizer.encode(out, add_special_tokens=False))

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield an output (cumulative `text`/`token_ids`, new part in `delta_*`) each time the
        request gains tokens; the last one has `finish_reason` set. Closing the iterator early
        aborts the request."""
        (rid,) = self._add_all([prompt], [sampling_params or SamplingParams()])
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)
                self.engine.step()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False when prefix caching is off."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        d = self.engine.stats_dict()
        lay = self.deployed.layout
        d.update(page_size=lay.page_size, num_slots=lay.num_slots, cache_bytes=lay.total_bytes)
        return d


def _stderr_log(msg: str) -> None:
    print(f"[specdeploy] {msg}", file=sys.stderr, flush=True)


