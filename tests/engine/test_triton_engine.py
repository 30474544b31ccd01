"""The engine's Triton path (device control step, one-launch fills, Triton MoE kernel) gives the
same tokens as the torch reference path. On CPU it runs under TRITON_INTERPRET=1."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402

from freetoken_engine import LLM, SamplingParams  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model,capacity,fraction", [("qwen3_moe", 3, 0.5), ("qwen3_moe", 16, 0.0),
                                                     ("qwen3_moe", 1, 1.0), ("glm4_moe", 3, 0.5),
                                                     ("minimax_m2", 3, 0.5), ("granitemoeshared", 3, 0.5),
                                                     ("exaone_moe", 3, 0.5), ("afmoe", 3, 0.5),
                                                     ("deepseek_v3", 3, 0.5), ("deepseek_v2", 3, 0.5),
                                                     ("granitemoehybrid", 3, 0.5), ("kimi_linear", 3, 0.5)])
def test_triton_path_equals_torch_path(tiny_checkpoint, model, capacity, fraction):
    folder = tiny_checkpoint(model)
    want = LLM(folder, expert_backend="torch").generate(PROMPT, GREEDY).token_ids
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=capacity, cpu_expert_fraction=fraction)
    assert llm.runner.experts.backend == "triton"
    got = llm.generate(PROMPT, GREEDY)
    assert got.token_ids == want
    s = got.stats
    assert s["hits"] + s["misses"] > 0 and s["fills"] + s["cpu_computed"] == s["misses"]
    branch = llm.runner.experts.host_branch      # CPU pairs answered by the host loop, no per-layer sync
    if s["cpu_computed"]:
        assert branch is not None and branch.br.totals["cpu_pairs"] >= s["cpu_computed"]
    llm.runner.resize_expert_cache(2)                   # a resize keeps the device state coherent
    llm.runner.cache.check_integrity(deep=True)
    assert llm.generate(PROMPT, GREEDY).token_ids == want


@pytest.mark.parametrize("model,capacity,fraction", [("qwen3_moe", 5, 0.5), ("qwen3_moe", 4, 0.0),
                                                     ("glm4_moe", 5, 0.5)])   # guesses by biased sigmoid scores
def test_prefetching_the_next_layers_guessed_experts_changes_no_token(tiny_checkpoint, monkeypatch, model, capacity,
                                                                       fraction):
    """FREETOKEN_EXPERT_PREFETCH=on (one sequence decoding): each MoE layer guesses the next one's experts with that
    layer's router on its own input and the device control copies the guessed misses ahead
    (``DeviceControl.prefetch``). Guesses only move experts into the cache: the tokens equal the
    torch path's, the real steps see the same routing, and the prefetch made fills."""
    folder = tiny_checkpoint(model)
    want = LLM(folder, expert_backend="torch").generate(PROMPT, GREEDY).token_ids
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", mode)
        llm = LLM(folder, expert_backend="triton", expert_cache_experts=capacity, cpu_expert_fraction=fraction)
        got = llm.generate(PROMPT, GREEDY)
        assert got.token_ids == want
        runs[mode] = (got.stats, llm.runner.experts.control.prefetch_counters())
        llm.runner.experts.sync_stats()          # the device clock and residency back in the cache
        llm.runner.cache.check_integrity(deep=True)
    (off, pf_off), (on, pf_on) = runs["off"], runs["on"]
    assert pf_off["fills"] == 0 and pf_on["fills"] > 0
    assert on["hits"] + on["misses"] == off["hits"] + off["misses"]     # the routing itself is the same
    if fraction:
        # the q* split leaves misses for the CPU: guessed in time, some became hits. (With every
        # miss filled in a 4-slot cache, the random model's poor guesses evict more than they
        # bring: 22 hits against 28 here. Guesses only pay where they are mostly right.)
        assert on["hits"] > off["hits"]


def test_prefetch_keeps_the_tokens_across_cache_resizes(tiny_checkpoint, monkeypatch):
    """Prefetch on while the expert cache grows and shrinks between requests: the prefetch's
    buffers are rebuilt for the new pool (their victim keys are sized by it), and
    every request gives the torch path's tokens."""
    folder = tiny_checkpoint("qwen3_moe")
    want = LLM(folder, expert_backend="torch").generate(PROMPT, GREEDY).token_ids
    monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", "on")
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=3, cpu_expert_fraction=0.5)
    for capacity in (3, 9, 4):
        llm.runner.resize_expert_cache(capacity)
        assert llm.generate(PROMPT, GREEDY).token_ids == want
    assert llm.runner.experts.control.prefetch_counters()["fills"] > 0
    llm.runner.experts.sync_stats()
    llm.runner.cache.check_integrity(deep=True)


def test_prefetch_on_guesses_for_one_sequence_and_all_for_every_decode_call(tiny_checkpoint, monkeypatch):
    """FREETOKEN_EXPERT_PREFETCH: "on" prefetches in decode calls of one sequence only (batch 4
    lost on the H200: 0.97x with every guess right), "all" in a batch too; anything else is
    refused at start with the allowed values named."""
    from freetoken_engine import env
    from freetoken_engine.llm import Lockstep
    folder = tiny_checkpoint("qwen3_moe")
    guessed = {}
    for mode in ("on", "all"):
        monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", mode)
        llm = LLM(folder, expert_backend="triton", expert_cache_experts=5, cpu_expert_fraction=0.5)
        batch = Lockstep(llm, [PROMPT, PROMPT[1:]])
        for _ in range(3):
            batch.step()
        batch.close()
        pf = llm.runner.experts.control.prefetch_counters()
        guessed[mode] = pf["hits"] + pf["misses"]
    assert guessed["on"] == 0 and guessed["all"] > 0
    monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", "yes")
    with pytest.raises(ValueError, match="FREETOKEN_EXPERT_PREFETCH must be on, all or off"):
        env.validate()


def test_a_replayed_decode_step_is_answered_by_the_host_loop(tiny_checkpoint):
    """What a CUDA-graph replay of a decode step does, run eagerly under the interpreter: the host
    loop is started by ``begin_replay`` before the step, and the step's own work is queued in
    capture mode (layer 0 only bumps the epoch). The tokens are those of the eager engine."""
    import torch

    from freetoken_engine.executor.inputs import build_inputs

    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=3, cpu_expert_fraction=0.5)
    want = llm.generate(PROMPT, GREEDY).token_ids
    runner, experts = llm.runner, llm.runner.experts
    eager, replayed = runner.forward, []

    @torch.inference_mode()
    def replay_like(chunks):
        if any(len(c.tokens) != 1 for c in chunks):
            return eager(chunks)
        mode = experts.graph_mode(len(chunks))
        assert mode == "branch"
        inputs = build_inputs(chunks, runner.kv.block_size, runner.device)
        experts.begin_replay(len(chunks), mode)
        experts.capturing(True)
        try:
            logits = runner.model(inputs.ids, inputs.batch, runner.kv, inputs.logits_at)
        finally:
            experts.capturing(False)
        experts.end_step()
        replayed.append(len(chunks))
        return logits

    runner.forward = replay_like
    pairs = experts.host_branch.br.totals["cpu_pairs"]
    got = llm.generate(PROMPT, GREEDY)
    assert got.token_ids == want and len(replayed) == GREEDY.max_new_tokens - 1
    assert experts.host_branch.br.totals["cpu_pairs"] > pairs        # the loop computed CPU pairs


def test_graph_mode_follows_the_split():
    """A step can be captured as device work only when every miss is filled; with CPU pairs only
    through the sync-free branch; never with a per-layer sync."""
    from types import SimpleNamespace

    from freetoken_engine.cache.offload import OffloadedExperts

    e = OffloadedExperts.__new__(OffloadedExperts)
    e.top_k, e.prefill_threshold, e.host_branch, e.mtp_branch = 2, 16, None, None
    e.control, e.cache = object(), SimpleNamespace(fill_fraction=1.0, capacity=4)
    e.bank = SimpleNamespace(total_experts=8)
    assert e.graph_mode(2) == "device" and e.graph_mode(3) is None     # 6 pairs > 4 slots
    e.cache.fill_fraction = 0.5
    assert e.graph_mode(1) is None
    e.host_branch = object()
    assert e.graph_mode(1) == "branch" and e.graph_mode(16) is None    # prefill-sized: never
    assert e.graph_mode(1, mtp=True) is None       # an MTP pass needs a branch of its own
    e.mtp_branch = object()
    assert e.graph_mode(1, mtp=True) == "branch"
    e.cache.capacity = 8
    assert e.graph_mode(1) == "device"             # every expert fits: every miss is filled
    e.control = None
    assert e.graph_mode(1) is None


def test_every_miss_is_filled_once_every_expert_fits(tiny_checkpoint):
    """With room for every expert a fill is never evicted, so the device control fills every miss
    whatever q* says (and the engine may then skip the CPU branch); below that, q* applies."""
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, expert_backend="triton", cpu_expert_fraction=0.5, expert_cache_experts=16)
    experts = llm.runner.experts
    assert llm.runner.bank.total_experts == 16
    assert experts.control.fill_fraction == 1.0 and experts.graph_mode(1) == "device"
    llm.runner.resize_expert_cache(15)
    assert experts.control.fill_fraction == 0.5
    llm.runner.set_fill_fraction(0.25)
    assert experts.control.fill_fraction == 0.25
    llm.runner.resize_expert_cache(16)
    assert experts.control.fill_fraction == 1.0 and experts.cache.fill_fraction == 0.25


def test_a_bank_pinned_by_copying_is_bound_again_everywhere(tiny_packed, monkeypatch):
    """A packed bank is read while the engine starts. When it cannot be page-locked where it lies,
    ``ExpertBank.pin`` copies it, and everything that took the bank's addresses meanwhile (the
    device control's fills, the decode graphs) must be made again: the first copy is poisoned
    here, so an engine still reading it would not answer with the reference's tokens."""
    from freetoken_engine.cache.bank import ExpertBank
    src, out = tiny_packed
    want = LLM(src, expert_backend="torch").generate(PROMPT, GREEDY).token_ids

    def pin_by_copying(self):
        for name in ("w13", "w2"):
            first = getattr(self, name)
            setattr(self, name, first.clone())
            first.fill_(float("nan"))
        self.pinned = True
    monkeypatch.setattr(ExpertBank, "pin", pin_by_copying)
    llm = LLM(out, expert_backend="triton", expert_cache_experts=3, cpu_expert_fraction=0.5)
    assert llm.runner.experts.control.bank_w13.data_ptr() == llm.runner.bank.w13.data_ptr()
    got = llm.generate(PROMPT, GREEDY)
    assert got.token_ids == want
    assert got.stats["fills"] > 0 and got.stats["cpu_computed"] > 0


@pytest.mark.parametrize("capacity", [16, 6])
def test_whole_layer_calls_take_the_cached_experts_from_the_pool(tiny_checkpoint, monkeypatch, capacity):
    """A whole-layer (prefill) call computes the experts the slot pool holds from the pool in
    place and streams only the others (no copy of the cached experts on the device), whether the
    pool holds every expert (16) or part of them (6, where the prefill's seed also changes the
    pool between layers). Simulated with the pool on the CPU (a host pool that holds every expert
    is otherwise the bank itself): the same tokens as the torch path, with the second prompt's
    layers partly computed from the pool."""
    from freetoken_engine.cache.offload import OffloadedExperts

    folder = tiny_checkpoint("qwen3_moe")
    prompts = [PROMPT, PROMPT[::-1]]
    reference = LLM(folder, expert_backend="torch")
    want = [reference.generate(p, GREEDY).token_ids for p in prompts]
    monkeypatch.setattr(OffloadedExperts, "bank_in_place", lambda self: False)
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=capacity, prefill_expert_threshold=4)
    experts = llm.runner.experts
    from_pool, pairs, real = [], [], experts._pool_forward

    def counted(layer, x, pair_tok, pair_exp):
        from_pool.append(int((experts.cache.slot_of[layer][pair_exp] >= 0).sum()))
        pairs.append(pair_exp.numel())
        return real(layer, x, pair_tok, pair_exp)

    monkeypatch.setattr(experts, "_pool_forward", counted)
    assert llm.generate(prompts[0], GREEDY).token_ids == want[0]
    first = len(from_pool)
    assert first > 0 and from_pool[0] == 0                 # the first prompt: an empty pool, all streamed
    assert llm.generate(prompts[1], GREEDY).token_ids == want[1]
    assert sum(from_pool[first:]) > 0                      # the second: resident experts from the pool
    if capacity == 16:     # the first prompt's layers filled the empty pool: nothing left to stream
        assert from_pool[first:] == pairs[first:]
    assert experts.streamer.gather_cached is False
    assert (experts.seeded > 0) == (capacity < 16)        # a partial pool was seeded between layers
    assert experts.filled_free > 0
    llm.runner.experts.sync_stats()
    llm.runner.cache.check_integrity(deep=True)            # every slot holds its expert's bank rows


def test_every_decode_batch_stays_below_the_whole_layer_threshold():
    """By default a MoE call streams whole layers only above the largest decode batch, so a busy
    server's decode steps keep the expert cache and its graphs; an explicit threshold is kept,
    and one that would send single tokens to the whole-layer path is refused."""
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.errors import ConfigError
    assert EngineConfig("m").expert_threshold == EngineConfig("m").max_batch + 1
    assert EngineConfig("m", max_batch=48).expert_threshold == 49
    assert EngineConfig("m", prefill_expert_threshold=16).expert_threshold == 16
    with pytest.raises(ConfigError, match="prefill_expert_threshold must be at least 2, got 1"):
        EngineConfig("m", prefill_expert_threshold=1)


def test_decode_calls_past_the_host_branch_pair_limit_sync_per_layer(tiny_checkpoint, monkeypatch):
    """The sync-free host branch takes calls of up to ``MAX_PAIRS`` pairs (branch.cpp's arrays).
    A decode batch beyond that (a max_batch x top_k past it) syncs per layer for its own calls
    and keeps the branch for smaller ones: the torch path's tokens either way."""
    from freetoken_engine.kernels import cpu_branch
    from freetoken_engine.llm import Lockstep

    def decode(llm, prompts, steps=4):
        batch = Lockstep(llm, prompts)
        for _ in range(steps):
            batch.step()
        batch.close()
        return batch.tokens

    monkeypatch.setattr(cpu_branch, "MAX_PAIRS", 8)                 # 4 tokens of the tiny model's top-2
    folder = tiny_checkpoint("qwen3_moe")
    prompts = [[5 + i, 17, 99 + 3 * i] for i in range(6)]
    want = decode(LLM(folder, expert_backend="torch"), prompts)
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=3, cpu_expert_fraction=0.5)
    experts = llm.runner.experts
    assert decode(llm, prompts) == want                               # 6 tokens a call: per-layer sync
    assert decode(llm, prompts[:3]) == want[:3]                       # 3 tokens a call: the host branch
    assert experts.host_branch is not None and experts.host_branch.br.max_tokens == 4
    assert experts.host_branch.br.totals["cpu_pairs"] > 0
    assert experts.graph_mode(4) == "branch" and experts.graph_mode(6) is None


@pytest.mark.parametrize("capacity,fraction,prompt", [(3, 0.5, PROMPT), (5, 0.0, PROMPT), (16, 0.0, PROMPT),
                                                      (1, 1.0, PROMPT), (3, 0.5, PROMPT * 8)])
def test_gpt_oss_experts_on_the_triton_path(tiny_checkpoint, capacity, fraction, prompt):
    """Experts with biases and the clamped gate (gpt-oss) through the device control step and the
    Triton MoE kernel (decode calls and, with the long prompt, whole-layer calls from the pool and
    the streamed buffer; every miss filled: the graph-capturable step; all experts held: the bank
    in place): the torch path's tokens; the decode steps' CPU pairs answered by the C++ host loop
    with the gate and the biases, no streamed or staged pair."""
    folder = tiny_checkpoint("gpt_oss")
    want = LLM(folder, expert_backend="torch").generate(prompt, GREEDY).token_ids
    llm = LLM(folder, expert_backend="triton", expert_cache_experts=capacity, cpu_expert_fraction=fraction)
    got = llm.generate(prompt, GREEDY)
    assert llm.runner.experts.backend == "triton" and got.token_ids == want
    s = got.stats
    assert s["fills"] + s["cpu_computed"] == s["misses"] and s["hits"] + s["misses"] > 0
    branch = llm.runner.experts.host_branch
    if fraction > 0 and capacity < 16:
        assert branch.br.totals["cpu_pairs"] > 0
        assert branch.br.totals["streamed_rows"] == branch.br.totals["stage_pairs"] == 0


def test_the_cpu_call_size_curve_sends_more_misses_to_the_cpu_and_changes_no_token(tiny_checkpoint):
    """A CPU that computes a call of n experts n times faster (kernels/split.py's curve, which the
    engine measures on its bank at start on a GPU): the device control step's fill table takes
    the curve, fewer misses cross to the cache, and the tokens stay the torch path's."""
    from freetoken_engine.kernels.split import fills_for
    folder = tiny_checkpoint("qwen3_moe")
    want = LLM(folder, expert_backend="torch").generate(PROMPT, GREEDY).token_ids
    stats = {}
    for speed in (None, (1.0, 2.0, 3.0, 4.0)):
        llm = LLM(folder, expert_backend="triton", expert_cache_experts=3, cpu_expert_fraction=0.5)
        llm.runner.cache.cpu_speed = speed
        llm.runner.set_fill_fraction(0.5)
        table = llm.runner.experts.control.fill_table.tolist()
        assert table == [fills_for(m, 0.5, speed=speed) for m in range(len(table))]
        got = llm.generate(PROMPT, GREEDY)
        assert got.token_ids == want
        stats[speed] = got.stats
        assert llm.runner.expert_stats()["cpu_call_speed"] == (list(speed) if speed else None)   # /admin/cache shows it
    flat, curved = stats[None], stats[(1.0, 2.0, 3.0, 4.0)]
    assert curved["cpu_computed"] / curved["misses"] > flat["cpu_computed"] / flat["misses"]
