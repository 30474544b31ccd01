"""``ModelRunner``: owns the model, the expert bank and cache, and the KV pool on one device.

``forward(chunks) -> logits [B, V]`` runs one batch (prefill chunks and decode tokens mixed);
``forward(chunks, between=fn)`` calls ``fn(i)`` after each layer but the last, where the
scheduler may run ``decode_beside`` (a decode step of other sequences inside that pass). Not
thread-safe: one thread (the scheduler's, or the caller of ``LLM``) drives it; ``resize`` must be
called between forward passes (a safe point).
"""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Callable

import torch

from . import cuda_warm

cuda_warm.start_after_preload()     # the warm-up beside the rest of the engine's imports

from .. import env  # noqa: E402
from ..cache.experts import ExpertCache  # noqa: E402
from ..cache.kv import KVPool  # noqa: E402
from ..cache.offload import OffloadedExperts  # noqa: E402
from ..cache.states import StatePool  # noqa: E402
from ..config import EngineConfig, check_device  # noqa: E402
from ..layers.linear import use_compiled_linears  # noqa: E402
from ..calibrate import calibrated  # noqa: E402
from ..models.build import BankRead, start_model  # noqa: E402
from ..models.loader import torch_dtype  # noqa: E402
from ..models.tokenizer import load_tokenizer  # noqa: E402
from .budget import cache_experts, default_kv_blocks, state_slots  # noqa: E402
from .cpu_contention import ContentionFollower  # noqa: E402
from .cpu_decode import CpuDecode  # noqa: E402
from .host_threads import for_engine as host_threads  # noqa: E402
from .model_rate import start_follower  # noqa: E402
from .inputs import SeqChunk, as_decode_rows, build_inputs, pass_spans  # noqa: E402
from .split_tuner import SplitTuner, decode_batch  # noqa: E402
from .warmup import GraphWarmup  # noqa: E402

log = logging.getLogger(__name__)


#: an MTP pass of at most this many rows runs them as one-token rows (a graph on a GPU)
MTP_ROWS = 16


def _generation_eos(folder) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


class ModelRunner(GraphWarmup):
    def __init__(self, cfg: EngineConfig, progress: Callable[[float], None] | None = None):
        try:
            self._start(cfg, progress)
        except BaseException:
            from ..packed.early import discard
            discard(cfg.model)      # a preloaded bank that no load will take: its memory goes now
            raise

    def _start(self, cfg: EngineConfig, progress: Callable[[float], None] | None) -> None:
        check_device(cfg.device)
        self.cfg = cfg
        env.validate()
        if env.cpu_threads():
            torch.set_num_threads(env.cpu_threads())
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(cfg.resolved_dtype)
        if self.device.type == "cuda":
            cuda_warm.start(cfg.device)          # torch's first CUDA calls, beside the build (once)
        if self.device.type == "cuda" and cfg.expert_backend != "torch":
            from ..kernels.triton import prewarm
            prewarm.start()                      # Triton's cache key (kept between starts), beside the build
        folder = cfg.model
        if folder.suffix == ".gguf" and folder.is_file():       # a llama GGUF: convert once, cached
            from ..models.gguf_folder import gguf_folder
            folder = gguf_folder(folder)
        self.model, self.bank, self.mcfg, rest = start_model(
            folder, self.dtype, self.device, progress, mtp=cfg.speculative_method == "mtp", expert_format=cfg.expert_format)
        try:
            self._assemble(cfg, folder, rest)
        except BaseException:
            rest.cancel()                 # a packed bank still being read stops there
            raise

    def _assemble(self, cfg: EngineConfig, folder, rest: BankRead) -> None:
        """Everything after the model's construction. A packed folder's bank may still be read
        (``rest``): the cache, the KV pool and the decode graphs are made meanwhile (the graphs
        with every expert resident, so their warm-up reads nothing from the bank), and the bank
        is waited for (and pinned as it lands) last. A first start on a GPU waits for
        it before the calibration, which must not share the memory bus with the read."""
        self._calibrated_gbps: float | None = None   # the calibration's B_cpu, when q* is calibrated
        use_compiled_linears(self.model)         # decode projections at memory bandwidth (CPU or GPU)
        eos = tuple(dict.fromkeys(_generation_eos(folder) + self.mcfg.eos_token_ids))
        self.tokenizer = load_tokenizer(folder, eos)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else eos
        self.max_context = min(cfg.max_context or self.mcfg.max_position_embeddings, self.mcfg.max_position_embeddings)
        kv_blocks = default_kv_blocks(cfg, self.max_context)
        self.cache = None
        if self.bank is not None:
            if (rest.pending and self.device.type == "cuda" and cfg.cpu_expert_fraction is None
                    and not calibrated(self.device)):
                rest.finish()           # a first start measures B_cpu and PCIe: not beside the read
            slots = cache_experts(self.cfg, self.mcfg, self.bank, self.device, self.dtype, self.max_context, kv_blocks)
            self.cache = ExpertCache(self.bank, slots, self.device, self._fill_fraction(),
                                     bypass=env.bypass_slots() if self.device.type == "cuda" else 0)
            self._make_experts()
        self.kv = KVPool.for_model(cfg, self.mcfg, kv_blocks, self.dtype, self.device)
        self.states = self._make_states()
        # a hybrid draft's verification as chained decode rows (executor/inputs.as_decode_rows): on a
        # GPU, where they replay a decode graph; the CPU keeps the chunk, which ran faster there
        # (K = 4, A = 1: 2.42x against 2.09x of plain decode, bench/mtp_speculative.py --ab-rows)
        self.chained_rows = self.device.type == "cuda" and self.states is not None and all(
            layer.chains(self.device, self.dtype) for layer in self.model.deltanets())
        self._make_graphs()
        # q* refined online by measured step time; not when the user fixed the split
        self.tuner = None
        self.follower: ContentionFollower | None = None     # made once the bank is read: it measures it
        self._warming = False                    # capturing graphs ahead of time: the follower waits
        if (cfg.split_tuning and self.cache is not None and self.device.type == "cuda"
                and cfg.cpu_expert_fraction is None):
            self.tuner = SplitTuner(self.cache.fill_fraction)
        self._timed: tuple | None = None         # (decode batch, start event, end event) of the last step
        self.graph_warmup_seconds = 0.0
        warm = self.graphs is not None and self.tuner is None and cfg.graph_warmup > 0
        # (the tuner's first probes would drop them again); the wider widths follow when idle
        self.idle_warm = cfg.graph_warmup if warm else 0
        widths = cfg.graph_warmup_widths or None
        if warm and rest.pending and not (self.cache is None or rest.pin_head()):
            rest.finish()                        # the steps could not be launched before the bank
        self._start_follower(cfg, rest)          # before the warm-up: graphs keep the split they capture
        if warm:
            self.warm_graphs(cfg.graph_warmup, bank_pending=rest.pending, widths=widths)
        if rest.pending:
            before = self._bank_addresses()
            rest.finish()
            if self._bank_addresses() != before:
                # pinned by a copy (registration in place failed): what holds its addresses is made again
                log.warning("the expert bank was pinned by copying it; decode graphs captured again")
                for branch in self.experts.branches():
                    branch.close()
                self._make_experts()
                self._make_graphs()
                if warm:
                    self.warm_graphs(cfg.graph_warmup, widths=widths)

    def _start_follower(self, cfg: EngineConfig, rest: BankRead) -> None:
        """q* for this model's experts and CPU contention (``model_rate.start_follower``)."""
        start_follower(self, cfg, rest)

    def _make_states(self) -> StatePool | None:
        """A hybrid model's recurrent-state slots: one per batch row, plus the anchors' checkpoints
        and the drafts' snapshots (``budget.state_slots``)."""
        m = self.mcfg
        if not m.linear_layers:
            return None
        per = StatePool.slot_bytes(len(m.linear_layers), m.linear, self.dtype.itemsize)
        n, scratch = state_slots(self.cfg, per, self.device)
        pool = StatePool(len(m.linear_layers), m.linear, self.cfg.max_batch, n, self.dtype, self.device, scratch)
        for layer in self.model.deltanets():
            layer.states = pool
        log.info("hybrid model: %d recurrent-state slots, %d anchor checkpoints and %d draft snapshots, "
                 "%.1f MB each", self.cfg.max_batch, n, scratch, per / 1e6)
        return pool

    def _bank_addresses(self) -> tuple[int, int] | None:
        return (self.bank.w13.data_ptr(), self.bank.w2.data_ptr()) if self.bank is not None else None

    def _make_experts(self) -> None:
        self.experts = OffloadedExperts(self.bank, self.cache, self.cfg.expert_threshold,
                                        backend=self.cfg.expert_backend, top_k=self.mcfg.moe.top_k,
                                        step_layers=len(self.mcfg.moe_layers))
        blocks = self.model.moe_blocks()
        for block in blocks:
            block.experts = self.experts
        self.experts.math.set_model(blocks[0].act, [b.expert_b13 for b in blocks])   # gpt-oss: its experts
        if env.expert_prefetch():           # each MoE layer guesses the next one's experts
            blocks = self.model.moe_blocks()[:len(self.mcfg.moe_layers)]
            for block, nxt in zip(blocks, blocks[1:]):
                block.next_gate = nxt.gate

    def _make_graphs(self) -> None:
        cfg = self.cfg
        self.graphs = self.mtp_graphs = None
        self.model.cpu_decode = CpuDecode(self.model, self.experts if self.cache is not None else None,
                                          self.dtype) if self.device.type == "cpu" and cfg.fused_cpu_decode else None
        self.host_threads = host_threads(self.device)     # None, or torch's threads per pass on a CPU
        self.mtp_rows = False       # MTP passes of a few rows as one-token rows (mtp_forward): with graphs
        if cfg.cuda_graphs and self.device.type == "cuda" and (self.cache is None or self.experts.control is not None):
            from .graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.kv, self.experts if self.cache is not None else None,
                                       self.device, self.dtype, self.max_context,
                                       min(cfg.max_batch, cfg.expert_threshold - 1), int(cfg.graph_memory_gb * 1e9),
                                       chained=self.chained_rows)
            if self.model.mtp is not None:       # the MTP layer's passes: graphs of their own
                self.mtp_rows = True
                self.mtp_graphs = DecodeGraphs(self.model, self.kv, self.experts if self.cache is not None else None,
                                               self.device, self.dtype, self.max_context, self.graphs.max_batch,
                                               int(cfg.graph_memory_gb * 1e9), mtp=True)

    # -- configuration -------------------------------------------------------------------------
    def _fill_fraction(self) -> float:
        if self.cfg.cpu_expert_fraction is not None:
            return 1.0 - self.cfg.cpu_expert_fraction
        if self.device.type == "cpu":
            return 1.0
        from ..calibrate import load_or_measure
        cal = load_or_measure(self.device)
        self._calibrated_gbps = cal.get("cpu_expert_gbps")
        return cal["fill_fraction"]

    # -- work ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], between: Callable[[int], None] | None = None) -> torch.Tensor:
        if self.follower is not None and not self._warming and self.cache.capacity < self.bank.total_experts:
            q = self.follower.tick()
            if q is not None:
                self._set_q(q)
        # a draft's verification: the decode attention, a decode graph
        chunks = as_decode_rows(chunks, chained=self.chained_rows)
        timed = self._tune(chunks)
        key = self.graphs.key(chunks) if self.graphs is not None else None
        if self.cache is not None:     # a prefill seeds the decode cache from a prompt's last chunk only
            self.experts.seed_now = any(c.last for c in chunks)
        with self.host_threads.for_pass(chunks) if self.host_threads is not None else contextlib.nullcontext():
            logits = self._run(chunks, key, between)
        for c in chunks:              # anchor checkpoints of rows (as_decode_rows), in stream order
            for src, dst in c.copies:
                self.states.copy(src, dst)
        if key is not None and key not in self.graphs:
            self.graphs.capture(chunks, key, evict=not self._warming)   # replayed from the next step
            if timed is not None:
                self._timed = timed = (timed[0], None, None)     # not a step's time: left out
        if timed is not None and timed[2] is not None:
            timed[2].record(torch.cuda.current_stream(self.device))
        return logits

    @torch.inference_mode()
    def decode_beside(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """A decode step of other sequences between two layers of a pass ``forward`` is running
        (from its ``between``): its graph when captured, else eager (no capture, no split tuning,
        no q* change in the middle of a pass). The expert cache's changes are handed to the pass's
        layer streamer (``OffloadedExperts.beside_prefill``), so its output does not change."""
        key = self.graphs.key(chunks) if self.graphs is not None else None
        with self.experts.beside_prefill() if self.cache is not None else contextlib.nullcontext():
            return self._run(chunks, key, None)

    def _run(self, chunks: list[SeqChunk], key, between) -> torch.Tensor:
        """The pass itself: the graph of ``key`` when captured, else eager; then the CPU branch."""
        self.kv.before_pass(pass_spans(chunks))
        if key is not None and key in self.graphs:
            logits = self.graphs.replay(chunks, key)
        else:
            inputs = build_inputs(chunks, self.kv.block_size, self.device)
            logits = self.model(inputs.ids, inputs.batch, self.kv, inputs.logits_at, between)
        if self.cache is not None:
            self.experts.end_step()
        return logits

    @torch.inference_mode()
    def mtp_forward(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head (``DecoderLM.mtp_forward``) over ``chunks``: each chunk's rows are the
        positions ``start ..`` and its ``tokens`` the token after each, ``hidden [T, H]`` the
        hidden state at each row, in order. -> the head's output at each chunk's last row [B, H]
        (``logits`` of it: the next draft token). A pass of a few rows (a draft's next token, the
        rows a decode step or a verification recorded) runs them as one-token rows sharing their
        sequence's block table, as a verification does (``as_decode_rows``), and replays a captured
        graph of the pass (``mtp_graphs``, on a GPU); a prompt's rows, and the CPU's passes, run as
        chunks (on the 2-CPU VM rows ran slower: bench/mtp_speculative.py --ab-rows)."""
        rows, last = chunks, None
        graphs = self.mtp_graphs
        if self.mtp_rows and sum(len(c.tokens) for c in chunks) <= MTP_ROWS and any(len(c.tokens) > 1 for c in chunks):
            rows, last = [], []
            for c in chunks:
                rows += [SeqChunk(c.block_table, c.start + j, [t]) for j, t in enumerate(c.tokens)]
                last.append(len(rows) - 1)
        key = graphs.key(rows) if graphs is not None else None
        if self.cache is not None:
            self.experts.seed_now = False
        if key is not None and key in graphs:
            out = graphs.replay(rows, key, hidden)
        else:
            inputs = build_inputs(rows, self.kv.block_size, self.device)
            out = self.model.mtp_forward(inputs.ids, hidden, inputs.batch, self.kv, inputs.logits_at)
        if self.cache is not None:
            self.experts.end_step()
        if key is not None and key not in graphs:
            graphs.capture(rows, key, evict=not self._warming)
        return out if last is None else out.index_select(0, torch.tensor(last, device=out.device))

    def _tune(self, chunks: list[SeqChunk]) -> tuple | None:
        """Hand the previous step's device time to the split tuner (the caller has read its logits
        by now, so its end event is complete), apply the q it asks for, and time this step if it
        is a decode step whose split matters (misses exist only while some expert is not cached)."""
        if self.tuner is None:
            return None
        last, self._timed = self._timed, None
        secs = None
        if last is not None and last[2] is not None and last[2].query():
            secs = last[1].elapsed_time(last[2]) / 1e3
        q = self.tuner.observe(last[0] if last is not None else None, secs)
        if q is not None and q != self.cache.fill_fraction:
            self._set_q(q)
        batch = decode_batch(chunks)
        if batch is None or self.cache.capacity >= self.bank.total_experts:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))     # the engine's device, whichever is current
        self._timed = (batch, start, end)
        return self._timed

    def _set_q(self, fraction: float) -> None:
        for graphs in (self.graphs, self.mtp_graphs):
            if graphs is not None:
                graphs.clear()                  # a captured step keeps its fill table and branch
        self.experts.set_fill_fraction(fraction)

    def resize_expert_cache(self, experts: int) -> int:
        """Resize at a safe point; clamps to 1..all experts; returns the applied capacity."""
        if self.cache is None:
            return 0
        n = max(1, min(int(experts), self.bank.total_experts))
        for graphs in (self.graphs, self.mtp_graphs):
            if graphs is not None:
                graphs.clear()                  # they hold the old pools' addresses
        self.experts.resize(n)
        return n

    def set_fill_fraction(self, fraction: float) -> None:
        """Set q*/m (at a safe point); the split tuner starts over from it."""
        if self.cache is not None:
            self._set_q(self.follower.rebase(fraction) if self.follower is not None else fraction)
            if self.tuner is not None:
                self.tuner.reset(fraction)

    def expert_stats(self) -> dict:
        c = self.cache
        if c is None:
            return {"capacity_experts": 0, "capacity_bytes": 0, "expert_bytes": 0, "min_experts": 0,
                    "max_experts": 0, "hits": 0, "misses": 0, "fills": 0, "cpu_computed": 0,
                    "fill_fraction": 1.0}
        s = self.experts.stats()     # read-only: safe from any thread
        return {"capacity_experts": c.capacity, "capacity_bytes": c.capacity_bytes, "bypass_slots": c.bypass,
                "expert_bytes": self.bank.expert_bytes, "min_experts": 1,
                "max_experts": self.bank.total_experts, "hits": s.hits, "misses": s.misses,
                "fills": s.fills, "cpu_computed": s.cpu_computed, "fill_fraction": c.fill_fraction,
                "cpu_call_speed": list(c.cpu_speed) if c.cpu_speed else None,   # q*'s CPU rate by call size
                "cpu_backend": self.experts.cpu_backend_name, "backend": self.experts.backend,
                "split_tuner": self.tuner.stats() if self.tuner is not None else None,
                "cpu_contention": self.follower.state() if self.follower is not None else None}

    def graph_stats(self) -> dict:
        """Decode CUDA graphs held, replayed (0 and 0: eager decode), their measured device memory
        (``DecodeGraphs.held_bytes``), the graphs dropped to stay under ``--graph-memory-gb`` and the
        captures that failed; with MTP drafts the MTP passes' graphs and replays too (their memory
        and failed captures counted in the totals)."""
        g, m = self.graphs, self.mtp_graphs
        n, replays, held, drops, failed = ((len(g), g.replays, g.held_bytes, g.dropped, g.capture_failures)
                                           if g is not None else (0, 0, 0, 0, 0))
        out = {"decode_graphs": n, "decode_graph_replays": replays,
               "decode_graph_bytes": held + (m.held_bytes if m is not None else 0), "decode_graph_drops": drops,
               "decode_graph_capture_failures": failed + (m.capture_failures if m is not None else 0),
               "decode_graph_warmup_seconds": round(self.graph_warmup_seconds, 3)}
        if m is not None:
            out.update(mtp_graphs=len(m), mtp_graph_replays=m.replays)
        return out

    def device_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0
