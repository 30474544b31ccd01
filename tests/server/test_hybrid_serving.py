"""A hybrid model (Gated DeltaNet + attention) behind the live server: a coding agent's turns
resume from the recurrent-state checkpoint of the last anchor, through the official clients."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live import live_pair

SYSTEM = "You are a terse coding assistant. Answer with code. " * 4


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    """The same hybrid checkpoint twice: with anchor checkpoints (the default) and without."""
    with live_pair(tiny_checkpoint("qwen3_next"), dict(max_context=512), dict(max_context=512, state_checkpoints=0)) as pair:
        yield pair


def ask(live, messages, **kw):
    return live.openai().chat.completions.create(model=live.model, messages=messages, max_tokens=8,
                                                 temperature=0, **kw)


def test_an_agents_turns_resume_from_anchors_and_answer_the_same(servers):
    anchors, plain = servers
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write add(a, b)."}]
    first = ask(anchors, turns)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "Now mul(a, b)."}]
    second, second_plain = ask(anchors, turns), ask(plain, turns)
    assert second.choices[0].message.content == second_plain.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    # resumed from turn 1's prompt end, or from its last turn end when the reply's first token
    # merges with the newline before it (a byte-level BPE does): most of turn 1 is not prefilled again
    assert 0.9 * first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert second_plain.usage.prompt_tokens_details.cached_tokens == 0          # no state: prefilled again
    # the agent rewrites its last message: it resumes from the turn end before it
    edited = turns[:-1] + [{"role": "user", "content": "Now sub(a, b), please."}]
    third, third_plain = ask(anchors, edited), ask(plain, edited)
    assert third.choices[0].message.content == third_plain.choices[0].message.content
    assert third.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    msgs = [m for m in turns if m["role"] != "system"]
    reply = anchors.anthropic().messages.create(model=anchors.model, max_tokens=4, messages=msgs, system=SYSTEM)
    assert reply.usage.cache_read_input_tokens > first.usage.prompt_tokens


def test_anchor_metrics_are_exported(servers):
    anchors, _ = servers
    ask(anchors, [{"role": "user", "content": "hello"}])
    ask(anchors, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                  {"role": "user", "content": "again"}])
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{anchors.url}/metrics").text)}
    value = {name: fams[name].samples[0].value for name in (
        "freetoken_anchor_checkpoints", "freetoken_anchor_resumes", "freetoken_anchor_resumed_tokens",
        "freetoken_anchor_checkpoints_held")}
    assert value["freetoken_anchor_checkpoints"] >= 2 and value["freetoken_anchor_resumes"] >= 1
    assert value["freetoken_anchor_resumed_tokens"] > 0 and value["freetoken_anchor_checkpoints_held"] >= 1
