"""Serving behaviour a client can observe: concurrency, a live cache resize, prefix reuse,
queue limits, metrics."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from live import API_KEY, live_server, start_service

N_STREAMS = 32


def prompts(n):
    return [[{"role": "user", "content": f"Request {i}: tell me about the fox number {i * 7}."}]
            for i in range(n)]


async def stream_text(client, model, messages, max_tokens, on_chunk=None) -> str:
    out = []
    stream = await client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
            if on_chunk is not None:
                await on_chunk(len(out))
    return "".join(out)


async def test_32_concurrent_greedy_streams_equal_each_run_alone(live):
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    msgs = prompts(N_STREAMS)
    alone = [await stream_text(client, live.model, m, 8) for m in msgs]
    together = await asyncio.gather(*(stream_text(client, live.model, m, 8) for m in msgs))
    assert together == alone
    assert len(set(alone)) > 1, "different prompts should give different answers"


async def test_cache_resize_in_the_middle_of_a_stream_changes_nothing_the_client_sees(live):
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    msgs = prompts(1)[0]
    expected = await stream_text(client, live.model, msgs, 48)
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as admin:
        before = (await admin.get("/admin/cache")).json()["expert_cache"]
        target = max(before["min_experts"], before["capacity_experts"] // 2)
        resized = {}

        async def resize_once(n_chunks):
            if n_chunks == 3 and not resized:
                r = await admin.post("/admin/cache", json={"expert_cache_experts": target})
                resized.update(r.json()["expert_cache"], status=r.status_code)
        seen = await stream_text(client, live.model, msgs, 48, on_chunk=resize_once)
        after = (await admin.get("/admin/cache")).json()["expert_cache"]
        await admin.post("/admin/cache", json={"expert_cache_experts": before["capacity_experts"]})
    assert resized["status"] == 200 and resized["capacity_experts"] == target
    assert after["capacity_experts"] == target
    assert seen == expected


def test_multi_turn_conversation_reports_cached_prefix_tokens(live):
    client = live.openai()
    turn = [{"role": "system", "content": "You are a terse assistant. " * 6},
            {"role": "user", "content": "List three animals."}]
    first = client.chat.completions.create(model=live.model, messages=turn, max_tokens=8,
                                           temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And three colours?"}]
    second = client.chat.completions.create(model=live.model, messages=turn, max_tokens=8,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 2, (cached, first.usage.prompt_tokens)
    assert cached < second.usage.prompt_tokens
    msgs = [{"role": m["role"], "content": m["content"]} for m in turn if m["role"] != "system"]
    a1 = live.anthropic().messages.create(model=live.model, max_tokens=4, messages=msgs,
                                          system=turn[0]["content"])
    assert a1.usage.cache_read_input_tokens >= first.usage.prompt_tokens // 2


def test_metrics_count_requests_tokens_and_read_the_engine(live):
    live.openai().chat.completions.create(model=live.model, messages=prompts(1)[0], max_tokens=3)
    live.openai().responses.create(model=live.model, input=prompts(1)[0], max_output_tokens=3)
    text = httpx.get(f"{live.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("freetoken_") for name in fams)
    for endpoint in ("chat", "responses"):
        ok = [s.value for s in fams["freetoken_http_requests"].samples
              if s.labels == {"endpoint": endpoint, "status": "200"} and s.name.endswith("_total")]
        assert ok and ok[0] >= 1, endpoint
        ttft = [s.value for s in fams["freetoken_time_to_first_token_seconds"].samples
                if s.name.endswith("_count") and s.labels.get("endpoint") == endpoint]
        assert ttft and ttft[0] >= 1, endpoint
    for name in ("freetoken_generation_tokens", "freetoken_expert_cache_capacity_experts",
                 "freetoken_expert_cache_hits", "freetoken_expert_cache_misses",
                 "freetoken_requests_running", "freetoken_requests_queued",
                 "freetoken_kv_blocks_total", "freetoken_expert_fill_fraction",
                 "freetoken_engine_ready", "freetoken_preemptions", "freetoken_decode_graphs",
                 "freetoken_decode_steps_beside_prefill", "freetoken_decode_beside_prefill_seconds",
                 "freetoken_decode_graph_replays", "freetoken_cpu_workers_left_out", "freetoken_cpu_stalled_calls"):
        assert name in fams, name
    assert fams["freetoken_decode_graphs"].samples[0].value == 0        # on a CPU decode is eager


def test_metrics_show_a_cpu_worker_another_process_held_up(live):
    """A kernel worker that holds a call up (made to, with the pool's test knob) is counted and
    shown sitting out in /metrics, and the server still answers with it out."""
    from freetoken_engine.kernels import cpu_experts as ce
    if not ce.available():
        pytest.skip("compiled kernel unavailable")

    def pool_metrics() -> dict:
        fams = text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)
        return {f.name: f.samples[0].value for f in fams if f.name.startswith("freetoken_cpu_")}

    cfg, knobs = ce.configure(), ce.tune()
    try:
        ce.configure(threads=2, spin_us=200_000)
        assert pool_metrics() == {"freetoken_cpu_workers_left_out": 0, "freetoken_cpu_stalled_calls": 0}
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, 2048, generator=g)
        w13, w2 = torch.randn(8, 2048, 2048, generator=g) / 45, torch.randn(8, 2048, 1024, generator=g) / 32
        ce.tune(test_stall_us=30_000, stall_us=2_000, backoff_ms=60_000, backoff_max_ms=60_000)
        end = time.monotonic() + 10
        while time.monotonic() < end:          # until worker 1 enters a call (a busy machine delays it)
            ce.experts_forward(x, w13, w2, torch.zeros(8, dtype=torch.long), torch.arange(8))
            if ce.pool_stats()["stalled_calls"]:
                break
        assert pool_metrics() == {"freetoken_cpu_workers_left_out": 1, "freetoken_cpu_stalled_calls": 1}
        r = live.openai().chat.completions.create(model=live.model, messages=prompts(1)[0], max_tokens=3)
        assert r.choices[0].message.content is not None
    finally:
        ce.tune(**knobs)
        ce.configure(threads=cfg.threads, isa=cfg.isa, prefetch_bytes=cfg.prefetch_bytes, spin_us=cfg.spin_us)


def test_past_the_queue_limit_requests_get_429_with_retry_after(tiny_dir):
    svc = start_service(tiny_dir, max_context=512, max_batch=1, max_queue=1)
    try:
        with live_server(svc) as srv:
            async def burst():
                client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
                calls = [client.chat.completions.create(
                    model=srv.model, messages=m, max_tokens=64, temperature=0, stream=True)
                    for m in prompts(4)]
                out = await asyncio.gather(*calls, return_exceptions=True)
                for r in out:
                    if not isinstance(r, Exception):
                        await r.close()
                return out
            results = asyncio.run(burst())
    finally:
        svc.shutdown()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused, results
    assert int(refused[0].response.headers["retry-after"]) >= 1
    assert refused[0].body["type"] == "rate_limit_error"


def test_a_client_that_disconnects_frees_its_request(live):
    body = {"model": live.model, "messages": prompts(1)[0], "max_tokens": 10**6,  # all the room
            "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def idle_within(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s = live.service.stats()
            if s["running"] == 0 and s["queued"] == 0:
                return True
            time.sleep(0.05)
        return False
    svc = live.service
    budget = svc.max_context - len(svc.tokenizer.encode_chat(body["messages"]))   # max_tokens is clamped to this

    def generated() -> int:
        return svc.stats()["generated_tokens"]

    before = generated()
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=dict(body, stream=True),
                      headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(6)]
        assert svc.stats()["running"] == 1
    assert idle_within(3), svc.stats()
    assert generated() - before < budget          # stopped early: not run to the end of the context
    before = generated()
    # a plain request the client gives up on
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers, timeout=0.1)
    assert idle_within(3), svc.stats()
    assert generated() - before < budget
