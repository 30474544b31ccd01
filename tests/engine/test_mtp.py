"""Speculative decoding with the checkpoint's own multi-token-prediction layer
(``--speculative-method mtp``): the engine's drafts are the ones transformers' Qwen3-Next modules
compute from the same weights (the MTP layer over the model's final hidden states and the next
tokens, then fed its own output), the output is the plain decode's whatever the head predicts,
and a head trained on the model's own text gets most of its drafts kept."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.executor import mtp as mtp_module
from freetoken_engine.executor.speculate import DraftLength
from freetoken_engine.scheduler.service import EngineService
from test_speculative import collect
from tiny_models import add_mtp_layer, load_reference, make_tiny_checkpoint, mtp_reference, save_mtp_layer

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.2,
                         logprobs=2, ignore_eos=True)
PROMPTS = [[5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150], [31, 64, 2, 7, 19, 23, 5, 17],
           [150, 31, 64, 2, 7, 19, 23, 8, 9, 77, 5, 17, 99, 200, 3, 44, 12], [7, 7, 19]]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), "qwen3_next")
    add_mtp_layer(path)
    return path


@pytest.fixture(scope="module")
def plain(mtp_model):
    llm = LLM(mtp_model)
    return {(tuple(p), s.temperature): llm.generate(p, s) for p in PROMPTS for s in (GREEDY, SAMPLED)}


def qwen_join(mtp: dict, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's MTP input: the next tokens' embeddings and the hidden states, each normed, joined."""
    return mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](embedded), mtp["pre_fc_norm_hidden"](hidden)], -1))


def mtp_rows(ref, mtp: dict, nxt: torch.Tensor, hidden: torch.Tensor, join=qwen_join) -> torch.Tensor:
    """The MTP layer's normed output at rows 0..n-1 without a cache: row i joins ``hidden[i]`` and
    the embedding of ``nxt[i]`` (``join``), then the layer runs under a causal mask."""
    n = len(nxt)
    x = join(mtp, ref.model.embed_tokens(nxt), hidden)[None]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = mtp["layer"](x, position_embeddings=ref.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
    return mtp["norm"]((out[0] if isinstance(out, tuple) else out)[0])


def reference_drafts(ref, mtp: dict, tokens: list[int], k: int, join=qwen_join) -> list[int]:
    """k greedy drafts after ``tokens`` (the last one sampled, not yet run), computed without a
    cache: the model's final hidden states (after its norm) at every position, the MTP layer over
    (hidden at i, token i + 1) with a causal mask, and each further draft with the head's own
    output and guess appended as one more row."""
    with torch.no_grad():
        hidden = list(ref.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0])
        nxt, drafts = list(tokens[1:]), []
        for _ in range(k):
            g = mtp_rows(ref, mtp, torch.tensor(nxt), torch.stack(hidden), join)[-1]
            drafts.append(int(ref.lm_head(g).argmax()))
            hidden.append(g)
            nxt.append(drafts[-1])
    return drafts


def spy_drafts(monkeypatch) -> list[tuple[int, list[int]]]:
    """Every non-empty MTP draft the engine makes: (position of the token it follows, draft)."""
    seen = []
    real = mtp_module.MtpSequence.propose

    def propose(self, runner, blocks, computed, limit, *rest):
        draft = real(self, runner, blocks, computed, limit, *rest)
        if draft:
            seen.append((computed, draft))
        return draft
    monkeypatch.setattr(mtp_module.MtpSequence, "propose", propose)
    return seen


@pytest.mark.parametrize("rows", [False, True], ids=["chunks", "rows"])
def test_the_engines_mtp_drafts_are_transformers_modules_drafts(mtp_model, plain, monkeypatch, rows):
    # every step drafts the full 3 tokens (no shortening after a refusal), so the head's chain of
    # its own outputs is checked at every position; the output stays the plain decode's. "rows":
    # the MTP passes as one-token rows, as a GPU runs them (there in graphs)
    monkeypatch.setattr(DraftLength, "update", lambda self, drafted, kept: None)
    seen = spy_drafts(monkeypatch)
    llm = LLM(mtp_model, speculative_tokens=3, speculative_method="mtp")
    llm.runner.mtp_rows = rows
    ref, mtp = load_reference(mtp_model), mtp_reference(mtp_model)
    for prompt in PROMPTS[:2]:
        seen.clear()
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == plain[(tuple(prompt), 0)].token_ids
        assert len(seen) >= 10 and all(len(d) == 3 for _, d in seen[:-2])
        tokens = prompt + out.token_ids
        for computed, draft in seen:
            assert draft == reference_drafts(ref, mtp, tokens[:computed + 1], len(draft)), computed


def test_mtp_drafts_leave_the_output_unchanged_greedy_and_seeded(mtp_model, plain):
    llm = LLM(mtp_model, speculative_tokens=4, speculative_method="mtp", prefill_chunk=5)
    for prompt in PROMPTS:
        for params in (GREEDY, SAMPLED):
            out = llm.generate(prompt, params)
            want = plain[(tuple(prompt), params.temperature)]
            assert out.token_ids == want.token_ids and out.finish_reason == want.finish_reason
            assert out.stats["draft_tokens"] > 0


@pytest.mark.parametrize("kw", [dict(max_batch=8, prefill_chunk=7),
                                dict(kv_cache_tokens=160, max_context=64, max_batch=6, prefill_chunk=8)],
                         ids=["roomy", "tight-kv"])
async def test_mtp_drafts_through_the_scheduler_batched_preempted_and_after_a_prefix_reuse(mtp_model, plain, kw,
                                                                                            monkeypatch):
    """Requests drafting together (their rows through the MTP layer in one pass a step, their
    drafts' chains in one pass per token), with KV space short enough to preempt (their MTP rows
    run again): each gets the plain tokens."""
    from freetoken_engine.scheduler import drafts
    together, real = [], drafts.propose_all
    monkeypatch.setattr(drafts, "propose_all",
                        lambda runner, items, *rest: together.append(len(items)) or real(runner, items, *rest))
    cfg = EngineConfig(model=mtp_model, speculative_tokens=3, speculative_method="mtp", speculative_max_batch=8, **kw)
    svc = EngineService.start(cfg, wait=True)
    try:
        jobs = [(p, params) for p in PROMPTS for params in (GREEDY, SAMPLED)]
        outs = await asyncio.gather(*(collect(svc, p, params) for p, params in jobs))
        again = await collect(svc, PROMPTS[0], GREEDY)      # its prompt's blocks come from the tree
        svc.scheduler.check_integrity()
        stats = svc.stats()
    finally:
        svc.shutdown()
    assert [o[0] for o in outs] == [plain[(tuple(p), params.temperature)].token_ids for p, params in jobs]
    assert again[0] == plain[(tuple(PROMPTS[0]), 0)].token_ids
    assert stats["draft_tokens"] > 0 and max(together) > 1


def train_head(ref, mtp: dict, texts: list[list[int]], steps: int = 300, join=qwen_join) -> None:
    """Fit the MTP modules to the model's own text: at position i, from (hidden i, token i + 1),
    the token i + 2 (what the MTP layers are trained for)."""
    with torch.no_grad():
        rows = [(ref.model(input_ids=torch.tensor([t[:-2]])).last_hidden_state[0], torch.tensor(t[1:-1]),
                 torch.tensor(t[2:])) for t in texts]
    params = [p for m in mtp.values() for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for hidden, nxt, target in rows:
            logits = ref.lm_head(mtp_rows(ref, mtp, nxt, hidden, join))
            loss = loss + torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()


def fitted_mtp_model(path, params: SamplingParams, **engine):
    """A tiny Qwen3-Next checkpoint at ``path`` whose MTP layer is fitted to the model's greedy
    text after ``PROMPTS`` (the texts, generated with ``engine`` options, are returned too)."""
    path = make_tiny_checkpoint(path, "qwen3_next")
    add_mtp_layer(path)
    base = LLM(path, **engine)
    texts = [p + base.generate(p, params).token_ids for p in PROMPTS]
    del base
    ref, mtp = load_reference(path), mtp_reference(path)
    for p in ref.parameters():
        p.requires_grad_(False)
    train_head(ref, mtp, texts)
    save_mtp_layer(path, mtp)
    return path, texts


def plain_outputs(llm: LLM, texts: list[list[int]], params: SamplingParams) -> list:
    """Each of PROMPTS through the drafting ``llm``: its tokens asserted to be the plain decode's
    (``texts``, prompt included); the outputs."""
    outs = [llm.generate(p, params) for p in PROMPTS]
    for p, text, out in zip(PROMPTS, texts, outs):
        assert out.token_ids == text[len(p):]
    return outs


def total(outs: list, stat: str) -> int:
    return sum(out.stats[stat] for out in outs)


def test_a_head_that_predicts_the_model_gets_its_drafts_kept(tmp_path):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    path, texts = fitted_mtp_model(tmp_path / "m", params)
    outs = plain_outputs(LLM(path, speculative_tokens=4, speculative_method="mtp"), texts, params)
    kept, drafted, passes = total(outs, "draft_tokens_kept"), total(outs, "draft_tokens"), total(outs, "decode_passes")
    made = sum(len(out.token_ids) for out in outs)
    # about half the drafts kept, 2.3 tokens a pass here; an untrained head gets none kept
    assert kept >= 0.35 * drafted and passes < 0.6 * made, (kept, drafted, passes, made)


def test_mtp_needs_a_checkpoint_that_ships_it_and_a_draft_length(tmp_path, mtp_model):
    bare = make_tiny_checkpoint(tmp_path / "bare", "qwen3_next")
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        LLM(bare, speculative_tokens=2, speculative_method="mtp")
    with pytest.raises(ConfigError, match="--speculative-tokens"):
        LLM(mtp_model, speculative_method="mtp")
    with pytest.raises(ConfigError, match="ngram or mtp"):
        LLM(mtp_model, speculative_tokens=2, speculative_method="eagle")
    run = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(bare),
                          "--prompt", "hi", "--speculative-tokens", "2", "--speculative-method", "mtp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1
    assert "no multi-token-prediction layer" in run.stderr


def test_the_mtp_layer_is_only_loaded_when_it_drafts(mtp_model):
    plain_llm = LLM(mtp_model)
    assert plain_llm.runner.model.mtp is None
    llm = LLM(mtp_model, speculative_tokens=2, speculative_method="mtp")
    # its routed experts are the bank's last layer, its KV the pool's
    assert llm.runner.bank.num_layers == plain_llm.runner.bank.num_layers + 1
    assert llm.runner.kv.k.shape[0] == plain_llm.runner.kv.k.shape[0] + 1


def test_a_packed_folder_carries_the_mtp_layer(mtp_model, plain, tmp_path):
    """``freetoken convert`` packs the MTP layer (its routed experts as the bank's last layer):
    the packed folder drafts exactly as the Hugging Face one, and runs without it as well."""
    from freetoken_engine.packed import convert
    out = convert(mtp_model, tmp_path / "packed", progress=False)
    hf = LLM(mtp_model, speculative_tokens=3, speculative_method="mtp")
    packed = LLM(out, speculative_tokens=3, speculative_method="mtp")
    for prompt in PROMPTS[:2]:
        a, b = hf.generate(prompt, GREEDY), packed.generate(prompt, GREEDY)
        assert a.token_ids == b.token_ids == plain[(tuple(prompt), 0)].token_ids
        assert (a.stats["draft_tokens"], a.stats["draft_tokens_kept"]) == (b.stats["draft_tokens"],
                                                                           b.stats["draft_tokens_kept"])
    without = LLM(out)
    assert without.runner.model.mtp is None and without.runner.bank.num_layers == packed.runner.bank.num_layers - 1
    assert without.generate(PROMPTS[0], GREEDY).token_ids == plain[(tuple(PROMPTS[0]), 0)].token_ids


async def test_mtp_rows_of_decode_steps_beside_a_long_prompt_join_the_others(tmp_path, monkeypatch):
    """Requests decoding between the layers of a long prompt's pass (scheduler/beside.py) record
    those steps' rows too, without a gap, and draft after it; every output is as alone."""
    from beside_cases import LAYERS, LONG, SHORT, always_due, greedy, run_all
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_next", num_hidden_layers=LAYERS)
    add_mtp_layer(path)
    llm = LLM(path)
    want = [llm.generate(p, greedy(24)).token_ids for p in SHORT], llm.generate(LONG, greedy(4)).token_ids
    gaps, real = [], mtp_module.MtpSequence.record

    def record(self, start, hidden):
        if self.rows and start != self.start + self.pending:
            gaps.append((self.start + self.pending, start))
        real(self, start, hidden)
    monkeypatch.setattr(mtp_module.MtpSequence, "record", record)
    cfg = EngineConfig(model=path, max_batch=4, prefill_chunk=100, decode_pause_ms=50, speculative_tokens=3,
                       speculative_method="mtp", speculative_max_batch=4)
    svc = EngineService.start(cfg, wait=True)
    try:
        always_due(svc)
        assert await run_all(svc) == want
        stats = svc.stats()
        svc.scheduler.check_integrity()
    finally:
        svc.shutdown()
    assert stats["decode_steps_beside"] > 0 and stats["draft_tokens"] > 0 and not gaps


def test_mtp_drafts_under_a_grammar_give_the_constrained_output(mtp_model):
    from freetoken_engine.executor import guide
    from freetoken_engine.executor.guide import GuideSpec
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}}}
    spec = GuideSpec(guide.json_schema(schema))
    params = [SamplingParams(max_new_tokens=40, temperature=0, guide=spec),
              SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, guide=spec, logprobs=1)]
    plain_llm, drafting = LLM(mtp_model), LLM(mtp_model, speculative_tokens=4, speculative_method="mtp")
    for p, sp in zip(PROMPTS, params):
        want, got = plain_llm.generate(p, sp), drafting.generate(p, sp)
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert got.stats["draft_tokens"] > 0


def test_drafts_among_the_first_token_ids_only(mtp_model, plain, monkeypatch):
    """``--speculative-draft-vocab N``: every MTP draft token is below N (the LM head's first N
    rows are read), the output is the plain decode's."""
    seen = spy_drafts(monkeypatch)
    llm = LLM(mtp_model, speculative_tokens=3, speculative_method="mtp", speculative_draft_vocab=100)
    for prompt in PROMPTS[:2]:
        assert llm.generate(prompt, GREEDY).token_ids == plain[(tuple(prompt), 0)].token_ids
    assert seen and all(t < 100 for _, d in seen for t in d)
    with pytest.raises(ConfigError, match="--speculative-draft-vocab"):
        EngineConfig(model=mtp_model, speculative_tokens=3, speculative_method="mtp", speculative_draft_vocab=-1)
