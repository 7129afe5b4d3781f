"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specdeploy.chat_template import chat_ids
from specdeploy.config import SpecConfig
from specdeploy.distributed.config import dist_config
from specdeploy.engine import Engine, RequestOutput, SamplingParams
from specdeploy.llm_setup import check_engine_args, install_step_graphs
from specdeploy.progress import progress_bar, stderr_log, token_rate
from specdeploy.prompt_batch import prompt_batch
from specdeploy.tokenizer import eos_token_ids

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

Prompt = str | list[int] | dict  # dict: vLLM's {"prompt", "multi_modal_data"} (prompt_batch.py)


class LLM:
    """Load a checkpoint (HF directory or `.gguf`; None = the embedded default model), deploy it
    and generate with continuous batching.

    Args:
        model: a HF directory, a `.gguf` file, or a Hub id (`org/name`) already in the local
            Hugging Face cache (never downloaded).
        max_batch_size: sequences decoded together (state slots); `max_num_seqs` is vLLM's
            name for it.
        max_model_len / max_seq_len (the same): prompt + output tokens per sequence; default
            the model's `max_position_embeddings`, at most 2048 (model_defaults.py).
        generation_config: "auto" (the checkpoint's generation_config.json sampling defaults
            apply where a request leaves them unset), "vllm" (ignore it) or a directory.
        spec / speculative_config (vLLM's dict: method, model, num_speculative_tokens, ...).
        max_num_tokens: tokens fed per step (longer prompts are prefilled in chunks).
        backend: "graph" (the deployed, cached program) or "eager" (the uncached reference).
        progress: print loading stages to stderr.
        device: "cpu" (default), "cuda" or "cuda:N"; dtype "auto" is bfloat16 on CUDA.
        kernels: GGUF Q4_0/Q4_1/Q8_0 linears on the CPU: "fast" (default: 8-bit activations,
            integer dot products, as llama.cpp) or "exact" (the fp32 model, bit for bit: the
            oracle against transformers). Other weights are unaffected.
        kv_cache_dtype: "auto" (bfloat16 with kernels="fast" on the CPU, else the model dtype),
            "float32", "bfloat16", "float16", or "fp8" / "fp8_e4m3" (float8_e4m3fn, 1 byte a
            value, saturating at +-448, scale 1.0 unless the checkpoint ships k/v scales: vLLM's
            `--kv-cache-dtype fp8`; the CPU's C attention reads it exactly) or "fp8_e5m2". The
            KV cache is planned for max_batch_size x max_seq_len (capped by max_cache_gib); on
            the CPU its memory is backed as written.
        max_cache_gib: the caches' budget in GiB. gpu_memory_utilization (vLLM's knob, in
            (0, 1]): the fraction of the device's total memory (the machine's, on the CPU) this
            instance may hold, weights and whatever else already uses the device included; the
            caches get the rest (cache/plan.py `cache_budget`; activations not reserved). At most
            one of the two; neither: half the memory free after loading.
        cuda_graphs: replay decode and verify steps as CUDA graphs, one per batch-size bucket
            (engine/cuda_graphs.py). None (default): on for a CUDA device wherever the runner
            can serve (not with tensor parallelism: eager there);
            True: required (refused where it cannot serve); False: eager (vLLM's enforce_eager).
        cpu_graphs: on the CPU, replay decode and verify steps as recorded kernel calls, one
            recording per batch-size bucket (engine/cpu_graphs.py: the graph's Python runs
            once per bucket, not every step). None (default): on for a CPU device wherever the
            runner can serve and steps are not eager (cuda_graphs=False), not with
            threads="auto" (its trial steps), not with SPECDEPLOY_CPU_GRAPHS=0; True: required;
            False: off. A step a recording refuses runs eagerly.
        num_scheduler_steps: decode steps run as bursts of up to this many CUDA-graph
            replays with one host sync each (vLLM's multi-step scheduling;
            engine/decode_burst.py): tokens stream in groups, the host's work overlaps the
            GPU's. 1 (default): every step alone. Needs CUDA graphs (or, on the CPU, CPU graphs:
            the burst's steps replay there) to take effect.
        scheduling_policy: "fcfs" (default: arrival order) or "priority" (vLLM's: requests
            ordered by their `priority`, lower first, then arrival; a full cache preempts the
            least urgent; engine/scheduler.py).
        tensor_parallel_size / expert_parallel_size: ranks (worker processes started here, or
            the processes of a torchrun launch) and MoE expert groups among them; rank 0 runs the
            engine. Under torchrun, a rank > 0 serves as a worker inside this constructor and
            exits the process when rank 0 is done.
        shard_layers: the layer types sharded (default all: mha, ssm, delta, mlp, moe, lm_head);
            the others are replicated on every rank.
        dist_timeout: seconds a collective may wait before a dead or hung rank fails the step.
        enable_prefix_caching: share the KV pages (and recurrent-state checkpoints) of prompts
            that start alike (vLLM's name); `stats()` reports queries and hits.
        page_size: tokens per KV page; None: 16, or the scan chunk for hybrid models (64 for
            Mamba2 / gated delta), so each page boundary's recurrent states come free.
        checkpoint_every: pages between recurrent-state checkpoints (hybrid models): a hit
            ends on a checkpointed boundary. None: every page when memory allows (the cache
            plan in `deploy --list-transforms` says when it spaced them out).
        mmproj: a text GGUF's vision tower, llama.cpp's mmproj GGUF (its `--mmproj`; a
            Qwen3.5-MoE text GGUF with its Qwen3.5 tower): the deployment takes images as the
            released checkpoint does. mm_processor_kwargs (vLLM's): the image resize's
            `min_pixels` / `max_pixels` (an mmproj says neither: the released Qwen3.5
            preprocessor's by default) and the video sampling's `fps`, `min_frames`,
            `max_frames`, `do_sample_frames`. mm_encoder_dtype: the vision tower's dtype; "auto"
            (default): the model's, but bfloat16 on a CPU with native bf16 matmuls (AMX,
            AVX512-BF16) when the tower's values are bfloat16 (its own precision, ~3x faster).
            limit_mm_per_prompt (vLLM's): {"image": N, "video": M}, the most of each one
            prompt may carry (None: no limit).
        threads: CPU threads: None (torch's setting), a count, or "auto": that many (torch's
            setting) or 1, whichever the engine measures faster now (engine/threads.py: on a
            machine shared with other work, N threads can collapse at their barriers). "auto"
            needs kernels="fast" on the CPU (thread-invariant kernels: the same tokens either
            way).
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto",
                 max_batch_size: int = 16, max_seq_len: int | None = None,
                 spec: SpecConfig | dict | None = None, page_size: int | None = None,
                 max_cache_gib: float | None = None, max_num_tokens: int = 512,
                 backend: str = "graph", progress: bool = False, seed: int = 0,
                 quantize: str | None = None, compile: bool = False, device: str = "cpu",
                 kernels: str = "fast", tensor_parallel_size: int = 1,
                 expert_parallel_size: int = 1, shard_layers: tuple[str, ...] | None = None,
                 dist_timeout: float = 60.0, enable_prefix_caching: bool = True,
                 checkpoint_every: int | None = None, max_model_len: int | None = None,
                 generation_config: str | os.PathLike | None = "auto",
                 speculative_config: dict | SpecConfig | None = None,
                 max_num_seqs: int | None = None, kv_cache_dtype: str = "auto",
                 gpu_memory_utilization: float | None = None, cuda_graphs: bool | None = None,
                 threads: int | str | None = None, num_scheduler_steps: int = 1,
                 scheduling_policy: str = "fcfs", cpu_graphs: bool | None = None,
                 mmproj: str | os.PathLike | None = None,
                 mm_processor_kwargs: dict | None = None, mm_encoder_dtype: str = "auto",
                 limit_mm_per_prompt: dict | None = None):
        check_engine_args(threads=threads, kernels=kernels, device=device,
                          scheduling_policy=scheduling_policy, cuda_graphs=cuda_graphs,
                          cpu_graphs=cpu_graphs, max_num_tokens=max_num_tokens,
                          num_scheduler_steps=num_scheduler_steps)
        import torch

        if isinstance(threads, int):  # before loading: the build's kernels use them too
            torch.set_num_threads(threads)
        from specdeploy.checkpoint import open_checkpoint
        from specdeploy.checkpoint.hub import resolve_model_path
        from specdeploy.deploy.build import BuildOptions, build
        from specdeploy.model_defaults import generation_defaults, resolve_max_len

        if speculative_config is not None:
            if spec is not None:
                raise ValueError("speculative_config: give spec or speculative_config, not both")
            spec = speculative_config
        if isinstance(spec, dict):
            spec = SpecConfig.from_dict(spec)
        if max_num_seqs is not None:
            max_batch_size = max_num_seqs
        if model is None:
            from specdeploy.default_model import default_model_path

            model = default_model_path()
        model = resolve_model_path(model)  # a shipped name, a Hub id
        reader = open_checkpoint(model)
        from specdeploy.loading import refuse_mmproj

        refuse_mmproj(reader)
        max_seq_len = resolve_max_len(reader.config, max_model_len, max_seq_len)
        from specdeploy.spec_auto import resolve_auto

        spec = resolve_auto(spec, model, str(device).split(":")[0])

        options = BuildOptions(dtype=dtype, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, page_size=page_size,
                               max_cache_gib=max_cache_gib, spec=spec, backend=backend,
                               gpu_memory_utilization=gpu_memory_utilization,
                               quantize=quantize, compile=compile, device=device,
                               kernels=kernels, kv_cache_dtype=kv_cache_dtype,
                               dist=dist_config(tensor_parallel_size, expert_parallel_size,
                                                 shard_layers),
                               enable_prefix_caching=enable_prefix_caching,
                               checkpoint_every=checkpoint_every, progress=progress,
                               mmproj=None if mmproj is None else str(mmproj),
                               mm_processor_kwargs=mm_processor_kwargs,
                               mm_encoder_dtype=mm_encoder_dtype,
                               limit_mm_per_prompt=limit_mm_per_prompt)
        self.spec = spec = options.spec
        log = stderr_log if progress else (lambda msg: None)
        self.model_path = Path(model)
        self.max_model_len = max_seq_len
        self.sampling_defaults = generation_defaults(self.model_path, generation_config)
        t0 = time.perf_counter()
        log(f"loading tokenizer from {self.model_path}")
        from specdeploy.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        log(f"loading and deploying the model (backend={backend}, dtype={dtype})")
        if options.dist is None:
            self.deployed = build(self.model_path, options)
        else:
            from specdeploy.distributed.runtime import build_ranked

            self.deployed = build_ranked(self.model_path, options, dist_timeout)
            if self.deployed is None:  # a torchrun rank > 0: rank 0 has stopped it
                sys.exit(0)
        lay = self.deployed.layout
        log(f"ready in {time.perf_counter() - t0:.1f}s: {lay.num_pages} pages x {lay.page_size} "
            f"tokens, {lay.num_slots} slots, cache {lay.total_bytes / 2**20:.1f} MiB")
        install_step_graphs(self.deployed, max_batch_size, device=device,
                            cuda_graphs=cuda_graphs, cpu_graphs=cpu_graphs, threads=threads,
                            compile=compile, log=log)
        engine_cls = Engine
        if spec is not None:
            from specdeploy.engine.speculative import SpecEngine as engine_cls
        self.engine = engine_cls(
            self.deployed, self.tokenizer, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, seed=seed,
            eos_token_ids=eos_token_ids(self.tokenizer, self.deployed.hf_config, self.model_path))
        self.engine.num_scheduler_steps = num_scheduler_steps
        self.engine.scheduler.set_policy(scheduling_policy)
        if num_scheduler_steps > 1 and (spec is not None
                                        or getattr(self.deployed, "graph_runner", None) is None):
            why = "speculative steps verify drafts" if spec is not None else "no CUDA graphs"
            log(f"num_scheduler_steps={num_scheduler_steps}: every step alone ({why})")
        if threads == "auto" and torch.get_num_threads() > 1:
            from specdeploy.engine.threads import ThreadGovernor

            self.engine.threads = ThreadGovernor(torch.get_num_threads(), 1,
                                                 set_threads=torch.set_num_threads,
                                                 get_threads=torch.get_num_threads)

    # ---- prompts --------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids")
        return list(prompt)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams],
                 images: list[list] | None = None, priority: list[int] | None = None,
                 videos: list[list] | None = None, kwargs: list | None = None) -> list[str]:
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        if priority is not None and (not isinstance(priority, (list, tuple))
                                     or len(priority) != len(prompts)):
            raise ValueError(f"priority: give one per prompt ({len(prompts)})")
        for name, media in (("images", images), ("videos", videos)):
            if media is not None and len(media) != len(prompts):
                raise ValueError(f"{name}: got {len(media)} lists for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                tokens, mm = self._encode(p), None
                imgs = images[i] if images is not None else None
                clips = videos[i] if videos is not None else None
                if imgs or clips:
                    from specdeploy.vision.chat import build_prompt

                    mm = build_prompt(self.deployed, tokens, imgs or [], f"prompt {i}",
                                      clips or [], self._encode_text,
                                      kwargs[i] if kwargs is not None else None)
                    tokens = mm.ids
                ids.append(self.engine.add_request(
                    tokens, sp, mm=mm, priority=0 if priority is None else priority[i]))
        except Exception:
            for rid in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort(rid)
            self.engine.step()
            raise
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- generation -----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without `sampling_params` samples with: greedy, unless the
        checkpoint's generation_config.json says otherwise (`generation_config=`)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 images: list | None = None, *, use_tqdm: bool = False,
                 priority: list[int] | None = None, videos: list | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs are in prompt order. `use_tqdm`: a
        progress bar of finished requests and tokens/s on stderr. `priority` (vLLM's; needs
        `scheduling_policy="priority"`): one per prompt, lower runs first. `images` (a VLM):
        the images of one prompt, or one list per prompt (PIL images, paths, file:// or data
        URLs, bytes), each filling one image placeholder of its prompt in order (the chat
        template's `<|vision_start|><|image_pad|><|vision_end|>`). `videos` likewise fill the
        `<|video_pad|>` placeholders: video files (paths, file:// or data URLs, bytes; PyAV
        decodes them) or decoded frames (vision/video.py). A prompt may also be vLLM's dict,
        {"prompt": ..., "multi_modal_data": {"image": ..., "video": ...},
        "mm_processor_kwargs": {...}} (its own preprocessing, e.g. {"fps": 1})."""
        single, prompts, images, videos, kwargs = prompt_batch(prompts, images, videos)
        sp = sampling_params or self.get_default_sampling_params()
        params = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
        if single and priority is not None and not isinstance(priority, (list, tuple)):
            priority = [priority]
        ids = self._add_all(prompts, params, images, priority, videos, kwargs)
        done: dict[str, RequestOutput] = {}
        bar = progress_bar(len(ids)) if use_tqdm else None
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if bar is not None and out.delta_token_ids:
                        bar.set_postfix_str(f"{token_rate(bar, len(out.delta_token_ids))} tok/s")
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a failed step must not leave these queued for the next call
            for rid in ids:
                self.engine.abort(rid)
            self.engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False, **template) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. Content may be a
        list of OpenAI-style parts: text, and (a VLM) `image_url` parts with a data URL, a local
        path or file:// URL, or {"type": "image", "image": <PIL image>}; `video_url` parts or
        {"type": "video", "video": <file or frames>} (vision/video.py). `template`: as
        `chat_ids` (add_generation_prompt, continue_final_message, chat_template,
        chat_template_kwargs, tools)."""
        from specdeploy.vision.chat import split_media

        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise ValueError("messages: empty conversation")
        split = [split_media(c) for c in convs]
        images = [imgs for _, imgs, _ in split]
        videos = [clips for _, _, clips in split]
        return self.generate([self.chat_ids(c, **template) for c, _, _ in split],
                             sampling_params, images if any(images) else None,
                             use_tqdm=use_tqdm, videos=videos if any(videos) else None)

    def chat_ids(self, conversation: list[dict], *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None, tools: list | None = None
                 ) -> list[int]:
        """The prompt ids of a conversation (vLLM's names): `continue_final_message` leaves the
        last (assistant) message open to be continued; `chat_template_kwargs` are template
        variables (e.g. {"enable_thinking": False} for Qwen3.5); `tools` are written by
        templates that describe tools (no tool-call parsing happens)."""
        if not hasattr(self.deployed, "image_features"):
            from specdeploy.vision.chat import text_only

            conversation = text_only(conversation)
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        return chat_ids(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        chat_template=chat_template, template_kwargs=kwargs)

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield an output (cumulative `text`/`token_ids`, new part in `delta_*`) each time the
        request gains tokens; the last one has `finish_reason` set. Closing the iterator early
        aborts the request."""
        (rid,) = self._add_all([prompt], [sampling_params or self.get_default_sampling_params()])
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

    def shutdown(self) -> None:
        """Stop the worker ranks (tensor parallelism); also done at interpreter exit."""
        close = getattr(self.deployed, "close", None)
        if close is not None:
            close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False when prefix caching is off."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        d = self.engine.stats_dict()
        lay = self.deployed.layout
        d.update(page_size=lay.page_size, num_slots=lay.num_slots, cache_bytes=lay.total_bytes)
        from specdeploy.deploy.memory import process_memory

        programs = [getattr(self.deployed, "target", self.deployed),
                    *getattr(self.deployed, "drafts", ())]
        d["weight_bytes"] = sum(p.weight_bytes().total for p in programs
                                if hasattr(p, "weight_bytes"))
        d.update({f"{k}_bytes": v for k, v in process_memory().items()})
        return d
