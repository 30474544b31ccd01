"""Serving benchmark: concurrent clients, and an agent conversation with and without prefix reuse.

Runs ``freetoken serve``'s app (EngineService + uvicorn on loopback, the same code as the CLI)
on the default model (or ``--model DIR``) and drives it with the official ``openai`` client:

1. **Concurrency.** N = 1, 4, 16 clients at once; each sends ``--rounds`` streaming chat
   requests one after another (distinct prompts, greedy, ``--max-tokens`` each, EOS ignored so
   every request generates the same number of tokens). Reported: aggregate generated tokens/s
   over the wall time of the whole run, and TTFT (request sent -> first content chunk) p50/p95.
2. **Agent conversation.** A coding-agent-shaped context grows turn by turn: a system prompt
   with tool definitions, then per turn an assistant tool call and a tool result (a file
   listing, ~150 tokens) are appended and the model is asked for its next step. Two sides in
   the same run: *reuse*, the conversation as an agent sends it (its prefix is shared with the
   previous turn), and *no reuse*, the same conversation with a fresh nonce at the start of the
   system prompt and of the first tool's description every turn (whichever the chat template
   renders first), so no prefix can be shared and everything is recomputed.
   Reported per turn: prompt tokens, recomputed tokens (prompt - cached, from ``usage``) and TTFT.

    python bench/serve_concurrency.py [--model DIR] [--max-tokens 32] [--rounds 2] [--turns 8]
    python bench/serve_concurrency.py --ab fused_cpu_decode=true,false --ab-rounds 3 \
        --out bench/results/serve_fused_cpu_decode.json     # the concurrency part, an engine per side

Writes bench/results/serve_concurrency.json and .png (named by hardware, model and workload).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import openai
import uvicorn

from freetoken_engine.server.app import ServerConfig, create_app

RESULTS = Path(__file__).resolve().parent / "results"
TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
    for name, desc in [("read_file", "Read a file of the repository"),
                       ("list_dir", "List a directory of the repository"),
                       ("run_tests", "Run the test suite under a path")]]
LISTING = "\n".join(f"engine/freetoken_engine/module_{i}.py  {120 + 7 * i} lines" for i in range(12))


def hardware() -> dict:
    model = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return {"cpu_model": model, "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "device": "cpu", "python": platform.python_version(),
            "load_average_1m_at_start": os.getloadavg()[0]}


def pct(values, q):
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_stream(client, model, messages, max_tokens, *, ignore_eos, tools=None):
    """Stream one chat request; return (ttft_s, completion_tokens, prompt_tokens, cached)."""
    extra = {"ignore_eos": True} if ignore_eos else {}
    t0 = time.perf_counter()
    ttft, usage = None, None
    kw = {"tools": tools} if tools else {}
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, **kw)
    async for chunk in stream:
        if ttft is None and chunk.choices and (chunk.choices[0].delta.content
                                               or chunk.choices[0].delta.tool_calls
                                               or getattr(chunk.choices[0].delta,
                                                          "reasoning_content", None)):
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return (ttft if ttft is not None else time.perf_counter() - t0, usage.completion_tokens,
            usage.prompt_tokens, cached or 0)


async def concurrency(url, model, n, rounds, max_tokens) -> dict:
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0,
                                  timeout=3600) as client:
        return await _concurrency(client, model, n, rounds, max_tokens)


async def _concurrency(client, model, n, rounds, max_tokens) -> dict:

    async def worker(w):
        out = []
        for r in range(rounds):
            msgs = [{"role": "user", "content": f"Client {w}, question {r}: describe item "
                                                f"{w * 31 + r} of the inventory in detail."}]
            out.append(await one_stream(client, model, msgs, max_tokens, ignore_eos=True))
        return out
    t0 = time.perf_counter()
    results = [x for xs in await asyncio.gather(*(worker(w) for w in range(n))) for x in xs]
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"clients": n, "requests": len(results), "generated_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95)}


async def agent(url, model, turns, *, reuse: bool) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0,
                                  timeout=3600) as client:
        return await _agent(client, model, turns, reuse=reuse)


async def _agent(client, model, turns, *, reuse: bool) -> list[dict]:
    system = ("You are a coding agent working in the FreeToken repository. Use the tools to "
              "inspect files before you answer. Keep answers short.")
    history = [{"role": "user", "content": "Find where the expert cache is resized and explain it."}]
    rows = []
    for t in range(turns):
        head, tools = system, TOOLS
        if not reuse:    # a nonce in whatever the chat template renders first (tools or system)
            nonce = f"[session {uuid.uuid4().hex}] "
            head = nonce + system
            first = dict(TOOLS[0], function=dict(TOOLS[0]["function"]))
            first["function"]["description"] = nonce + first["function"]["description"]
            tools = [first] + TOOLS[1:]
        msgs = [{"role": "system", "content": head}] + history
        ttft, _, prompt, cached = await one_stream(client, model, msgs, 8, ignore_eos=True,
                                                   tools=tools)
        rows.append({"turn": t + 1, "prompt_tokens": prompt, "cached_tokens": cached,
                     "recomputed_tokens": prompt - cached, "ttft_s": ttft})
        call = {"id": f"call_{t}", "type": "function", "function": {
            "name": "list_dir", "arguments": json.dumps({"path": f"engine/part{t}"})}}
        history += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{t}", "content": LISTING}]
    return rows


class Server:
    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_engine(model_dir: Path, options: dict):
    """The engine ``freetoken serve`` runs, ready; None (and its health on stderr) if it failed."""
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.scheduler.service import EngineService
    svc = EngineService.start(EngineConfig(model=model_dir, **options))
    while svc.health()["status"] == "loading":
        time.sleep(0.1)
    if svc.health()["status"] != "ok":
        print(svc.health(), file=sys.stderr)
        svc.shutdown()
        return None
    return svc


def _value(text: str):
    """An A/B side's engine option value from the command line: a bool, a number, else the text."""
    low = text.strip().lower()
    if low in ("true", "on", "false", "off"):
        return low in ("true", "on")
    try:
        return float(text)
    except ValueError:
        return text


def ab_sides(args, model_dir: Path, option: str, values: list) -> int:
    """``--ab OPTION=V1,V2`` (``--ab-pauses`` is ``--ab decode_pause_ms=...``): the concurrency
    part for each value of the engine option, an engine per side, the sides in alternating order
    for ``--ab-rounds`` rounds; medians per value."""
    import statistics
    rows = []
    for rnd in range(args.ab_rounds):
        for value in values if rnd % 2 == 0 else values[::-1]:
            svc = start_engine(model_dir, {option: value})
            if svc is None:
                return 1
            try:
                with Server(create_app(svc, ServerConfig())) as port:
                    url = f"http://127.0.0.1:{port}/v1"
                    asyncio.run(concurrency(url, svc.model_name, 1, 1, 4))      # warm-up
                    for n in args.clients.split(","):
                        before = svc.stats()["decode_steps_beside"]
                        row = asyncio.run(concurrency(url, svc.model_name, int(n), args.rounds, args.max_tokens))
                        rows.append(row | {"side": f"{option}={value}", option: value, "round": rnd,
                                           "decode_steps_beside": svc.stats()["decode_steps_beside"] - before})
            finally:
                svc.shutdown()
    summary = []
    print(f"{'side':>24} {'clients':>8} {'tok/s median':>12} {'TTFT p50 median':>15} {'TTFT p95 median':>15}")
    for value in values:
        for n in args.clients.split(","):
            mine = [r for r in rows if r[option] == value and r["clients"] == int(n)]
            med = {k: statistics.median(r[k] for r in mine) for k in ("tokens_per_s", "ttft_p50_s", "ttft_p95_s")}
            summary.append({option: value, "side": f"{option}={value}", "clients": int(n), "rounds": len(mine), **med})
            print(f"{option + '=' + str(value):>24} {int(n):8d} {med['tokens_per_s']:12.1f} {med['ttft_p50_s']:14.3f}s "
                  f"{med['ttft_p95_s']:14.3f}s")
    result = {"benchmark": f"serve_concurrency_ab_{option}", "model": model_dir.name, "hardware": hardware(),
              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/serve_concurrency.py"] + sys.argv[1:]),
              "workload": {"max_tokens": args.max_tokens, "rounds": args.rounds, "method": ab_sides.__doc__},
              "rows": rows, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot_ab(result, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and .png")
    return 0


def plot_ab(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, r in enumerate(result["rows"]):
        side = r["side"] if "side" in r else f"decode_pause_ms={r['decode_pause_ms']:g}"    # (files before stop 63)
        label = f"{side}, {r['clients']} clients"
        a.scatter([label], [r["tokens_per_s"]], color="#4c72b0")
        b.scatter([label], [r["ttft_p50_s"]], color="#dd8452", label="p50" if i == 0 else None)
        b.scatter([label], [r["ttft_p95_s"]], color="#c44e52", marker="s", label="p95" if i == 0 else None)
    a.set_ylabel("aggregate generated tokens/s")
    b.set_ylabel("TTFT (s)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    hw = result["hardware"]
    fig.suptitle(f"each round an engine per side: {result['model']} on {hw['cpu_model']} "
                 f"({hw['cpus']} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["concurrency"]
    ns = [r["clients"] for r in rows]
    a.bar([str(n) for n in ns], [r["tokens_per_s"] for r in rows], color="#4c72b0")
    a.set_xlabel("concurrent clients")
    a.set_ylabel("aggregate generated tokens/s")
    a2 = a.twinx()
    a2.plot([str(n) for n in ns], [r["ttft_p50_s"] for r in rows], "o-", color="#dd8452",
            label="TTFT p50")
    a2.plot([str(n) for n in ns], [r["ttft_p95_s"] for r in rows], "s--", color="#c44e52",
            label="TTFT p95")
    a2.set_ylabel("TTFT (s)")
    a2.legend(loc="upper left")
    a.set_title("Concurrent streaming clients")
    handles = []
    for side, color, shift in (("reuse", "#55a868", 0.2), ("no_reuse", "#8172b2", -0.2)):
        turns = result["agent"][side]
        handles.append(b.bar([r["turn"] + shift for r in turns],
                             [r["recomputed_tokens"] for r in turns], width=0.4, alpha=0.45,
                             color=color, label=f"recomputed tokens, {side.replace('_', ' ')}"))
    b.set_xlabel("turn")
    b.set_ylabel("recomputed prompt tokens")
    b.set_xticks([r["turn"] for r in result["agent"]["reuse"]])
    b2 = b.twinx()
    for side, style in (("reuse", "o-"), ("no_reuse", "s--")):
        turns = result["agent"][side]
        handles += b2.plot([r["turn"] for r in turns], [r["ttft_s"] for r in turns], style,
                           label=f"TTFT, {side.replace('_', ' ')}")
    b2.set_ylabel("TTFT (s)")
    b2.set_ylim(bottom=0)
    b.legend(handles=handles, loc="upper left", fontsize=8)
    b.set_title("Agent conversation: prefix reuse")
    hw = result["hardware"]
    fig.suptitle(f"{result['model']} on {hw['cpu_model']} ({hw['cpus']} CPUs), "
                 f"{result['workload']['max_tokens']} tokens/request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: embedded)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--decode-pause-ms", type=float, default=None,
                    help="the engine's --decode-pause-ms (default: the engine's default)")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_concurrency.json")
    ap.add_argument("--ab-pauses", help="only the concurrency part, an engine per --decode-pause-ms "
                    "value in this list (e.g. 0,100), the sides alternating --ab-rounds times")
    ap.add_argument("--ab", help="only the concurrency part, an engine per value of an engine option: "
                    "OPTION=V1,V2 (e.g. fused_cpu_decode=true,false), the sides alternating --ab-rounds times")
    ap.add_argument("--ab-rounds", type=int, default=3)
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from freetoken_engine.models.default import default_model_dir
        model_dir = default_model_dir(progress=True)
    if args.ab_pauses or args.ab:
        option, values = ("decode_pause_ms", args.ab_pauses) if args.ab_pauses else args.ab.split("=", 1)
        return ab_sides(args, Path(model_dir), option, [_value(v) for v in values.split(",")])
    options = {} if args.decode_pause_ms is None else {"decode_pause_ms": args.decode_pause_ms}
    svc = start_engine(Path(model_dir), options)
    if svc is None:
        return 1
    app = create_app(svc, ServerConfig())
    result = {"benchmark": "serve_concurrency", "model": svc.model_name,
              "hardware": hardware(),
              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "workload": {"max_tokens": args.max_tokens, "rounds": args.rounds,
                           "turns": args.turns, "method": __doc__},
              "decode_pause_ms": svc.cfg.decode_pause}
    try:
        with Server(app) as port:
            url = f"http://127.0.0.1:{port}/v1"
            asyncio.run(concurrency(url, svc.model_name, 1, 1, 4))      # warm-up
            result["concurrency"] = [
                asyncio.run(concurrency(url, svc.model_name, int(n), args.rounds, args.max_tokens))
                for n in args.clients.split(",")]
            # no-reuse first, so the reuse side cannot profit from its cached turns
            no_reuse = asyncio.run(agent(url, svc.model_name, args.turns, reuse=False))
            reuse = asyncio.run(agent(url, svc.model_name, args.turns, reuse=True))
            result["agent"] = {"reuse": reuse, "no_reuse": no_reuse}
            result["engine_stats"] = svc.stats()
            result["hardware"]["load_average_1m_at_end"] = os.getloadavg()[0]
    finally:
        svc.shutdown()

    hw = result["hardware"]
    print(f"\n{result['model']} on {hw['cpu_model']} ({hw['cpus']} CPUs; load average "
          f"{hw['load_average_1m_at_start']:.1f} -> {hw['load_average_1m_at_end']:.1f})")
    print(f"{'clients':>8} {'requests':>9} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
    for r in result["concurrency"]:
        print(f"{r['clients']:>8} {r['requests']:>9} {r['tokens_per_s']:>8.1f} "
              f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p95_s']:>8.3f}s")
    print(f"\n{'turn':>4} | {'prompt':>6} {'recomputed':>10} {'TTFT':>7} (reuse) | "
          f"{'prompt':>6} {'recomputed':>10} {'TTFT':>7} (no reuse)")
    for a, b in zip(reuse, no_reuse):
        print(f"{a['turn']:>4} | {a['prompt_tokens']:>6} {a['recomputed_tokens']:>10} "
              f"{a['ttft_s']:>6.3f}s         | {b['prompt_tokens']:>6} {b['recomputed_tokens']:>10} "
              f"{b['ttft_s']:>6.3f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
