"""Decode rows of ``bench/gpu_offload.py``: one side (policy) at one cache budget, timed, with the
bandwidth-model bound for the counts the row measured.

(d) ``lru+q*`` runs each token as one CUDA graph whose CPU branch is answered by a C++ host loop
through flags in pinned memory (``_lru_q_graph_token``; protocol in
``freetoken_engine/kernels/cpu_branch.py``). The per-layer launch driver it replaced is kept as
``lru+q*/layer`` (and ``lru+sync``, every miss filled) for A/B rows in the same run
(``offload_layer_driver.py``).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch

from offload_workload import CUDA, Bank  # first: it makes the engine package importable
from offload_layer_driver import layer_driver_token
from offload_measure import _capture, _Token, combine, row_bound
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import bypass_slots
from freetoken_engine.env import BYPASS_SLOTS_DEFAULT
from freetoken_engine.kernels.cpu_branch import CpuBranch
from freetoken_engine.kernels.triton.control_outputs import ControlOutputs
from freetoken_engine.kernels.triton import handshake
from freetoken_engine.kernels.triton.moe import moe_slots_forward


class _GpuExperts:
    """A layer's GPU experts with the hits (and the shared expert) computed on a side stream
    while the fills are copied; then the filled experts. Rows land in two buffers (``hit``,
    ``fill``), each zero where the other has its row, which ``combine(..., rows2=)`` adds."""

    def __init__(self, bank: Bank, st: _Token, ctl: DeviceControl, serial: bool = False):
        # serial: the hits after the copies on the one stream (the A/B side "/serial-hits")
        self.bank, self.st, self.ctl, self.serial = bank, st, ctl, serial
        self.side = torch.cuda.Stream()
        self.hit, self.fill = (torch.zeros(st.P, st.H, dtype=torch.bfloat16, device=CUDA) for _ in range(2))
        # the streamed split's GPU part of the CPU pairs (zero rows elsewhere), when it is on
        self.streamed = torch.zeros_like(self.hit) if ctl.stream is not None else None
        self.shared = torch.zeros(st.L, st.T, st.H, dtype=torch.bfloat16, device=CUDA)
        self.guess = None          # [L, T, k] on the device: the next layers' guesses (/predict)

    def __call__(self, l: int, out, copied: torch.cuda.Event | None = None) -> torch.Tensor | None:
        """Queue layer l's experts after its control step ``out``; returns the shared rows.
        ``copied``: the fills were queued already, elsewhere (``/ahead``): wait for this event
        instead of copying them."""
        bank, st, ctl = self.bank, self.st, self.ctl
        main = torch.cuda.current_stream()
        if self.serial:
            ctl.copy(l, out)
        ctl.wait_prefetched()                   # this layer's guesses (/predict), copied during the layer before
        self.side.wait_stream(main)
        with torch.cuda.stream(main if self.serial else self.side):
            moe_slots_forward(st.x[l], ctl.w13_slots, ctl.w2_slots, st.tok, out.pair_hit_slot, out=self.hit)
            if bank.shared is not None:
                s13, s2 = bank.shared
                moe_slots_forward(st.x[l], s13, s2, st.shared_tok, st.shared_slot[l], out=self.shared[l])
        if copied is not None:
            main.wait_event(copied)
        elif not self.serial:
            ctl.copy(l, out)                    # the fills, then the streamed rows (with the split)
        if self.guess is not None and l + 1 < st.L:      # /predict: layer l + 1's guesses behind the fills
            ctl.prefetch(l + 1, self.guess[l + 1])
        moe_slots_forward(st.x[l], ctl.w13_slots, ctl.w2_slots, st.tok, out.pair_fill_slot, out=self.fill)
        ctl.streamed_forward(st.x[l], st.tok, out, rows=self.streamed)
        main.wait_stream(self.side)
        return self.shared[l] if bank.shared is not None else None


def _lru_q_graph_token(bank: Bank, st: _Token, ctl: DeviceControl, prof: dict, serial: bool = False,
                       ahead: bool = False, guess: torch.Tensor | None = None):
    """(d) as one CUDA graph per token: the host half of the CPU branch is the C++ loop of
    ``kernels/cpu_branch.py`` (flags in pinned memory instead of per-layer launches and events).

    ``ahead`` (the A/B side ``lru+q*/ahead``, an upper bound for cross-layer prefetch): layer
    l + 1's control step runs before layer l's experts, with the routing it will have (the trace's,
    an oracle a real predictor would only approach), and its fills are queued on a copy stream
    behind layer l's, so PCIe moves layer l + 1's experts while layer l computes; its experts wait
    for that copy and its CPU branch starts after layer l's combine, as before. The victims a
    step ahead picks are never the layer's slots before it (fill admission: only slots idle for
    more than the window; this side needs it, and no bypass rows, which two layers would share).

    ``guess`` (``[L, T, k]``, the side ``lru+q*/predict@P``): what an engine can do instead, with
    a predicted routing. Once layer l's fill copies are queued, ``DeviceControl.prefetch`` fills
    layer l + 1's guessed misses by the q* rule (its copies on a copy stream, behind layer l's,
    while layer l computes); layer l + 1's real step then runs after layer l's combine as usual,
    finds the right guesses resident and counts the prefetch's fills against its share of PCIe
    (``control_step(spent=)``; its CPU branch starts at once), and its experts wait for that copy.
    (Measured on 2026-12-03 with the rule before: the guessed step filled nothing; the two agree
    when every guess is right.)"""
    L, P = st.L, st.P
    br = CpuBranch(bank.w13, bank.w2, st.T, st.k, CUDA)
    br.x[0].copy_(st.x[0])
    counts = torch.zeros(L, 4, dtype=torch.int64).pin_memory()        # the control steps' counts
    experts = _GpuExperts(bank, st, ctl, serial)
    experts.guess = guess
    if ahead:
        if ctl.admit_window < 1 or ctl.bypass or ctl.stream is not None:
            raise ValueError("/ahead needs fill admission, no bypass rows and no streamed split")
        outs = [ControlOutputs.allocate(P, st.E, ctl.slot_owner.numel(), CUDA) for _ in range(2)]
        copier = torch.cuda.Stream()
        copied = [torch.cuda.Event() for _ in range(L)]

    def control(l, out=None):
        from_rows = (br.from_rows[l:l + 1],) if ctl.stream is not None else ()
        ctl.step(l, st.ids[l], copy=False, mirror=(br.pair_slot[l], counts[l], br.pair_exp[l], *from_rows), out=out)
        if out is None:
            handshake.signal(br.flag[l:l + 1], br.epoch)
        else:                               # ahead: the fills on the copy stream, behind the earlier layers'
            copier.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copier):
                ctl.copy(l, out)
                copied[l].record()

    def step():
        handshake.bump(br.epoch)
        control(0, outs[0] if ahead else None)
        if ahead:
            handshake.signal(br.flag[0:1], br.epoch)
        for l in range(L):
            out = outs[l % 2] if ahead else ctl.outputs(P)
            if ahead and l + 1 < L:
                control(l + 1, outs[(l + 1) % 2])
            shared = experts(l, out, copied[l] if ahead else None)
            if ctl.stream is not None and ctl.stream.stage:      # the split by stage's down projection
                handshake.wait(br.act_flag[l:l + 1], br.epoch, br.err)
                ctl.stage_forward(br.act, out, rows=experts.streamed)
            handshake.wait(br.done[l:l + 1], br.epoch, br.err)
            combine(experts.hit, shared, st.x[l + 1], st.k, pair_slot=out.pair_slot, host_rows=br.rows,
                    x_host=br.x[l + 1] if l + 1 < L else None, rows2=experts.fill, rows3=experts.streamed)
            if l + 1 < L:
                if ahead:
                    handshake.signal(br.flag[l + 1:l + 2], br.epoch)
                else:
                    control(l + 1)

    def token(graph, h_ids):
        if graph is None:                   # eager (compiles): the host loop must already run
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(br.run, 120.0)
                step()
                done.result()
            return
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        before = dict(br.totals)
        br.run()
        prof["launch"] += t1 - t0
        prof["wait"] += br.totals["wait_s"] - before["wait_s"]
        prof["cpu"] += br.totals["compute_s"] - before["compute_s"]
        prof["cpu_layers"] += br.totals["cpu_layers"] - before["cpu_layers"]
        prof["streamed_rows"] += br.totals["streamed_rows"] - before["streamed_rows"]
        prof["stage_pairs"] += br.totals["stage_pairs"] - before["stage_pairs"]

    return token, (lambda: _capture(step)), SimpleNamespace(counts_np=counts.numpy())


def _static_token(bank: Bank, st: _Token, n_gpu: int, cpu_fn):
    """(b): layers < n_gpu resident (one graph), the others' experts all on the CPU."""
    L, E = st.L, st.E
    pool13, pool2 = bank.all_resident()
    h_x = torch.zeros(st.T, st.H, dtype=torch.bfloat16).pin_memory()
    h_rows = torch.zeros(st.P, st.H, dtype=torch.bfloat16).pin_memory()
    ev = torch.cuda.Event()

    def gpu_layers():
        for l in range(n_gpu):
            rows = moe_slots_forward(st.x[l], pool13, pool2, st.tok, st.ids[l].view(-1) + l * E, out=st.rows[l])
            st.combine(l, rows)

    def token(graph, h_ids):
        graph.replay() if graph is not None else gpu_layers()
        for l in range(n_gpu, L):
            h_x.copy_(st.x[l], non_blocking=True)
            ev.record()
            ev.synchronize()
            # out=: at batch 4 a torch copy of the result ran on torch's OpenMP threads, which then
            # spun on the kernel's CPUs (34 vs 108 GB/s on the H200 host, docs/cpu_kernel.md)
            cpu_fn(h_x, bank.w13[l], bank.w2[l], st.h_tok, torch.from_numpy(h_ids[l].reshape(-1)), out=h_rows)
            st.rows[l].copy_(h_rows, non_blocking=True)
            st.combine(l, st.rows[l])

    return token, (lambda: _capture(gpu_layers) if n_gpu else None)


def _resident_layers(ctl: DeviceControl, n_gpu: int, E: int, k: int) -> None:
    """Fill a pool of exactly ``n_gpu * E`` slots with every expert of layers < n_gpu (one
    fills-only control step per layer over all E experts), then set f = 0: the static split."""
    f = ctl.fill_fraction
    ctl.set_fill_fraction(1.0)
    every = torch.arange(E, device=CUDA).view(-1, k)
    for layer in range(n_gpu):
        ctl.step(layer, every)
    ctl.set_fill_fraction(f)
    ctl.totals.zero_()
    if bool((ctl.slot_of[:n_gpu] < 0).any()) or bool((ctl.slot_of[n_gpu:] >= 0).any()):
        raise RuntimeError("static/graph: the pool does not hold exactly the first layers")


def _fill_cache(ctl: DeviceControl, ids_dev: torch.Tensor, max_passes: int = 8) -> dict:
    """Bring an LRU cache to its steady state before the timed tokens: fills-only control steps
    (no expert compute) over the routing of the tokens before the warm-up ones, repeated until
    every slot holds an expert. Without it a policy that fills only part of its misses (q*)
    would be timed with a cache still filling (its miss rate inflated by warm-up, (c)'s not).
    The counters and f are restored; LRU order afterwards is that of the replayed tokens."""
    f = ctl.fill_fraction
    ctl.set_fill_fraction(1.0)
    passes = 0
    while passes < max_passes and bool((ctl.slot_owner < 0).any()):
        for t in range(ids_dev.shape[0]):
            for l in range(ids_dev.shape[1]):
                ctl.step(l, ids_dev[t, l])
        passes += 1
    ctl.set_fill_fraction(f)
    ctl.totals.zero_()
    return {"cache_prefill_passes": passes, "cache_full_at_start": not bool((ctl.slot_owner < 0).any())}


def guessed_routing(ids: torch.Tensor, experts: int, accuracy: float, seed: int = 7) -> torch.Tensor:
    """A predictor's guesses of ``ids [n_tok, L, T, k]``: each routed expert kept with probability
    ``accuracy``, else replaced by an expert the token does not route to (a row stays distinct)."""
    rng = np.random.default_rng(seed)
    out = ids.numpy().copy()
    n_tok, L, T, k = out.shape
    wrong = rng.random(out.shape) >= accuracy
    for idx in zip(*np.nonzero(wrong.any(-1))):
        row = out[idx]
        free = np.setdiff1d(np.arange(experts), ids.numpy()[idx])
        picks = rng.choice(free, size=int(wrong[idx].sum()), replace=False)
        row[wrong[idx]] = picks
    return torch.from_numpy(out)


def decode_row(bank: Bank, policy: str, slots: int, ids: torch.Tensor, warm: int, bw: dict, cpu_fn,
               keep_x: bool = False, fill_ids: torch.Tensor | None = None) -> dict:
    """Decode ``ids [n_tok, L, T, k]`` under ``policy``; time the tokens after ``warm``.
    ``keep_x``: also return every layer's hidden state (``x_layers``, host) for equality checks.
    ``fill_ids``: routing of the tokens before ``ids``, replayed to fill an LRU cache first
    (default: the warm-up tokens')."""
    m = bank.model
    L, E, se = m["layers"], m["experts"], m["expert_bytes"]
    n_tok, batch = ids.shape[0], ids.shape[2]
    st = _Token(bank, batch)
    # "/predict@P": layer l + 1's routing guessed during layer l, each expert right with probability P
    accuracy = float(policy.split("/predict@")[1]) if "/predict@" in policy else None
    guesses = guessed_routing(ids, E, accuracy).to(CUDA) if accuracy is not None else None
    st.guess = torch.empty_like(st.ids) if accuracy is not None else None
    ids_np = ids.numpy()
    distinct = torch.tensor([[len(set(ids_np[t, l].ravel().tolist())) for l in range(L)] for t in range(n_tok)])
    ctl = br = None
    prof = {"wait": 0.0, "cpu": 0.0, "launch": 0.0, "cpu_layers": 0, "streamed_rows": 0, "stage_pairs": 0}
    nb = 0                                                  # bypass slots (lru policies)
    # "static/graph": (b)'s split run by (d)'s machinery (one graph a token, the C++ host loop):
    # the first n_gpu layers resident, f = 0, so every other layer's experts go to the CPU and
    # nothing is filled or evicted
    static_graph = policy == "static/graph"
    if policy in ("all", "static", "static/graph"):
        n_gpu = L if policy == "all" else min(slots // E, L)
        slots = n_gpu * E
    if policy in ("all", "static"):
        token, capture = _static_token(bank, st, n_gpu, cpu_fn)
    else:
        if static_graph and not n_gpu:
            raise ValueError(f"static/graph: the budget holds no whole layer of {E} experts")
        # the engine's bypass slots out of the same budget; "/nobypass": admission alone (run N)
        plain = static_graph or policy.endswith(("/plain", "/nobypass", "/ahead"))
        nb = 0 if plain else bypass_slots(slots, L * E, BYPASS_SLOTS_DEFAULT)
        w13s = torch.empty((slots, *bank.w13.shape[2:]), dtype=torch.bfloat16, device=CUDA)
        w2s = torch.empty((slots, *bank.w2.shape[2:]), dtype=torch.bfloat16, device=CUDA)
        minus = lambda n: torch.full((n,), -1, dtype=torch.int64, device=CUDA)  # noqa: E731
        # lru+q*: f from the bandwidths measured in this run; lru+q*@F: a fixed f = F (A/B rows);
        # a "/layer" suffix: the per-layer launch driver instead of the one-graph handshake;
        # "/plain": no fill admission
        base = policy.split("/")[0]
        split = next((sfx for sfx in ("+stf", "+st", "+sf", "+s") if base.endswith(sfx)), "")   # streamed / by stage
        base = base[:len(base) - len(split)]
        f = float(base.split("@")[1]) if "@" in base else bw["fill_fraction"] if base == "lru+q*" else 1.0
        f = 0.0 if static_graph else f
        # the engine's fill admission (window: the MoE layer count; in effect only while f < 1),
        # except on the "/plain" side
        admit = 0 if static_graph or policy.endswith("/plain") else L
        # the engine's recurring misses first (a window of one step), except on "/ascending"
        recur = 0 if static_graph or policy.endswith("/ascending") else L
        # lru+q*: the CPU's call-size curve measured in this run (kernels/split.py); "/flat": none
        speed = bw.get("cpu_call_speed") if base == "lru+q*" and not policy.endswith("/flat") else None
        ctl = DeviceControl(bank.w13, bank.w2, w13s, w2s, minus(L * E).view(L, E), minus(slots - nb),
                            minus(slots - nb), 0, f, admit_window=admit, recur_window=recur, cpu_speed=speed)
        if static_graph:
            _resident_layers(ctl, n_gpu, E, st.k)
        if policy.endswith("/behind"):          # fills behind the CPU (freetoken_engine/cache/behind.py)
            ctl.set_behind()
        if split:
            ctl.set_stream(min(st.P, E), floor_fills=split in ("+sf", "+stf"), stage=split in ("+st", "+stf"))
        if policy == "lru":
            experts = _GpuExperts(bank, st, ctl)

            def gpu_layers():
                for l in range(L):
                    out = ctl.step(l, st.ids[l], copy=False)
                    combine(experts.hit, experts(l, out), st.x[l + 1], st.k, rows2=experts.fill)

            def token(graph, h_ids):
                graph.replay() if graph is not None else gpu_layers()

            def capture():
                return _capture(gpu_layers)
        elif policy == "lru+sync" or policy.endswith("/layer"):
            token, capture, br = layer_driver_token(bank, st, ctl, cpu_fn, prof)
        else:
            token, capture, br = _lru_q_graph_token(bank, st, ctl, prof, serial=policy.endswith("/serial-hits"),
                                                    ahead=policy.endswith("/ahead"), guess=st.guess)

    ids_dev = ids.to(CUDA)
    res_warm = _fill_cache(ctl, (fill_ids if fill_ids is not None else ids[:warm]).to(CUDA)) if ctl is not None else {}
    st.load_ids(ids_dev, ids, 0)
    if guesses is not None:
        st.guess.copy_(guesses[0])
    token(None, ids_np[0])                                  # compiles every kernel; first warm token
    torch.cuda.synchronize()
    graphs = capture()
    counts = []
    for t in range(1, warm):
        st.load_ids(ids_dev, ids, t)
        if guesses is not None:
            st.guess.copy_(guesses[t])
        token(graphs, ids_np[t])
    torch.cuda.synchronize()
    before = ctl.counters() if ctl else None
    pf_before = ctl.prefetch_counters() if ctl else None
    bh_before = ctl.behind.counters() if ctl is not None and ctl.behind is not None else None
    prof.update({key: 0 for key in prof})
    # each step's end on the device's clock: one event after each token's work (they do not
    # hold the host back, so the timed loop runs as it did without them)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(n_tok - warm + 1)]
    t0 = time.perf_counter()
    marks[0].record()
    for t in range(warm, n_tok):
        st.load_ids(ids_dev, ids, t)
        if guesses is not None:
            st.guess.copy_(guesses[t])
        token(graphs, ids_np[t])
        marks[t - warm + 1].record()
        if br is not None:
            counts.append(br.counts_np.copy())               # final once the token's last wait returned
    torch.cuda.synchronize()
    steps = n_tok - warm
    secs = (time.perf_counter() - t0) / steps
    step_ms = sorted(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))
    if not torch.isfinite(st.x[L].float()).all():
        raise RuntimeError(f"{policy}: non-finite hidden state")
    res = {"policy": policy, "cache_slots": slots, "cache_fraction": slots / (L * E), "seconds_per_step": secs,
           "tok_s": batch / secs, "bypass_slots": nb, "step_ms_min": step_ms[0],
           "step_ms_median": statistics.median(step_ms), "step_ms_max": step_ms[-1], **res_warm}
    pf = {k: v - pf_before[k] for k, v in ctl.prefetch_counters().items()} if ctl else {}
    behind = 0.0
    if bh_before is not None:                # words copied behind the CPU, in experts
        bh = ctl.behind.counters()
        behind = (bh["copied_words"] - bh_before["copied_words"]) / bh["words"]
        res.update(behind_experts_copied_per_step=behind / steps,
                   behind_made_resident_per_step=(bh["made_resident"] - bh_before["made_resident"]) / steps)
    # the experts copied ahead (wrong guesses included) or behind the CPU crossed PCIe too: counted
    # as misses in the bound
    res.update(row_bound(bank, policy, slots, distinct[warm:].float(), ctl, before, counts, bw, steps, batch, secs,
                         extra_misses=pf.get("fills", 0) + behind))
    if accuracy is not None:
        res.update(guess_accuracy=accuracy, prefetch_fills_per_step=pf["fills"] / steps,
                   prefetch_hits_per_step=pf["hits"] / steps, prefetch_misses_per_step=pf["misses"] / steps)
    if keep_x:
        res["x_layers"] = st.x.float().cpu()                  # [L + 1, T, H]: every layer's input
    if br is not None:
        res["host_profile_ms_per_step"] = {key: 1e3 * v / steps for key, v in prof.items()
                                           if key not in ("cpu_layers", "streamed_rows", "stage_pairs")}
        res["cpu_layers_per_step"] = prof["cpu_layers"] / steps
        if prof["cpu"] > 0 and not prof["streamed_rows"] + prof["stage_pairs"]:   # the host's CPU rate drifts
            res["cpu_gbps_in_row"] = res["cpu_experts_per_step"] * steps * se / prof["cpu"] / 1e9
        # the streamed split: expert-equivalents per step whose first rows crossed PCIe
        res["streamed_experts_per_step"] = prof["streamed_rows"] / bank.w2.shape[3] / steps
        res["stage_pairs_per_step"] = prof["stage_pairs"] / steps
    ctl = None                                             # this frame's reference, before the cache is emptied
    torch.cuda.empty_cache()
    return res
