"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specdeploy.config import SpecConfig
from specdeploy.deploy.base import CacheLayout, DeployedModel
from specdeploy.engine import Engine, RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

Prompt = str | list[int]
BACKENDS = ("graph", "eager")


class LLM:
    """Load a checkpoint (HF directory or `.gguf`; None = the embedded default model), deploy it
    and generate with continuous batching.

    Args:
        max_batch_size: sequences decoded together (state slots).
        max_seq_len: prompt + output tokens per sequence.
        max_num_tokens: tokens fed per step (longer prompts are prefilled in chunks).
        backend: "graph" (the deployed, cached program) or "eager" (the uncached reference).
        progress: print loading stages to stderr.
        kernels: a GGUF file's Q4_0 / Q4_1 / Q8_0 linears: "fast" (integer dot products over
            8-bit activation blocks, as llama.cpp; greedy tokens may leave the fp32 model's where
            two candidates are close, see bench/fast_kernels_agreement.py) or "exact" (the fp32
            model bit for bit; what the tests against transformers use). No effect on others.
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto",
                 max_batch_size: int = 16, max_seq_len: int = 2048,
                 spec: SpecConfig | dict | None = None, page_size: int = 16,
                 max_cache_gib: float | None = None, max_num_tokens: int = 512,
                 backend: str = "graph", progress: bool = False, seed: int = 0,
                 quantize: str | None = None, compile: bool = False, kernels: str = "fast"):
        for name, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                        ("page_size", page_size), ("max_num_tokens", max_num_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if max_cache_gib is not None and max_cache_gib <= 0:
            raise ValueError(f"max_cache_gib: must be > 0, got {max_cache_gib!r}")
        if isinstance(spec, dict):
            spec = SpecConfig(**spec)
        self.spec = spec
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
        self.deployed = _build_deployed(
            self.model_path, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            page_size=page_size, max_cache_gib=max_cache_gib, spec=spec, backend=backend, log=log,
            quantize=quantize, compile=compile, kernels=kernels)
        lay = self.deployed.layout
        log(f"ready in {time.perf_counter() - t0:.1f}s: {lay.num_pages} pages x {lay.page_size} "
            f"tokens, {lay.num_slots} slots, cache {lay.total_bytes / 2**20:.1f} MiB")
        engine_cls = Engine
        if spec is not None:
            from specdeploy.engine.speculative import SpecEngine as engine_cls
        self.engine = engine_cls(
            self.deployed, self.tokenizer, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, seed=seed,
            eos_token_ids=_eos_ids(self.tokenizer, self.deployed.hf_config, self.model_path))

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
        return self.generate([self._chat_ids(c) for c in convs], sampling_params)

    def _chat_ids(self, conversation: list[dict]) -> list[int]:
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

    def stats(self) -> dict:
        d = self.engine.stats_dict()
        lay = self.deployed.layout
        d.update(page_size=lay.page_size, num_slots=lay.num_slots, cache_bytes=lay.total_bytes)
        return d


def _stderr_log(msg: str) -> None:
    print(f"[specdeploy] {msg}", file=sys.stderr, flush=True)


def _eos_ids(tokenizer, hf_config: dict, path: Path) -> set[int]:
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
    return ids


def _build_deployed(path: Path, *, dtype: str, max_batch_size: int, max_seq_len: int,
                    page_size: int, max_cache_gib: float | None, spec: SpecConfig | None,
                    backend: str, log=lambda msg: None, quantize: str | None = None,
                    compile: bool = False, kernels: str = "exact") -> DeployedModel:
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize: must be None or 'int8', got {quantize!r}")
    if backend != "graph" and (quantize or compile):
        raise ValueError("quantize/compile: need the graph backend")
    if backend == "graph":
        if importlib.util.find_spec("specdeploy.deploy.pipeline") is not None:
            from specdeploy.deploy.pipeline import deploy_model

            return deploy_model(path, dtype=dtype, max_batch_size=max_batch_size,
                                max_seq_len=max_seq_len, page_size=page_size,
                                max_cache_gib=max_cache_gib, spec=spec, quantize=quantize,
                                compile=compile, kernels=kernels)
        log("graph backend not available yet: using the eager reference runner")
    if spec is not None:
        raise ValueError("spec: speculative decoding needs the graph backend")
    from specdeploy.checkpoint import open_checkpoint
    from specdeploy.deploy.eager import EagerDeployed
    from specdeploy.loading import load_model_from_reader

    reader = open_checkpoint(path)
    model = load_model_from_reader(reader, dtype)
    cfg = reader.config.get("text_config", reader.config)
    vocab = int(cfg.get("vocab_size") or model.get_output_embeddings().out_features)
    layout = _eager_layout(cfg, max_batch_size, max_seq_len, page_size, max_cache_gib,
                           next(model.parameters()).element_size())
    return EagerDeployed(model, vocab, max_seq_len, reader.config, layout)


def _eager_layout(cfg: dict, max_batch_size: int, max_seq_len: int, page_size: int,
                  max_cache_gib: float | None, elem: int) -> CacheLayout:
    """The eager runner keeps no cache, but the engine still plans pages as if it did (so the
    scheduler behaves as with the real cache): bytes per page = K and V of every layer."""
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", heads) // heads
    kv = cfg.get("num_key_value_heads", heads)
    page_bytes = 2 * cfg.get("num_hidden_layers", 1) * kv * head_dim * page_size * elem
    if max_cache_gib is None:
        num_pages = max_batch_size * -(-max_seq_len // page_size)
    else:
        num_pages = int(max_cache_gib * 2**30 // page_bytes)
    if num_pages < 1:
        raise ValueError(f"max_cache_gib: {max_cache_gib} GiB holds no page of {page_bytes} bytes")
    return CacheLayout(page_size, num_pages, max_batch_size, {"kv_eager_estimate":
                                                              num_pages * page_bytes})
