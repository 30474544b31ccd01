"""Speculative decoding with n-gram drafts: whatever the drafts, the output is the plain decode's
(greedy and seeded sampling, penalties, log-probabilities, stops and length limits), a right
draft saves passes, a wrong one is undone (KV positions, a hybrid model's recurrent state)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.executor.speculate import NgramDrafter, TokenHistory
from freetoken_engine.scheduler.service import EngineService

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11, presence_penalty=0.5,
                         repetition_penalty=1.2, logprobs=2, ignore_eos=True)
BASE = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150, 31, 64, 2, 7, 19, 23]


def prompts(n: int) -> list[list[int]]:
    return [BASE[i % 5:] + BASE[:6 + i] + [40 + i] for i in range(n)]


def test_drafts_come_from_the_latest_longest_earlier_match():
    d = NgramDrafter(3, min_n=2, max_n=4)
    # the suffix (1, 2, 3) occurred twice before: the later occurrence's continuation is drafted
    assert d.propose(np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])) == [7, 5, 1]
    # a longer match wins over a more recent shorter one: (4, 1, 2) -> 8, not (1, 2) -> 9
    assert d.propose(np.array([4, 1, 2, 8, 6, 1, 2, 9, 4, 1, 2])) == [8, 6, 1]
    assert d.propose(np.array([1, 2, 3, 3])) == []                  # a 1-token match is below min_n
    assert NgramDrafter(3, min_n=1).propose(np.array([1, 2, 3, 3])) == [3]
    assert d.propose(np.array([1, 2, 3, 4, 5])) == []
    assert d.propose(np.array([1, 2, 9, 1, 2]), limit=1) == [9]
    assert d.propose(np.array([7, 7, 7, 7, 7])) == [7]               # runs draft up to the end
    with pytest.raises(ValueError):
        NgramDrafter(0)


def test_the_history_grows_past_its_first_capacity():
    h = TokenHistory(list(range(10)))
    for t in range(200):
        h.extend([t, t + 1])
    assert len(h) == 410 and h.array[:10].tolist() == list(range(10)) and h.array[-2:].tolist() == [199, 200]


class Oracle:
    """A drafter that knows each prompt's plain output and drafts it with every ``wrong``-th
    token changed: drafts that are kept in part, in whole, and refused at once."""

    def __init__(self, runs: dict[tuple, list[int]], wrong: int = 3, vocab: int = 320):
        self.runs, self.wrong, self.vocab, self.calls = runs, wrong, vocab, 0

    def __call__(self, drafter, history, limit=None):
        k = drafter.tokens if limit is None else min(limit, drafter.tokens)
        hist = history.tolist()
        for prompt, out in self.runs.items():
            if tuple(hist[:len(prompt)]) == prompt:
                done = len(hist) - len(prompt)
                draft = list(out[done:done + k])
                self.calls += 1
                if self.calls % self.wrong and len(draft) > 1:     # two of three drafts go wrong somewhere
                    bad = self.calls % len(draft)
                    draft[bad] = (draft[bad] + 1) % self.vocab
                return draft
        raise AssertionError("a draft for an unknown sequence")

    def install(self, monkeypatch) -> "Oracle":
        monkeypatch.setattr(NgramDrafter, "propose", lambda drafter, history, limit=None: self(drafter, history, limit))
        return self


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "lfm2_moe", "granitemoehybrid", "kimi_linear"])
def model(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_generate_with_any_drafts_equals_plain_decode(model, params, monkeypatch):
    plain = LLM(model)
    want = {tuple(p): plain.generate(p, params).token_ids for p in prompts(3)}
    Oracle(want).install(monkeypatch)
    spec = LLM(model, speculative_tokens=4)
    for p in prompts(3):
        got = spec.generate(p, params)
        assert got.token_ids == want[tuple(p)]
        # a right draft token saves a pass; a wrong one costs nothing but its row
        assert 0 < got.stats["draft_tokens_kept"] < got.stats["draft_tokens"]
        n, kept = len(got.token_ids), got.stats["draft_tokens_kept"]
        assert got.stats["decode_passes"] in (n - 1 - kept, n - kept)     # the last pass may end on a kept one
    if spec.runner.states is not None:
        assert spec.runner.states.free_slots == spec.runner.states.live


def test_real_ngram_drafts_on_a_repeating_model_keep_tokens_and_change_nothing(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")      # its greedy output falls into loops by itself
    params = SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True)
    p = [5, 17, 99, 200, 3, 44, 12]
    want = LLM(folder).generate(p, params).token_ids
    got = LLM(folder, speculative_tokens=4).generate(p, params)
    assert got.token_ids == want
    assert got.stats["draft_tokens_kept"] >= 10 and got.stats["decode_passes"] < 140


def test_stops_and_length_limits_inside_a_kept_draft(tiny_checkpoint, monkeypatch):
    folder = tiny_checkpoint("qwen3_moe")
    plain = LLM(folder)
    p = prompts(1)[0]
    out = plain.generate(p, GREEDY).token_ids
    stop = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(out[9],))
    want_stop = plain.generate(p, stop)
    Oracle({tuple(p): out}, wrong=10 ** 9).install(monkeypatch)         # always right
    spec = LLM(folder, speculative_tokens=4)
    got = spec.generate(p, stop)
    assert (got.token_ids, got.finish_reason) == (want_stop.token_ids, "stop")
    for n in (1, 2, 5, 7):
        got = spec.generate(p, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        assert got.token_ids == out[:n] and got.finish_reason == "length"


async def collect(svc: EngineService, ids: list[int], params):
    handle = svc.submit(ids, params)
    events = [ev async for ev in handle]
    return [e.token_id for e in events if e.token_id is not None], [e.logprob for e in events], events[-1].finish_reason


@pytest.mark.parametrize("kw", [dict(max_batch=8), dict(kv_cache_tokens=192, max_context=64, max_batch=6,
                                                        prefill_chunk=8)], ids=["roomy", "tight-kv"])
async def test_concurrent_requests_with_drafts_equal_plain_decode(model, kw, monkeypatch):
    """Requests drafting, prefilling and finishing in the same passes, with KV space short enough
    to preempt: each request's tokens and log-probabilities are the plain engine's."""
    runs = {}
    for name, spec in (("plain", 0), ("spec", 4)):
        if spec:
            Oracle({p: t for p, (t, _, _) in zip(map(tuple, prompts(8)), runs["plain"])}).install(monkeypatch)
        svc = EngineService.start(EngineConfig(model=model, speculative_tokens=spec, speculative_max_batch=8, **kw),
                                  wait=True)
        try:
            runs[name] = await asyncio.gather(*(collect(svc, p, SAMPLED if i % 2 else GREEDY)
                                                for i, p in enumerate(prompts(8))))
            svc.scheduler.check_integrity()
            stats = svc.stats()
            if spec:
                assert 0 < stats["draft_tokens_kept"] < stats["draft_tokens"]
            states = svc.runner.states
            if states is not None:
                assert states.free_slots == states.live and len(states._scratch) == spec * kw["max_batch"]
        finally:
            svc.shutdown()
    for (t0, lp0, f0), (t1, lp1, f1) in zip(runs["plain"], runs["spec"]):
        assert t0 == t1 and f0 == f1
        for a, b in zip(lp0, lp1):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == pytest.approx(b[0], abs=1e-4) and [i for i, _ in a[1]] == [i for i, _ in b[1]]


async def test_hybrid_drafts_stop_before_anchor_tokens(tiny_checkpoint, monkeypatch):
    """A drafted anchor token (a turn's end) would take its checkpoint out of place: drafts stop
    before one, and the checkpoint after a generated anchor is still written where it belongs."""
    from freetoken_engine.cache.states import anchor_token_ids
    folder = tiny_checkpoint("qwen3_next")
    plain = LLM(folder)
    p = prompts(1)[0]
    end = sorted(anchor_token_ids(plain.tokenizer))[0]
    seen = []

    def propose(drafter, history, limit=None):
        seen.append(len(history))
        return [end, 7, 8][:limit]
    monkeypatch.setattr(NgramDrafter, "propose", propose)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    svc = EngineService.start(EngineConfig(model=folder, speculative_tokens=3), wait=True)
    try:
        got, _, _ = await collect(svc, p, params)
        assert got == plain.generate(p, params).token_ids
        assert seen and svc.stats()["draft_tokens"] == 0          # every draft began with the anchor
    finally:
        svc.shutdown()


def test_bad_speculative_options_are_refused_clearly(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match="speculative-tokens"):
        EngineConfig(model=folder, speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative-ngram"):
        EngineConfig(model=folder, speculative_ngram=(3, 2))
    run = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(folder),
                          "--prompt-ids", "1,2,3", "--speculative-ngram", "3"], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "--speculative-ngram: must be MIN,MAX" in run.stderr


def test_draft_length_backs_off_after_misses_and_grows_after_hits():
    from freetoken_engine.executor.speculate import DraftLength
    n = DraftLength(8)
    n.update(8, 0)
    assert n.now == 1                 # a draft refused at once: one token next time
    n.update(1, 1)
    n.update(2, 2)
    assert n.now == 4                 # kept whole: doubles
    n.update(4, 2)
    assert n.now == 3                 # cut short: one more than were kept
    for _ in range(4):
        n.update(n.now, n.now)
    assert n.now == 8                 # never past the most asked
    n.update(0, 0)
    assert n.now == 8                 # no draft, no news
    n.update(8, 0)
    assert [n.next() for _ in range(2)] == [1, 1]
    waits = []
    for _ in range(6):                # refused one-token drafts pause drafting 1, 2, 4, ... steps
        n.update(1, 0)
        steps = 0
        while n.next() == 0:
            steps += 1
        waits.append(steps)
    assert waits == [1, 2, 4, 8, 16, 16]
    n.update(1, 1)
    assert n.next() == 2 and n.pause == 0      # a kept token ends the pause


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode-attention", "torch-attention"])
def test_a_verification_as_decode_rows_equals_its_chunk(tiny_checkpoint, monkeypatch, fused):
    """A draft's verification runs as one-token rows sharing the sequence's block table (the
    decode attention; on a GPU a decode graph): every row's K/V is written before any row
    attends (the CPU kernel in two calls, the GPU's in two launches, the torch path), so its
    logits are the chunk's, whichever thread runs which row."""
    import torch

    from freetoken_engine.executor.inputs import SeqChunk, as_decode_rows, build_inputs
    from freetoken_engine.layers import attention
    if not fused:
        monkeypatch.setattr(attention.cpu_attention, "supported", lambda *a: False)
    llm = LLM(tiny_checkpoint("qwen3_moe"))
    runner, kv, p = llm.runner, llm.runner.kv, prompts(2)
    blocks = [kv.allocate(kv.blocks_for(len(q) + 4)) for q in p]
    runner.model(*(lambda i: (i.ids, i.batch, kv, i.logits_at))(build_inputs(
        [SeqChunk(b, 0, q[:-1]) for b, q in zip(blocks, p)], kv.block_size, runner.device)))
    verify = [SeqChunk(b, len(q) - 1, [q[-1], 7, 8, 9], rows=4) for b, q in zip(blocks, p)]
    rows = as_decode_rows(verify)
    assert [(c.start, c.tokens) for c in rows[:4]] == [(len(p[0]) - 1 + j, [t]) for j, t in enumerate([p[0][-1], 7, 8, 9])]

    def run(chunks):
        inp = build_inputs(chunks, kv.block_size, runner.device)
        assert inp.batch.write_first == (chunks is rows)
        return runner.model(inp.ids, inp.batch, kv, inp.logits_at)
    chunked, expanded = run(verify), run(rows)
    assert chunked.shape == expanded.shape == (8, runner.mcfg.vocab_size)
    assert torch.allclose(chunked, expanded, atol=1e-5, rtol=1e-5)
    assert as_decode_rows([SeqChunk(blocks[0], 3, [1, 2], rows=2, state=0)])[0].tokens == [1, 2]   # recurrent: kept whole


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2_moe", "granitemoehybrid", "kimi_linear"])
def test_a_hybrid_verification_as_chained_rows_equals_its_chunk(tiny_checkpoint, model_type):
    """A hybrid model's verification as decode rows: each row of a sequence continues the
    recurrent state the row before it left and writes its own into the draft's snapshot slot
    (the last into the sequence's slot). Beside a lone decode row of a third sequence, the logits
    and every state slot equal the chunk's, anchor checkpoints (after a verification's first row,
    after a plain row) included: copies after the pass; a new prompt's chunk in the same pass
    stays a chunk, and the chained rows beside it run on the torch path, as a GPU runs them then. (The torch path runs them on a GPU when a pass mixes
    chained rows with a prompt's chunk; the kernels' own test is tests/engine/test_triton_deltanet.py.)"""
    import torch

    from freetoken_engine.executor.inputs import SeqChunk, as_decode_rows, build_inputs
    llm = LLM(tiny_checkpoint(model_type), speculative_tokens=3)
    runner, kv, states = llm.runner, llm.runner.kv, llm.runner.states
    assert not runner.chained_rows                # the CPU keeps the chunk (faster here); the GPU chains
    p = prompts(3)
    blocks = [kv.allocate(kv.blocks_for(len(q) + 4)) for q in p]
    slots = [states.take() for _ in p]
    with torch.inference_mode():
        runner.model(*(lambda i: (i.ids, i.batch, kv, i.logits_at))(build_inputs(
            [SeqChunk(b, 0, q[:-1], state=s) for b, q, s in zip(blocks, p, slots)], kv.block_size, runner.device)))
    scratch = [states.take_scratch(3) for _ in range(2)]
    ck = states.checkpoint_slots[:2]           # anchor checkpoints: after sequence 0's first row, after 2's row
    verify = [SeqChunk(b, len(q) - 1, [q[-1], 7, 8, 9], state=s, rows=4,
                       snapshots=((len(q), ck[0]),) * (i == 0) + tuple((len(q) + j, x) for j, x in enumerate(sc)))
              for i, (b, q, s, sc) in enumerate(zip(blocks, p, slots, scratch))]
    verify.append(SeqChunk(blocks[2], len(p[2]) - 1, [p[2][-1]], state=slots[2], snapshots=((len(p[2]), ck[1]),)))
    fourth = prompts(4)[3][:9]                 # and a new prompt's chunk in the same pass
    verify.append(SeqChunk(kv.allocate(kv.blocks_for(9)), 0, fourth, state=states.take()))
    rows = as_decode_rows(verify, chained=True)
    assert [(c.chain, c.state_out) for c in rows[:4]] == [(False, scratch[0][0]), (True, scratch[0][1]),
                                                        (True, scratch[0][2]), (True, slots[0])]
    assert len(rows) == 10 and not rows[8].chain and rows[8].state_out == -1 and not rows[8].snapshots
    assert rows[9] is verify[3]                                # a prompt's chunk stays whole
    assert rows[3].copies == ((scratch[0][0], ck[0]),) and rows[8].copies == ((slots[2], ck[1]),)
    assert as_decode_rows(verify)[0] is verify[0]            # not chained unless the model runs chains
    saved = states.conv.clone(), states.ssm.clone()

    @torch.inference_mode()
    def run(chunks):
        states.conv.copy_(saved[0])
        states.ssm.copy_(saved[1])
        inp = build_inputs(chunks, kv.block_size, runner.device)
        logits = runner.model(inp.ids, inp.batch, kv, inp.logits_at)
        for c in chunks:                                       # as the runner does after a pass
            for src, dst in c.copies:
                states.copy(src, dst)
        return logits, states.conv.clone(), states.ssm.clone()
    (chunked, conv_c, ssm_c), (chained, conv_r, ssm_r) = run(verify), run(rows)
    assert chunked.shape == chained.shape == (10, runner.mcfg.vocab_size)
    # the chunked form's and the recurrence's float32 rounding: up to 1.3e-5 on an AMD EPYC VM
    # (its matmuls round otherwise than a Xeon's), a wrong state would be off by orders more
    assert torch.allclose(chunked, chained, atol=1e-4, rtol=1e-5)
    used = slots + scratch[0] + scratch[1] + list(ck) + [verify[3].state]
    assert torch.allclose(conv_c[:, used], conv_r[:, used], atol=1e-5, rtol=1e-5)   # the projections' rounding
    assert torch.allclose(ssm_c[:, used], ssm_r[:, used], atol=1e-5, rtol=1e-5)
    # the snapshots differ, the anchors were written (a short convolution's state is all in conv)
    before, after = (saved[1], ssm_r) if ssm_r.numel() else (saved[0], conv_r)
    assert not torch.allclose(after[:, scratch[0][0]], after[:, scratch[0][2]])
    assert not torch.allclose(before[:, ck[0]], after[:, ck[0]])


async def test_drafts_under_a_grammar_give_the_constrained_output(tiny_checkpoint, monkeypatch):
    """A request held to a JSON Schema drafts too: each row's mask follows the tokens kept before
    it, so the constrained output (and its finish) is the plain engine's, drafts right or wrong."""
    from freetoken_engine.executor import guide
    from freetoken_engine.executor.guide import GuideSpec
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}}}
    folder = tiny_checkpoint("qwen3_moe")
    plain = LLM(folder)
    spec = GuideSpec(guide.json_schema(schema))
    params = [SamplingParams(max_new_tokens=40, temperature=0, guide=spec),
              SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, guide=spec, logprobs=1)]
    ps = prompts(2)
    want = {}
    for p, sp in zip(ps, params):
        g = plain.generate(p, sp)
        want[tuple(p)] = g.token_ids
        assert g.finish_reason == "stop"
    oracle = Oracle(want, wrong=2).install(monkeypatch)
    drafting = LLM(folder, speculative_tokens=4)
    for p, sp in zip(ps, params):
        got = drafting.generate(p, sp)
        assert (got.token_ids, got.finish_reason) == (want[tuple(p)], "stop")
        assert got.stats["draft_tokens_kept"] > 0
    svc = EngineService.start(EngineConfig(model=folder, speculative_tokens=4), wait=True)
    try:
        got = await asyncio.gather(*(collect(svc, p, sp) for p, sp in zip(ps, params)))
        assert [(t, f) for t, _, f in got] == [(want[tuple(p)], "stop") for p in ps]
        assert svc.stats()["draft_tokens_kept"] > 0 and oracle.calls > 0
    finally:
        svc.shutdown()


async def test_by_default_only_a_lone_decoding_request_drafts(tiny_checkpoint, monkeypatch):
    """``--speculative-max-batch`` (default 1): a step with two decoding requests carries no draft,
    one with a single request does; the outputs are the plain engine's either way."""
    folder = tiny_checkpoint("qwen3_moe")
    plain = LLM(folder)
    ps = prompts(2)
    want = {tuple(p): plain.generate(p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)).token_ids
            for p in ps}
    Oracle(want, wrong=10 ** 9).install(monkeypatch)
    sizes = []
    from freetoken_engine.scheduler.drafts import Drafts
    inner = Drafts._with_drafts

    def spy(self, batch):
        out = inner(self, batch)
        sizes.append((sum(r.pending == 1 for r, _ in batch), sum(len(r.draft) for r, _ in out)))
        return out
    monkeypatch.setattr(Drafts, "_with_drafts", spy)
    svc = EngineService.start(EngineConfig(model=folder, speculative_tokens=4), wait=True)
    try:
        got = await asyncio.gather(*(collect(svc, p, SamplingParams(max_new_tokens=24 + 16 * i, temperature=0,
                                                                   ignore_eos=True)) for i, p in enumerate(ps)))
        assert [t for t, _, _ in got] == [want[tuple(p)][:24 + 16 * i] for i, p in enumerate(ps)]
    finally:
        svc.shutdown()
    assert all(drafted == 0 for decoders, drafted in sizes if decoders > 1)
    assert any(drafted > 0 for decoders, drafted in sizes if decoders == 1)   # the longer one, once alone
    with pytest.raises(ConfigError, match="speculative-max-batch"):
        EngineConfig(model=folder, speculative_max_batch=0)
