"""Sliding-window layers' own KV store (cache/kv.py): they keep only the keys their windows can
still see, and nothing a user reads changes: tokens and logits equal the single pool's and
transformers', alone, batched, across turns that resume from the prefix tree, and with drafts."""
from __future__ import annotations

import asyncio

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.cache import kv as kvmod
from freetoken_engine.cache.kv import KVPool, kv_pool_bytes
from freetoken_engine.cache.radix import RadixCache
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import OutOfKVCache
from freetoken_engine.scheduler.service import EngineService
from test_parity import reference_greedy
from test_speculative import Oracle
from tiny_configs import GPT_OSS_20B
from tiny_models import load_reference

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150] * 2
GREEDY = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
#: blocks of 4 tokens against windows of 4: every sequence soon outgrows its window
SMALL = dict(kv_block_size=4, max_batch=2, prefill_chunk=8)


@pytest.fixture
def small_store(monkeypatch):
    """A store with no room to spare (no decode steps beside a prefill, one cached window), so
    that a 60-token generation runs out of it and sweeps."""
    monkeypatch.setattr(kvmod, "BESIDE_TOKENS", 0)
    monkeypatch.setattr(kvmod, "CACHED_WINDOWS", 1)


@pytest.mark.parametrize("model_type,overrides", [
    ("gpt_oss", {}),                                  # sliding and full layers alternate
    ("mixtral", {"sliding_window": 4}),               # every layer windowed: no full pool left
])
def test_the_window_store_gives_the_single_pools_tokens_and_transformers(tiny_checkpoint, small_store,
                                                                         model_type, overrides):
    folder = tiny_checkpoint(model_type, **overrides)
    store = LLM(folder, **SMALL)
    plain = LLM(folder, **SMALL, kv_window_store=False)
    kv = store.runner.kv
    assert 0 < kv.window_blocks < kv.num_blocks // 10 and plain.runner.kv.window_blocks == 0
    assert kv.nbytes < plain.runner.kv.nbytes
    for fn in ("prefill_logits", "forward_logits"):     # the whole prompt in one pass; token by token
        assert torch.equal(getattr(store, fn)(PROMPT), getattr(plain, fn)(PROMPT))
    got = store.generate(PROMPT, GREEDY).token_ids       # 84 tokens: 21 blocks through a store of fewer
    assert kv.window_blocks < 21
    assert got == plain.generate(PROMPT, GREEDY).token_ids == reference_greedy(load_reference(folder), PROMPT, 60)
    kv.check_integrity()
    assert kv.used_blocks == 0 and not kv.half.any()      # everything given back


@pytest.mark.parametrize("model_type", ["exaone_moe", "afmoe", "granitemoe_swa", "granite_swa", "mistral", "olmo3",
                                        "cohere2_moe", "flint", "kolibri1"])
def test_every_windowed_family_gives_the_single_pools_tokens(tiny_checkpoint, small_store, model_type):
    """The other supported families with windowed layers (first, last, every, most of them; with
    sinks, with a rotary on windowed layers only): the same logits and tokens."""
    folder = tiny_checkpoint(model_type)
    store, plain = LLM(folder, **SMALL), LLM(folder, **SMALL, kv_window_store=False)
    assert 0 < store.runner.kv.window_blocks < 21
    assert torch.equal(store.prefill_logits(PROMPT), plain.prefill_logits(PROMPT))
    assert store.generate(PROMPT, GREEDY).token_ids == plain.generate(PROMPT, GREEDY).token_ids


def test_drafts_through_the_window_store_keep_the_tokens(tiny_checkpoint, small_store, monkeypatch):
    """Drafts write keys past the accepted ones and are cut back (two of three go wrong
    somewhere): the store keeps what the next pass reads."""
    folder = tiny_checkpoint("gpt_oss")
    want = LLM(folder, **SMALL, kv_window_store=False).generate(PROMPT, GREEDY).token_ids
    Oracle({tuple(PROMPT): want}).install(monkeypatch)
    # 6 blocks of 4 tokens: a window, a draft's pass and what it may be cut back to; nearly every
    # new block sweeps
    monkeypatch.setattr(kvmod, "window_store_blocks", lambda *args: 7)
    got = LLM(folder, **SMALL, speculative_tokens=4).generate(PROMPT, GREEDY)
    assert got.token_ids == want
    assert 0 < got.stats["draft_tokens_kept"] < got.stats["draft_tokens"]


async def _collect(svc: EngineService, ids: list[int], params=GREEDY) -> tuple[list[int], int]:
    handle = svc.submit(ids, params)
    out = [ev.token_id async for ev in handle if ev.token_id is not None]
    return out, handle.cached_tokens


async def test_served_requests_batched_and_resumed_keep_their_tokens(tiny_checkpoint, small_store):
    """Requests batched together, a second turn resuming after the first (its window kept by the
    prefix tree), and the first prompt again after its long answer (whose window at the
    prompt's end the store let go: it resumes earlier) all give the tokens of one request on a
    single pool; the store stays consistent."""
    folder = tiny_checkpoint("gpt_oss")
    alone = LLM(folder, **SMALL, kv_window_store=False)
    prompts = [PROMPT[:10 + 3 * i] for i in range(4)]
    svc = EngineService.start(EngineConfig(model=folder, **SMALL), wait=True)
    try:
        kv = svc.runner.kv
        assert kv.window_blocks
        got = await asyncio.gather(*(_collect(svc, p) for p in prompts))
        assert [g[0] for g in got] == [alone.generate(p, GREEDY).token_ids for p in prompts]
        first, _ = await _collect(svc, PROMPT)
        turn2 = PROMPT + first + [11, 12, 13]
        out2, cached = await _collect(svc, turn2)
        assert out2 == alone.generate(turn2, GREEDY).token_ids
        assert cached >= len(PROMPT) + len(first) - 8       # resumed from the first turn's end
        again, cached = await _collect(svc, PROMPT)
        assert again == first and cached < len(PROMPT) - 4
        svc.scheduler.check_integrity()
        assert kv.used_blocks == svc.scheduler.radix.cached_blocks()
        stats = svc.stats()                     # the store, as /metrics reports it
        assert stats["kv_window_blocks_total"] == kv.window_blocks
        # the tree keeps windows, not every key: those of the prompt computed again replaced the
        # first run's, which the store had let go
        assert 0 < stats["kv_window_blocks_used"] == kv.used_window_blocks < kv.used_blocks
    finally:
        svc.shutdown()


async def test_a_new_conversation_resumes_after_the_system_prompt(tiny_checkpoint, small_store):
    """The first turn boundary (``<|im_end|>``) after a system prompt keeps its window through
    the sweeps of a long first conversation: the next conversation skips the system prompt."""
    folder = tiny_checkpoint("gpt_oss")
    svc = EngineService.start(EngineConfig(model=folder, **SMALL), wait=True)
    try:
        system = PROMPT[:18] + [svc.runner.tokenizer.token_to_id("<|im_end|>")]      # 19 tokens
        await _collect(svc, system + [11, 12, 13, 14, 15])          # 84 tokens through 15 blocks
        second = system + [21, 22, 23, 24, 25]
        out, cached = await _collect(svc, second)
        assert cached == 16                                         # the system prompt's full blocks
        assert out == LLM(folder, **SMALL, kv_window_store=False).generate(second, GREEDY).token_ids
    finally:
        svc.shutdown()


def _pool(window_blocks: int = 8) -> KVPool:
    # two KV layers, the first windowed (4 tokens), blocks of 2 tokens
    return KVPool(2, 16, 2, 1, 2, torch.float32, torch.device("cpu"), windows=(4, None), window_blocks=window_blocks)


def test_a_block_holds_window_keys_while_a_table_can_read_them():
    kv = _pool()
    assert kv.caches(0)[0].shape[0] == 8 * 2 and kv.caches(1)[0].shape[0] == 16 * 2
    assert kv.nbytes == kv_pool_bytes(2, 32, 1, 2, 4, window_layers=1, window_tokens=16)
    a = kv.allocate(8)
    kv.before_pass([(a, 0, 12, 12)])                   # a 12-token prompt: 6 halves of the store's 7
    assert all(kv.half[b] for b in a[:6]) and len(kv._win_free) == 1
    kv.before_pass([(a, 12, 16, 13)])                  # a 3-token draft, which may be cut back to 13:
    assert [bool(kv.half[x]) for x in a] == [False] * 4 + [True] * 4    # the store swept before 13 - 4
    b = kv.allocate(3)
    kv.before_pass([(b, 0, 6, 6)])
    assert kv.resumable(a) == 8 and kv.resumable(a[:4]) == 0
    kv.check_integrity()
    kv.release(a)
    assert len(kv._win_free) == 4                      # a freed block gives its half back
    c = kv.allocate(2)
    with pytest.raises(RuntimeError, match="lost its window keys"):
        kv.before_pass([(c, 3, 4, 4)])                    # reads positions 0-2, never written


def test_the_prefix_tree_keeps_its_resume_points_and_a_full_store_says_so():
    kv = _pool(window_blocks=6)
    radix = RadixCache(kv)
    kv.keep_window = lambda: radix.window_blocks(4)
    a = kv.allocate(4)
    kv.before_pass([(a, 0, 8, 8)])
    radix.insert(list(range(8)), a)                    # a prompt ends after block 4
    kv.release(a)
    b = kv.allocate(2)
    kv.before_pass([(b, 0, 4, 4)])                        # the store is short: the tree's last window stays
    assert [bool(kv.half[x]) for x in a] == [False, False, True, True]
    matched = radix.match(list(range(8)) + [9], 8)
    assert kv.resumable(matched) == 4
    kv.release(matched)
    c = kv.allocate(2)
    with pytest.raises(OutOfKVCache, match="window KV store"):
        kv.before_pass([(c, 0, 4, 4)])                    # b's keys and the tree's window leave it one


def test_a_system_prompt_keeps_its_window_for_the_next_conversation():
    """A conversation whose system prompt ends after block 4 (``insert``'s marks: the scheduler's
    first turn boundary), and another's keys that make the store sweep: a new conversation on the
    same system prompt resumes after it; where prefixes part, the tree keeps the window too."""
    kv = _pool(window_blocks=8)
    radix = RadixCache(kv)
    kv.keep_window = lambda: radix.window_blocks(6)
    system = list(range(8))                            # 4 blocks
    a = kv.allocate(6)
    kv.before_pass([(a, 0, 12, 12)])
    radix.insert(system + [100] * 4, a, marks=(4,))
    kv.release(a)
    b = kv.allocate(4)
    kv.before_pass([(b, 0, 8, 8)])                     # an unrelated prompt: the store sweeps
    assert [bool(kv.half[x]) for x in a] == [False, False, True, True, True, True]
    matched = radix.match(system + [300] * 4, 12)
    assert len(matched) == 4 and kv.resumable(matched) == 4
    kv.release(matched)
    radix.insert(system + [200] * 2, a[:4] + kv.allocate(1), end=False)   # another conversation parts there
    node = radix.root
    for i in range(4):
        node = node.children[tuple(system[2 * i:2 * i + 2])]
    node.end = False                                   # only the parting keeps it now
    assert set(a[2:4]) <= set(radix.window_blocks(6))
    kv.check_integrity()


def test_gpt_oss_20b_on_a_gpu_leaves_its_expert_cache_2_7_gb_more(monkeypatch):
    """At the defaults on a GPU (its 131,072-token context, 32 sequences, 8k prefill steps),
    gpt-oss-20b's KV cache takes 3.7 GB instead of 6.4: half its layers see 128 tokens. The
    expert cache gets what that frees (40 GB free, its experts dense in bfloat16)."""
    from types import SimpleNamespace

    from freetoken_engine.executor import budget
    from freetoken_engine.models import family
    m = family("gpt_oss").parse(GPT_OSS_20B)
    kv_blocks = 131072 // 16
    per = 3 * 2880 * 2880 * 2
    bank = SimpleNamespace(total_experts=24 * 32, expert_bytes=per, hidden=2880, inter=2880, mxfp4=False,
                           num_experts=32, w13=[SimpleNamespace(nbytes=32 * per * 2 // 3)],
                           w2=[SimpleNamespace(nbytes=32 * per // 3)])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 10**9, 80 * 10**9))
    monkeypatch.setattr(budget, "reads_grouped_heads", lambda *a: True)     # flash attention (no GPU here)
    n = {store: budget.cache_experts(EngineConfig(model="gpt-oss-20b", device="cuda", kv_window_store=store), m,
                                     bank, torch.device("cuda"), torch.bfloat16, 131072, kv_blocks)
         for store in (True, False)}
    windows, blocks = kvmod.kv_windows(EngineConfig(model="gpt-oss-20b", device="cuda"), m, kv_blocks)
    assert windows.count(128) == 12 and 0 < blocks < kv_blocks / 7
    full = kv_pool_bytes(24, 131072, 8, 64, 2)
    kept = kv_pool_bytes(24, 131072, 8, 64, 2, window_layers=12, window_tokens=blocks * 16)
    assert 6.4e9 < full < 6.5e9 and 3.6e9 < kept < 3.8e9
    assert (full - kept) // per <= n[True] - n[False] <= -(-(full - kept) // per)


def test_a_prompts_chunks_keep_the_window_they_read_when_the_store_sweeps(tiny_checkpoint, small_store):
    """Three prompts of 250, 8 and 1 tokens prefilled in 16-token chunks, then decoded together,
    through a store that runs short: a chunk's new blocks may sweep the store, and the window
    behind the chunk's start (which its table's resume point, the chunk's end, does not cover)
    must stay. It did not: "KV block 19 lost its window keys" (found by the GPU test)."""
    from graph_cases import PROMPTS, lockstep
    folder = tiny_checkpoint("gpt_oss")
    opts = dict(dtype="float32", kv_block_size=4, max_batch=3, prefill_chunk=16)
    want, want_logits = lockstep(LLM(folder, **opts, kv_window_store=False), PROMPTS, 40)
    llm = LLM(folder, **opts)
    assert 0 < llm.runner.kv.window_blocks < 40
    got, logits = lockstep(llm, PROMPTS, 40)
    assert got == want and torch.equal(logits, want_logits)
    llm.runner.kv.check_integrity()
