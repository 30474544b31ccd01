"""What constrained decoding costs: decode speed with no grammar, a JSON Schema, any JSON object
and a regex, on the embedded default model (SmolLM2-135M as an MoE, 49k vocabulary), in the same
process, rounds interleaved; and the grammar engine's own times: building its tokenizer (once
per model), a grammar's first mask (its compile happens lazily there) and one mask per token,
timed by replaying each constrained answer's tokens. Then ``--concurrent`` requests at once
through the scheduler, with and without the schema: aggregate tok/s and the time its batched
masks take per step. Last, fresh EngineService starts: time to ready, and the time to first
token of a request without a grammar, of the first constrained one (it waits for the grammar
tables, built on first need) and of a second.

Sample us is the host's time per sampled token (the grammar's mask, bias and argmax), measured
around ``Guide.constrain`` and ``sample`` inside ``LLM.generate``. Decode tok/s is ``Generation.stats["decode_tokens_per_s"]``
(greedy, one request); the side
without a grammar generates ``--tokens`` tokens (EOS ignored), a grammar side up to that many
(it stops when its answer is complete).

    python bench/structured_output.py [--tokens 96] [--rounds 3] [--out bench/results/structured_output.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from report import save  # noqa: E402

from freetoken_engine import LLM, SamplingParams  # noqa: E402
from freetoken_engine.executor import guide  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = [{"role": "user", "content": "Describe Paris as JSON with a name, a country, a population "
                                        "and three landmarks."}]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "country", "population", "landmarks"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "country": {"type": "string", "maxLength": 40},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                         "landmarks": {"type": "array", "minItems": 3, "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 60}}}}
SIDES = {"no grammar": None,
         "json_schema": lambda: guide.json_schema(SCHEMA),
         "json_object": lambda: guide.json_schema({"type": "object"}),
         "regex": lambda: guide.regex(r"Paris is in [A-Z][a-z]+ and has [0-9]{1,9} people\.( [A-Za-z ,]{1,200}\.)?")}


def mask_times(llm, grammar: str, tokens: list[int]) -> tuple[float, list[float]]:
    """(first mask's ms, each later mask's us) replaying ``tokens`` through a fresh Guide."""
    import torch
    vocab = llm.runner.mcfg.vocab_size
    g = guide.Guide(guide.GuideSpec(grammar), llm.tokenizer, vocab)
    x = torch.zeros(vocab)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        g.constrain(x)
        times.append(time.perf_counter() - t0)
        g.advance(t)
    return times[0] * 1e3, [s * 1e6 for s in times[1:]]


class Timed:
    """Wraps ``LLM.generate``'s sampler and the guide's mask: what each sampled token costs the
    host (mask, bias and sampling)."""

    def __init__(self):
        import freetoken_engine.llm as llm_module
        self.module, self.inner, self.times, self.pending = llm_module, llm_module.sample, [], 0.0
        self.constrain = guide.Guide.constrain
        llm_module.sample = self
        timed = self

        def constrain(g, logits):
            t = time.perf_counter()
            out = timed.constrain(g, logits)
            timed.pending += time.perf_counter() - t
            return out
        guide.Guide.constrain = constrain

    def __call__(self, *args):
        t = time.perf_counter()
        tok = self.inner(*args)
        self.times.append(time.perf_counter() - t + self.pending)
        self.pending = 0.0
        return tok

    def take(self) -> list[float]:
        out, self.times = self.times, []
        return out


def run(tokens: int, rounds: int, model: Path | None = None, device: str = "cpu") -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, device=device)
    prompt = llm.tokenizer.encode_chat(QUESTION)
    t1 = time.perf_counter()
    guide._builds.clear()
    guide.ll_tokenizer(llm.tokenizer, llm.runner.mcfg.vocab_size)
    tokenizer_s = time.perf_counter() - t1
    grammars = {side: make() if make else None for side, make in SIDES.items()}
    out = {side: {"decode_tok_s": [], "generated": [], "finish": None, "text": "", "sample_us": []}
           for side in SIDES}
    timed = Timed()
    for _ in range(rounds):
        for side, grammar in grammars.items():
            spec = guide.GuideSpec(grammar) if grammar else None
            gen = llm.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0, guide=spec,
                                                      ignore_eos=spec is None))
            r = out[side]
            r["decode_tok_s"].append(gen.stats["decode_tokens_per_s"])
            r["sample_us"] += [t * 1e6 for t in timed.take()]
            r["generated"].append(len(gen.token_ids))
            r["finish"], r["text"], r["tokens"] = gen.finish_reason, llm.tokenizer.decode(gen.token_ids), gen.token_ids
    base = statistics.median(out["no grammar"]["decode_tok_s"])
    for side, grammar in grammars.items():
        r = out[side]
        r["decode_tok_s_median"] = statistics.median(r["decode_tok_s"])
        r["ratio_to_no_grammar"] = r["decode_tok_s_median"] / base
        r["sample_us_median"] = statistics.median(r.pop("sample_us"))
        if grammar:
            first_ms, per = mask_times(llm, grammar, r["tokens"])
            r["first_mask_ms"], r["mask_us_median"], r["mask_us_p90"] = (
                first_ms, statistics.median(per), sorted(per)[int(0.9 * (len(per) - 1))])
        del r["tokens"]
    name = str(model) if model else "embedded default (SmolLM2-135M-Instruct as an MoE)"
    return {"model": name, "device": device, "vocab": llm.runner.mcfg.vocab_size,
            "load_s": t1 - t0, "grammar_tokenizer_build_s": tokenizer_s, "sides": out}


def run_batch(concurrent: int, tokens: int, rounds: int, model: Path | None = None, device: str = "cpu") -> dict:
    """``concurrent`` requests at once through the scheduler (EngineService), with and without
    the JSON Schema: aggregate tok/s, and the time the scheduler spends masking per step."""
    import asyncio

    from freetoken_engine.config import EngineConfig
    from freetoken_engine.models.default import default_model_dir
    from freetoken_engine.scheduler import scheduler as sched
    from freetoken_engine.scheduler.service import EngineService

    mask_s = []
    inner = sched.constrained_rows

    def timed(logits, guides):
        t = time.perf_counter()
        out = inner(logits, guides)
        if out:
            mask_s.append(time.perf_counter() - t)
        return out
    sched.constrained_rows = timed
    svc = EngineService.start(EngineConfig(model=model or default_model_dir(progress=False), device=device,
                                           max_batch=concurrent), wait=True)
    prompt = svc.tokenizer.encode_chat(QUESTION)
    spec = guide.GuideSpec(guide.json_schema(SCHEMA))

    async def one(grammar: bool) -> int:
        params = SamplingParams(max_new_tokens=tokens, temperature=0, guide=spec if grammar else None,
                                ignore_eos=not grammar)
        n = 0
        async for ev in svc.submit(prompt, params):
            n += ev.token_id is not None
        return n

    out = {"no grammar": [], "json_schema": []}
    try:
        for _ in range(rounds):
            for side in out:
                t = time.perf_counter()
                n = sum(asyncio.run(_gather(one, side == "json_schema", concurrent)))
                out[side].append(n / (time.perf_counter() - t))
    finally:
        svc.shutdown()
        sched.constrained_rows = inner
    res = {side: statistics.median(v) for side, v in out.items()}
    return {"concurrent": concurrent, "tok_s": res, "ratio": res["json_schema"] / res["no grammar"],
            "mask_ms_per_step_median": statistics.median(mask_s) * 1e3 if mask_s else None}


def run_first(rounds: int, model: Path | None = None, device: str = "cpu") -> dict:
    """Time to first token through a fresh EngineService: a request without a grammar, the first
    constrained request (it waits for the grammar tables, built on first need), and a second
    one; and the time to ready (no tables built at load). Medians over ``rounds`` starts."""
    import asyncio

    from freetoken_engine.config import EngineConfig
    from freetoken_engine.models.default import default_model_dir
    from freetoken_engine.scheduler.service import EngineService

    spec = guide.GuideSpec(guide.json_schema(SCHEMA))
    out: dict[str, list[float]] = {"ready": [], "no grammar": [], "first constrained": [], "second constrained": []}

    async def ttft(svc, prompt, grammar: bool) -> float:
        t = time.perf_counter()
        async for ev in svc.submit(prompt, SamplingParams(max_new_tokens=2, temperature=0,
                                                          guide=spec if grammar else None)):
            if ev.token_id is not None:
                return time.perf_counter() - t
        return float("nan")

    for _ in range(rounds):
        guide._builds.clear()                 # a fresh process: no tables yet
        t = time.perf_counter()
        svc = EngineService.start(EngineConfig(model=model or default_model_dir(progress=False), device=device),
                                  wait=True)
        out["ready"].append(time.perf_counter() - t)
        try:
            prompt = svc.tokenizer.encode_chat(QUESTION)
            for side, grammar in (("no grammar", False), ("first constrained", True), ("second constrained", True)):
                out[side].append(asyncio.run(ttft(svc, prompt, grammar)))
        finally:
            svc.shutdown()
    return {side: statistics.median(v) for side, v in out.items()}


async def _gather(one, grammar: bool, n: int) -> list[int]:
    import asyncio
    return await asyncio.gather(*(one(grammar) for _ in range(n)))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = list(result["sides"])
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.2))
    a.bar(sides, [result["sides"][s]["decode_tok_s_median"] for s in sides])
    a.set_ylabel("decode tok/s (median)")
    guided = [s for s in sides if "mask_us_median" in result["sides"][s]]
    b.bar(guided, [result["sides"][s]["mask_us_median"] for s in guided])
    b.set_ylabel("mask per token, us (median)")
    batches = result.get("batch", [])
    c.bar([str(x["concurrent"]) for x in batches], [x["ratio"] for x in batches])
    c.set_xlabel("requests at once")
    c.set_ylabel("tok/s with the schema / without")
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Constrained decoding cost: {result['model'][-60:]} on {result['device']}, "
                 f"{str(result['hardware'].get('gpu') or result['hardware'].get('cpu', ''))[:50]}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, nargs="+", default=[8], help="requests at once in the batch part")
    ap.add_argument("--model", type=Path, help="model folder (default: the embedded default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_output.json")
    args = ap.parse_args()
    result = run(args.tokens, args.rounds, args.model, args.device)
    result["batch"] = [run_batch(n, args.tokens, args.rounds, args.model, args.device) for n in args.concurrent]
    result["first_s"] = run_first(args.rounds, args.model, args.device)
    print(f"grammar tokenizer build: {result['grammar_tokenizer_build_s']:.2f} s (once per model)")
    print(f"{'side':12s} {'tok/s':>8s} {'ratio':>6s} {'tokens':>6s} {'finish':>7s} {'sample us':>9s} "
          f"{'1st mask ms':>11s} {'mask us p50':>11s} {'p90':>7s}")
    for side, r in result["sides"].items():
        print(f"{side:12s} {r['decode_tok_s_median']:8.1f} {r['ratio_to_no_grammar']:6.2f} "
              f"{statistics.median(r['generated']):6.0f} {r['finish']:>7s} {r['sample_us_median']:9.1f} "
              f"{r.get('first_mask_ms', 0):11.2f} "
              f"{r.get('mask_us_median', 0):11.1f} {r.get('mask_us_p90', 0):7.1f}")
        print(f"    {r['text'][:110]!r}")
    print("fresh start, seconds: " + ", ".join(f"{side} {t:.2f}" for side, t in result["first_s"].items()))
    for b in result["batch"]:
        print(f"{b['concurrent']:3d} requests at once: {b['tok_s']['no grammar']:8.1f} tok/s without a grammar, "
              f"{b['tok_s']['json_schema']:8.1f} with the schema ({b['ratio']:.2f}x); masks "
              f"{b['mask_ms_per_step_median']:.2f} ms a step")
    save({"benchmark": "structured_output", "hardware": describe(), "tokens": args.tokens, **result},
         args.out, plot)


if __name__ == "__main__":
    main()
