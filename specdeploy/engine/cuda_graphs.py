"""CUDA-graph replay of decode and verify steps, one graph per batch-size bucket and tokens per
sequence (as vLLM and TensorRT-LLM AutoDeploy do): a step of B sequences is padded to the
smallest bucket >= B with dummy rows that write only the cache plan's scratch page and slot
(cache/padding.py), its metadata copied into the graph's static input buffer, and the graph
captured for that shape replayed.

Which steps replay: uniform steps with no prefix-cache checkpoint to save, every sequence
continuing its cache: decode steps (one token each, NORMAL) and verify steps (1 + K tokens each,
EXTEND; off the CPU their attention is `extend_uniform`, whose shapes do not depend on host-side
lengths). A vision-language target's graph takes input embeddings and multimodal positions: its
runner copies the step's embedding rows into a static buffer (as a drafter's hidden rows) and
feeds the positions of its image requests; a step that merges image features (a prefill) does
not replay. Every other step (prefill chunks, mixed steps, verify steps whose sequences verify
different numbers of drafts, more sequences than the largest bucket) runs eagerly as before.
The page table is widened to a page-width bucket (the smallest power of two >= the step's
widest row, capped at max_seq_len's pages; `widths`), a graph captured per (batch bucket,
tokens, kind, width): attention's work off the CPU follows the table's width, so a graph of
max_seq_len's pages would make every short step pay for the longest context, where these cost
at most twice the step's own (a few more captures, log2 of the pages).

On by default on a CUDA device (`LLM(cuda_graphs=None)`); tests/cuda/test_cuda_graphs.py (greedy
output with graphs equals eager, speculative equals plain, no host sync in a replay) passed on an
H200 (bench/gpu_check.sh). On the CPU, `capture=True` records CPU graphs instead
(engine/cpu_graphs.py: the kernel calls and torch ops of the step, replayed without the graph's
Python; on by default there, `LLM(cpu_graphs=None)`); a bucket whose capture refuses runs
eagerly (`refused` says why). With `capture=False` the padded, static-shaped steps run eagerly,
and tests/engine/test_cuda_graphs.py checks that they leave greedy output unchanged.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

from specdeploy.cache.metadata import SEG_EXTEND, SEG_NORMAL, BatchMetadata, Segment, build_metadata
from specdeploy.cache.padding import DUMMY_LEN, bucket_of, buckets_for, pad_batch, uniform_step
from specdeploy.deploy.base import StepOutput
from specdeploy.engine.graph_feed import flat_feed, flat_feed_win, static_width, uniform_shape
from specdeploy.ops.cached_attention import UNIFORM_MAX

CPU_MAX_BATCH = 4  # CPU graphs replay steps of up to this many sequences


@dataclass
class _Captured:
    graph: object  # torch.cuda.CUDAGraph
    flat: torch.Tensor  # the static device buffer of the bucket's int64 metadata
    out: tuple  # the graph's static outputs (overwritten by every replay)
    hidden: torch.Tensor | None = None  # a drafter graph's static hidden input [bucket * n, H]


class CudaGraphRunner:
    """Installed on a target `GraphDeployed` (`install`); `run(meta)` returns the step's
    output, or None for a step it does not take (the deployment then runs it eagerly)."""

    def __init__(self, target, max_batch_size: int, buckets: tuple[int, ...] | None = None,
                 capture: bool | None = None):
        self.target = target
        plan = target.plan
        self.scratch_page, self.scratch_slot = plan.scratch_page, plan.scratch_slot
        # the window page group's (cache/window.py), where the graph reads one
        self.win = "page_table_win" in target._input_names
        self.scratch_win = plan.scratch_page_win
        self.page_size = plan.page_size
        self.max_pages = -(-target.max_seq_len // plan.page_size)
        # NOTE: on the CPU one width, the widest: the C attention's work follows the lengths,
        # not the table's width, and one recording a bucket holds less memory than nine
        cpu = (target.device.type == "cuda" if capture is None else capture) and (
            target.device.type == "cpu")
        self.widths = (self.max_pages,) if cpu else page_widths(self.max_pages)
        top = min(max_batch_size, plan.num_slots)
        self.buckets = buckets_for(top) if buckets is None else tuple(sorted(buckets))
        if cpu and buckets is None:
            # NOTE: on the CPU every batch size its own recording, up to CPU_MAX_BATCH: a
            # padded row costs a real row's arithmetic there, and above a few sequences the
            # step's Python is shared by as many tokens (16 requests at once ran 0.86x eager
            # with power-of-two buckets: bench/results/vs_llamacpp_concurrent_cpugraphs_*)
            self.buckets = tuple(range(1, min(top, CPU_MAX_BATCH) + 1))
        self.capture = target.device.type == "cuda" if capture is None else capture
        # on the CPU, capture means CPU graphs (engine/cpu_graphs.py): recorded kernel calls
        self.cpu = cpu
        self.refused: dict[tuple, str] = {}  # CPU graphs a capture refused: key -> why
        # (bucket, tokens, kind, page width)
        self._graphs: dict[tuple[int, int, int, int], _Captured] = {}
        self._pool = None
        self.replays = 0  # steps this runner took (stats and tests)
        self.captures = 0  # graphs captured (or refused): a step that did is no timing
        self.replays_by_tokens: Counter[int] = Counter()  # by tokens per sequence
        # a drafter program takes the target's hidden rows as its third input, a
        # vision-language target its input embeddings
        self.takes_hidden = "hidden" in target._input_names
        self.vocab = target.vocab_size

    def bucket(self, meta: BatchMetadata) -> int | None:
        """The bucket a step replays in, or None when it runs eagerly (see the module doc)."""
        if meta.mm_rows:  # rows whose image features the wrapper merges: a prefill's
            return None
        h = meta.lists  # the host lists when there are (engine/graph_feed.py), else tensors
        if h is not None:
            if h.ckpt_tokens:
                return None
            shape, kind, fresh = uniform_shape(h), h.kinds[0], min(h.cache_lens) <= 0
        else:
            if meta.ckpt_tokens.numel():
                return None
            shape, kind = uniform_step(meta), int(meta.seg_kind[0])
            fresh = not bool((meta.cache_lens > 0).all())
        decode = shape == (1, 1) and kind == SEG_NORMAL
        verify = shape is not None and kind == SEG_EXTEND and shape[0] == shape[1] <= UNIFORM_MAX
        if not (decode or verify):
            return None
        if h is not None:
            width = max(h.max_pages, h.max_win_pages)
        else:
            win = meta.page_table_win
            width = max(meta.page_table.shape[1], 0 if win is None else win.shape[1])
        if fresh or width > self.max_pages:
            return None  # NOTE: a decode always follows a prefill; the check keeps it honest
        return bucket_of(meta.num_seqs, self.buckets)

    @torch.inference_mode()
    def run(self, meta: BatchMetadata, hidden: torch.Tensor | None = None,
            ids: torch.Tensor | None = None) -> StepOutput | None:
        """`hidden` [T, H]: a drafter step's input rows (a drafter program's runner only).
        `ids` [S] (a decode step, on the device): the input tokens, in place of the metadata's
        (engine/decode_burst.py: the previous step's argmax, never read by the host)."""
        if self.takes_hidden != (hidden is not None):
            return None
        bucket = self.bucket(meta)
        if bucket is None or (ids is not None and (meta.num_tokens != meta.num_seqs
                                                   or ids.shape != (meta.num_seqs,))):
            return None
        if not self.capture:  # the CPU check: the same padded, static-shaped step, eagerly
            if hidden is not None:  # dummy rows: zeros, as in a captured graph's buffer
                pad = bucket * (meta.num_tokens // meta.num_seqs) - hidden.shape[0]
                hidden = torch.cat((hidden, hidden.new_zeros(pad, hidden.shape[1])))
            static = self._static(meta, bucket)
            if ids is not None:
                static = replace(static, input_ids=torch.cat(
                    (ids.to(static.input_ids), static.input_ids[ids.numel():])))
            out = self.target._fn(*self.target._feed(static, hidden))
        else:
            n, flat = meta.num_tokens // meta.num_seqs, None
            if meta.lists is not None:  # host lists: the buffer in Python (graph_feed.py)
                width = static_width(meta.lists, n, bucket, self.page_size, self.widths)
                flat = torch.tensor(self.feed(meta, bucket, width), dtype=torch.long)
            else:
                static = self._static(meta, bucket)
                width = static.page_table.shape[1]
            kind = meta.lists.kinds[0] if meta.lists is not None else int(meta.seg_kind[0])
            key = (bucket, n, kind, width)
            if self.cpu and (key in self.refused or not self._ids_fit(meta, ids)):
                return None
            cap = self._graphs.get(key) or self._capture(*key, hidden=hidden)
            if cap is None:  # a CPU capture refused: eager
                return None
            if hidden is not None:  # device to device, in stream order
                cap.hidden[:hidden.shape[0]].copy_(hidden)
            if flat is None:
                flat = torch.cat([t.reshape(-1)
                                  for t in self.target.device_inputs(static).values()])
            cap.flat.copy_(flat if self.cpu else flat.pin_memory(), non_blocking=not self.cpu)
            if ids is not None:  # input_ids lead the buffer (graph_feed.flat_feed's order)
                cap.flat[:ids.numel()].copy_(ids)
            cap.graph.replay()
            out = cap.out
        self.replays += 1
        self.replays_by_tokens[meta.num_tokens // meta.num_seqs] += 1
        return _real_rows(out, meta)

    def feed(self, meta: BatchMetadata, bucket: int, width: int) -> list[int]:
        """The graph's flat input buffer of a step with host lists (graph_feed.flat_feed)."""
        slots = "slot_mapping" in self.target._input_names
        pages = self.target.layout.num_pages > 0  # none: no KV, its slots all -1 (as eager)
        mrope = self.target.mrope
        axes = meta.mrope_positions.tolist() if mrope and meta.mrope_positions is not None \
            else None  # (a host tensor: the multimodal positions of an image request)
        out = flat_feed(meta.lists, bucket, width, page_size=self.page_size,
                        scratch_page=self.scratch_page, scratch_slot=self.scratch_slot,
                        mrope=mrope, slot_mapping=slots and pages, mrope_pos=axes)
        if slots and not pages:
            out += [-1] * (bucket * (meta.num_tokens // meta.num_seqs))
        if self.win:
            out += flat_feed_win(meta.lists, bucket, width, page_size=self.page_size,
                                 scratch_page=self.scratch_win)
        return out

    def _static(self, meta: BatchMetadata, bucket: int) -> BatchMetadata:
        """Padded to the bucket, the page table widened to its page-width bucket (dummy rows:
        the scratch page; real rows: 0, masked by their cache length as before)."""
        meta = pad_batch(meta, bucket, scratch_page=self.scratch_page,
                         scratch_slot=self.scratch_slot, page_size=self.page_size,
                         scratch_page_win=self.scratch_win)
        win = meta.page_table_win
        width = bucket_of(max(meta.page_table.shape[1], 0 if win is None else win.shape[1]),
                          self.widths)
        is_dummy = meta.slot_idx == self.scratch_slot
        tables = []
        for t, scratch in ((meta.page_table, self.scratch_page), (win, self.scratch_win)):
            if t is not None:
                table = torch.zeros(bucket, width, dtype=torch.long)
                table[:, :t.shape[1]] = t
                table[is_dummy] = scratch
            tables.append(None if t is None else table)
        return replace(meta, page_table=tables[0], page_table_win=tables[1], lists=None)

    def _ids_fit(self, meta: BatchMetadata, ids: torch.Tensor | None) -> bool:
        """Whether the step's token ids lie in the vocabulary (a CPU graph reads them by pointer,
        unchecked; the eager step names a bad one)."""
        vals = ids if ids is not None else (
            meta.lists.ids if meta.lists is not None else meta.input_ids)
        if isinstance(vals, torch.Tensor):
            return not vals.numel() or (0 <= int(vals.min()) and int(vals.max()) < self.vocab)
        return not vals or (0 <= min(vals) and max(vals) < self.vocab)

    def _capture(self, bucket: int, n: int, kind: int, width: int,
                 hidden: torch.Tensor | None = None) -> _Captured | None:
        """Capture with every row a dummy (only the scratch is written while warming up and
        capturing), after two warm-up runs on a side stream (lazy initialisation, workspace).
        A drafter's graph reads its hidden rows from a static buffer shaped like `hidden`'s."""
        self.captures += 1
        dummy = Segment([0] * n, DUMMY_LEN, [self.scratch_page] * width,
                        self.scratch_slot, n, kind,
                        win_pages=[self.scratch_win] * width if self.win else ())
        meta = build_metadata([dummy] * bucket)
        host = self.target.device_inputs(meta)
        dev = self.target.device
        flat = torch.cat([t.reshape(-1) for t in host.values()]).to(dev)
        views, i = {}, 0
        for name, t in host.items():
            views[name] = flat[i:i + t.numel()].view(t.shape)
            i += t.numel()
        buf = None
        if hidden is not None:
            buf = torch.zeros(bucket * n, hidden.shape[1], dtype=hidden.dtype, device=dev)
        if self.cpu:
            return self._capture_cpu((bucket, n, kind, width), meta, flat, views, buf)
        inputs = self.target._feed(meta, buf, dev=views)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.target._fn(*inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.target._fn(*inputs)
        self._pool = graph.pool()
        cap = _Captured(graph, flat, out if isinstance(out, (tuple, list)) else (out,), buf)
        self._graphs[(bucket, n, kind, width)] = cap
        return cap


    def _capture_cpu(self, key: tuple, meta: BatchMetadata, flat: torch.Tensor, views: dict,
                     buf: torch.Tensor | None) -> _Captured | None:
        """A CPU graph of the step (engine/cpu_graphs.py) after two eager warm-up runs (lazy
        set-up in the kernels' callables); None, and the key remembered, where it refuses."""
        from specdeploy.engine.cpu_graphs import CaptureRefused, CpuGraph

        # the host inputs read the same buffer (on the CPU the device is the host): the cached
        # ops' host reads of a replayed step see its values
        feed = {**views, "cu_seqlens_host": views["cu_seqlens"],
                "cache_lens_host": views["cache_lens"], "seg_kind_host": meta.seg_kind,
                "ckpt_tokens_host": meta.ckpt_tokens, "key_extent_host": meta.key_extent,
                "hidden": None if buf is None else buf[None]}  # (as `_feed` gives it)
        inputs = [feed[name] for name in self.target._input_names]
        static = [views["cu_seqlens"], views["logits_idx"], meta.seg_kind, meta.ckpt_tokens]
        graph = CpuGraph()
        try:
            for _ in range(2):
                self.target._fn(*inputs)
            gm = self.target.gm
            roots = [list(gm.parameters()), list(gm.buffers()),
                     *(n.target for n in gm.graph.nodes if n.op == "call_function")]
            out = graph.capture(self.target._fn, inputs, static, roots)
        except CaptureRefused as e:
            self.refused[key] = str(e)
            return None
        except Exception as e:  # noqa: BLE001 (a kernel's complaint about the dummy step)
            self.refused[key] = f"{type(e).__name__}: {e}"
            return None
        cap = _Captured(graph, flat, out if isinstance(out, (tuple, list)) else (out,), buf)
        self._graphs[key] = cap
        return cap


def page_widths(max_pages: int) -> tuple[int, ...]:
    """Page-table widths graphs are captured at: powers of two below `max_pages`, then it."""
    return tuple(w for w in (1 << i for i in range(max_pages.bit_length())) if w < max_pages
                 ) + (max_pages,)


def _real_rows(out, meta: BatchMetadata) -> StepOutput:
    """The real rows of a padded step's outputs, copied (a replay overwrites the graph's)."""
    out = out if isinstance(out, (tuple, list)) else (out,)
    n = len(meta.lists.logits_idx) if meta.lists is not None else meta.logits_idx.numel()
    logits = out[0][0][:n].to(torch.float32, copy=True)
    hidden = out[1][0][:meta.num_tokens].clone() if len(out) > 1 else None
    return StepOutput(logits=logits, hidden=hidden)


def install(deployed, max_batch_size: int, capture: bool | None = None,
            drafts: bool = False) -> CudaGraphRunner:
    """Put a runner on the deployment's target program (a `SpecDeployed`'s too: its decode
    steps, those with no drafts, replay). Refuses what it cannot serve rather than ignore it.
    `drafts`: the drafter programs too (their chain steps, one token per sequence, replay; the
    catch-up rows run eagerly). `LLM` turns it on with the target's graphs
    (SPECDEPLOY_DRAFT_GRAPHS=0: not); checked on an H200 and, its logic, on the CPU."""
    dist = getattr(getattr(deployed, "ctx", None), "dist", None) or getattr(
        getattr(getattr(deployed, "target", None), "ctx", None), "dist", None)
    if dist is not None and dist.world_size > 1:
        raise ValueError("cuda_graphs: not with tensor parallelism yet")
    target = getattr(deployed, "target", deployed)
    if not hasattr(target, "graph_runner"):
        raise ValueError("cuda_graphs: needs the graph backend")
    if capture is None and target.device.type != "cuda":
        raise ValueError(f"cuda_graphs: needs a CUDA device, the deployment is on {target.device}")
    target.graph_runner = CudaGraphRunner(target, max_batch_size, capture=capture)
    for draft in getattr(deployed, "drafts", ()) if drafts else ():
        draft.graph_runner = CudaGraphRunner(draft, max_batch_size, capture=capture)
    return target.graph_runner
