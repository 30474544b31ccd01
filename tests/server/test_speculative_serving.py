"""Speculative decoding behind the live server: the official clients get the same text, streamed
or not, from a server that drafts and one that does not; the drafts show in /metrics."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live import live_pair

PROMPT = [5, 17, 99, 200, 3, 44, 12]      # the tiny qwen3_moe model's greedy output loops after it


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    with live_pair(tiny_checkpoint("qwen3_moe"), dict(speculative_tokens=4), {}) as pair:
        yield pair


def complete(live, stream=False, **kw):
    client = live.openai()
    args = dict(model=live.model, prompt=PROMPT, max_tokens=120, temperature=0, extra_body={"ignore_eos": True}, **kw)
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason), \
        chunks[-1].usage.completion_tokens


def counters(live) -> dict[str, float]:
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)}
    return {n: fams[n].samples[0].value for n in ("freetoken_speculative_draft_tokens",
                                                  "freetoken_speculative_kept_tokens")}


def test_drafting_server_answers_as_the_plain_one(servers):
    spec, plain = servers
    before = counters(spec)
    for stream in (False, True):
        assert complete(spec, stream) == complete(plain, stream)
    sampled = dict(temperature=0.8, top_p=0.9, seed=5, presence_penalty=0.4, logprobs=2, extra_body={"ignore_eos": True})
    a = spec.openai().completions.create(model=spec.model, prompt=PROMPT, max_tokens=60, **sampled)
    b = plain.openai().completions.create(model=plain.model, prompt=PROMPT, max_tokens=60, **sampled)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    after = counters(spec)
    kept = after["freetoken_speculative_kept_tokens"] - before["freetoken_speculative_kept_tokens"]
    drafted = after["freetoken_speculative_draft_tokens"] - before["freetoken_speculative_draft_tokens"]
    assert 10 <= kept <= drafted
    assert counters(plain)["freetoken_speculative_draft_tokens"] == 0


def test_a_server_drafting_with_the_models_mtp_layer_answers_as_the_plain_one(tmp_path):
    """``--speculative-method mtp`` behind the server: the official client's chat answers, streamed
    or not, are the plain server's, and the MTP head's drafts show in /metrics."""
    from tiny_models import add_mtp_layer, make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_next")
    add_mtp_layer(path)
    with live_pair(path, dict(speculative_tokens=3, speculative_method="mtp"), {}) as (spec, plain):
        for stream in (False, True):
            assert complete(spec, stream) == complete(plain, stream)
        msgs = [{"role": "user", "content": "Paris is the capital of"}]
        a, b = (s.openai().chat.completions.create(model=s.model, messages=msgs, max_tokens=40, temperature=0)
                for s in (spec, plain))
        assert a.choices[0].message.content == b.choices[0].message.content
        assert counters(spec)["freetoken_speculative_draft_tokens"] > 0
