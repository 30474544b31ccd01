"""Constrained decoding in the engine: the grammar's mask, the reasoning/tool-call states around
it, logit biases and log-probabilities, offline (``LLM.generate``) and through the scheduler."""
from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import InvalidRequest
from freetoken_engine.executor import guide
from freetoken_engine.executor.guide import Guide, GuideSpec
from freetoken_engine.executor.sampler import sample
from freetoken_engine.scheduler.service import EngineService

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "ok", "n"],
          "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen3_moe"))


def ids_of(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def tag(llm, name: str) -> int:
    return llm.tokenizer.token_to_id(name)


def allowed(g: Guide, n_vocab: int) -> set[int]:
    x = g.constrain(torch.zeros(n_vocab))
    return set(torch.nonzero(x == 0).flatten().tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_follows_the_schema_and_stops_when_complete(llm, temperature):
    spec = GuideSpec(guide.json_schema(SCHEMA))
    for seed in range(3):
        out = llm.generate(ids_of(llm, "Hello"), SamplingParams(max_new_tokens=80, temperature=temperature,
                                                                seed=seed, guide=spec))
        text = llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == text.strip() and " " not in text      # compact, as OpenAI writes it


def test_regex_and_choice_grammars(llm):
    for grammar, check in [(guide.regex(r"[0-9]{3}-[a-z]{2}"), r"^\d{3}-[a-z]{2}$"),
                           (guide.choice(["yes", "no", "maybe"]), r"^(yes|no|maybe)$")]:
        out = llm.generate(ids_of(llm, "Answer"), SamplingParams(max_new_tokens=20, temperature=1.0, seed=1,
                                                                 guide=GuideSpec(grammar)))
        text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert re.match(check, text), text


def test_bad_grammars_say_what_is_wrong():
    with pytest.raises(InvalidRequest, match="nonsense"):
        guide.json_schema({"type": "nonsense"})
    with pytest.raises(InvalidRequest, match="regex"):
        guide.regex("[unclosed")
    with pytest.raises(InvalidRequest, match="non-empty"):
        guide.choice([])
    with pytest.raises(InvalidRequest, match="grammar"):
        guide.lark("start: undefined_rule")


def test_reasoning_is_free_then_whitespace_then_the_grammar(llm):
    tok, vocab = llm.tokenizer, llm.runner.mcfg.vocab_size
    close = tag(llm, "</think>")
    g = Guide(GuideSpec(guide.json_schema(SCHEMA), reasoning=True, close_reasoning=close), tok, vocab)
    assert len(allowed(g, vocab)) == vocab                  # reasoning: nothing masked
    for t in ids_of(llm, "the quick fox"):
        assert g.advance(t) is False
    g.advance(close)
    newline = ids_of(llm, "\n")[0]
    ok = allowed(g, vocab)
    assert newline in ok and ids_of(llm, '{"')[0] in ok and ids_of(llm, "the")[0] not in ok
    g.advance(newline)
    done = [g.advance(t) for t in ids_of(llm, '{"city":"Rome","ok":false,"n":7}')]
    assert done[-1] and not any(done[:-1])
    assert newline not in allowed(g, vocab) or g.matcher.is_stopped()


def test_a_tool_call_or_a_reasoning_block_may_open_where_the_answer_starts(llm):
    tok, vocab = llm.tokenizer, llm.runner.mcfg.vocab_size
    think, close, tool = tag(llm, "<think>"), tag(llm, "</think>"), tag(llm, "<tool_call>")
    spec = GuideSpec(guide.json_schema(SCHEMA), open_reasoning=think, close_reasoning=close, escape=(tool,))
    g = Guide(spec, tok, vocab)
    assert {think, tool} <= allowed(g, vocab)
    g.advance(tool)
    assert len(allowed(g, vocab)) == vocab                  # inside a tool call: free
    g = Guide(spec, tok, vocab)
    g.advance(ids_of(llm, "{")[0])
    assert not {think, tool} & allowed(g, vocab)            # once the answer began, only the grammar


def test_logit_bias_forces_or_bans_a_token(llm):
    prompt = ids_of(llm, "Hello there")
    plain = llm.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)).token_ids
    forced = llm.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True,
                                                 logit_bias=((77, 100.0),))).token_ids
    banned = llm.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True,
                                                 logit_bias=((plain[0], -100.0),))).token_ids
    assert forced == [77] * 6
    assert banned[0] != plain[0]
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate(prompt, SamplingParams(logit_bias=((10**6, 1.0),)))
    with pytest.raises(InvalidRequest, match="-100..100"):
        SamplingParams(logit_bias=((1, 300.0),))


def test_sample_and_the_mask_leave_the_logits_unchanged(llm):
    logits = torch.randn(64)
    before = logits.clone()
    sample(logits, SamplingParams(temperature=0, logit_bias=((3, 50.0),)), torch.Generator())
    assert torch.equal(logits, before)
    vocab = llm.runner.mcfg.vocab_size
    g = Guide(GuideSpec(guide.json_schema(SCHEMA)), llm.tokenizer, vocab)
    logits = torch.randn(vocab)
    before = logits.clone()
    masked = g.constrain(logits)
    assert torch.equal(logits, before) and int(torch.isfinite(masked).sum()) < vocab


def test_masks_of_a_batch_equal_each_computed_alone(llm):
    """The parallel batch path (the scheduler's) gives every row the mask it gets alone."""
    vocab = llm.runner.mcfg.vocab_size
    specs = [GuideSpec(guide.json_schema(SCHEMA)), GuideSpec(guide.regex("[a-z]+")),
             GuideSpec(guide.choice(["yes", "no"]), open_reasoning=tag(llm, "<think>"))]
    guides = [Guide(s, llm.tokenizer, vocab) for s in specs]
    guides[0].advance(ids_of(llm, '{"')[0])
    logits = torch.randn(len(guides), vocab)
    together = guide.apply_masks(logits, guide.fill_masks(guides))
    for i, g in enumerate(guides):
        assert torch.equal(together[i], g.constrain(logits[i]))
    assert torch.isfinite(together[2, tag(llm, "<think>")])


async def test_scheduler_serves_the_same_constrained_tokens_with_logprobs(llm, tiny_checkpoint):
    spec = GuideSpec(guide.json_schema(SCHEMA))
    params = SamplingParams(max_new_tokens=80, temperature=0, guide=spec, logprobs=3)
    prompts = [ids_of(llm, p) for p in ("Hello", "The capital", "def add")]
    alone = [llm.generate(p, params).token_ids for p in prompts]
    svc = EngineService.start(EngineConfig(model=tiny_checkpoint("qwen3_moe"), max_batch=4,
                                           expert_cache_experts=5, cpu_expert_fraction=0.5), wait=True)
    try:
        async def run(p):
            return [ev async for ev in svc.submit(p, params) if ev.token_id is not None]
        got = await asyncio.gather(*(run(p) for p in prompts))
    finally:
        svc.shutdown()
    assert [[ev.token_id for ev in events] for events in got] == alone
    for events in got:
        assert events[-1].finish_reason == "stop"
        for ev in events:
            lp, alts = ev.logprob
            assert len(alts) == 3 and lp <= 0 and all(a[1] <= 0 for a in alts)
            assert [a[1] for a in alts] == sorted((a[1] for a in alts), reverse=True)
            assert lp <= alts[0][1] + 1e-6
    # unconstrained greedy: the chosen token is the likeliest, with its probability
    free = [ev async for ev in _one(tiny_checkpoint, prompts[0])]
    for ev in free:
        lp, alts = ev.logprob
        assert alts[0][0] == ev.token_id and math.isclose(lp, alts[0][1], rel_tol=1e-6)


async def _one(tiny_checkpoint, prompt):
    svc = EngineService.start(EngineConfig(model=tiny_checkpoint("qwen3_moe")), wait=True)
    try:
        async for ev in svc.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0,
                                                          ignore_eos=True, logprobs=2)):
            if ev.token_id is not None:
                yield ev
    finally:
        svc.shutdown()


def test_tool_calls_follow_the_tool_grammar_and_text_between_them_is_free(llm):
    tok, vocab = llm.tokenizer, llm.runner.mcfg.vocab_size
    open_, close = tag(llm, "<tool_call>"), tag(llm, "</tool_call>")
    call = guide.lark('start: "\\n{\\"name\\": \\"f\\", \\"arguments\\": " %json {"type": "object"} '
                      f'"}}" <[{close}]>')
    g = Guide(GuideSpec(None, escape=(open_,), tool_grammar=call), tok, vocab)
    assert not g.active                                    # no answer grammar: free text
    for t in ids_of(llm, "Let me look."):
        assert g.advance(t) is False
    for _ in range(2):                                     # two calls, each constrained
        g.advance(open_)
        assert g.active and ids_of(llm, "the")[0] not in allowed(g, vocab)
        for t in ids_of(llm, '\n{"name": "f", "arguments": {"a": 1}}'):
            assert t in allowed(g, vocab)
            g.advance(t)
        assert allowed(g, vocab) == {close}
        assert g.advance(close) is False and not g.active  # a call does not end the request


def test_a_call_opened_inside_reasoning_is_constrained_too(llm):
    """Qwen3.5 opens tool calls inside its reasoning block, without </think>."""
    tok, vocab = llm.tokenizer, llm.runner.mcfg.vocab_size
    open_, close = tag(llm, "<tool_call>"), tag(llm, "</tool_call>")
    call = guide.lark(f'start: "\\n{{}}" <[{close}]>')
    g = Guide(GuideSpec(guide.json_schema(SCHEMA), reasoning=True, close_reasoning=tag(llm, "</think>"),
                        escape=(open_,), tool_grammar=call), tok, vocab)
    g.advance(ids_of(llm, "hmm")[0])
    assert not g.active
    g.advance(open_)
    assert g.active and ids_of(llm, "the")[0] not in allowed(g, vocab)
    for t in ids_of(llm, "\n{}") + [close]:
        g.advance(t)
    assert g.state == "text"          # the answer's grammar no longer applies: the model called a tool


def test_a_call_the_prompt_opened_starts_constrained(llm):
    tok, vocab = llm.tokenizer, llm.runner.mcfg.vocab_size
    rest = guide.lark('start: %json {"type": "object", "properties": {"a": {"enum": [1, 2]}}, '
                      '"required": ["a"], "additionalProperties": false} "}"')
    g = Guide(GuideSpec(None, in_tool=rest), tok, vocab)
    assert g.active
    out = llm.generate(ids_of(llm, "call"), SamplingParams(max_new_tokens=30, temperature=1.0, seed=2,
                                                           guide=GuideSpec(None, in_tool=rest)))
    text = llm.tokenizer.decode(out.token_ids)
    assert re.match(r'^\{\s*"a":\s*[12]\s*\}\}', text), text   # then free text


async def test_a_constrained_request_waits_for_the_tables_while_others_run(tiny_checkpoint, monkeypatch):
    """The grammar tables are built on first need, in a thread: the constrained request waits
    in the queue for them, the request behind it runs meanwhile, and the answers are unchanged."""
    built = guide._build

    def slow(*args):
        import time
        time.sleep(1.0)
        return built(*args)
    monkeypatch.setattr(guide, "_build", slow)
    monkeypatch.setattr(guide, "_builds", {})
    folder = tiny_checkpoint("qwen3_moe")
    spec = GuideSpec(guide.json_schema(SCHEMA))
    constrained = SamplingParams(max_new_tokens=80, temperature=0, guide=spec)
    plain = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(folder)
    want = [llm.generate([5, 6, 7], constrained).token_ids, llm.generate([8, 9], plain).token_ids]
    monkeypatch.setattr(guide, "_builds", {})
    svc = EngineService.start(EngineConfig(model=folder, max_batch=4), wait=True)
    loop = asyncio.get_running_loop()
    try:
        async def run(ids, params):
            tokens, first = [], None
            async for ev in svc.submit(ids, params):
                if ev.token_id is not None:
                    first = first or loop.time()
                    tokens.append(ev.token_id)
            return tokens, first, loop.time()
        (c_tokens, c_first, _), (p_tokens, _, p_done) = await asyncio.gather(
            run([5, 6, 7], constrained), run([8, 9], plain))
    finally:
        svc.shutdown()
    assert [c_tokens, p_tokens] == want
    assert p_done < c_first          # the plain request did not wait behind the tables' build
