"""What constrained decoding costs: decode speed with no grammar, a JSON Schema, any JSON object
and a regex, on the embedded default model (SmolLM2-135M as an MoE, 49k vocabulary), in the same
process, rounds interleaved; and the grammar engine's own times: building its tokenizer (once
per model), a grammar's first mask (its compile happens lazily there) and one mask per token,
timed by replaying each constrained answer's tokens.

Sample us is the sampler's time per token (mask, bias and argmax included), measured around
``sample`` inside ``LLM.generate``. Decode tok/s is ``Generation.stats["decode_tokens_per_s"]``
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
        g.mask(x)
        times.append(time.perf_counter() - t0)
        g.advance(t)
    return times[0] * 1e3, [s * 1e6 for s in times[1:]]


class Timed:
    """Wraps ``LLM.generate``'s sampler: the time each sampled token costs (mask included)."""

    def __init__(self):
        import freetoken_engine.llm as llm_module
        self.module, self.inner, self.times = llm_module, llm_module.sample, []
        llm_module.sample = self

    def __call__(self, *args):
        t = time.perf_counter()
        tok = self.inner(*args)
        self.times.append(time.perf_counter() - t)
        return tok

    def take(self) -> list[float]:
        out, self.times = self.times, []
        return out


def run(tokens: int, rounds: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM()
    prompt = llm.tokenizer.encode_chat(QUESTION)
    t1 = time.perf_counter()
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
    return {"model": "embedded default (SmolLM2-135M-Instruct as an MoE)", "vocab": llm.runner.mcfg.vocab_size,
            "load_s": t1 - t0, "grammar_tokenizer_build_s": tokenizer_s, "sides": out}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = list(result["sides"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    a.bar(sides, [result["sides"][s]["decode_tok_s_median"] for s in sides])
    a.set_ylabel("decode tok/s (median)")
    guided = [s for s in sides if "mask_us_median" in result["sides"][s]]
    b.bar(guided, [result["sides"][s]["mask_us_median"] for s in guided])
    b.set_ylabel("mask per token, us (median)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Constrained decoding cost: {result['model']}, {str(result['hardware'].get('cpu', ''))[:50]}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_output.json")
    args = ap.parse_args()
    result = run(args.tokens, args.rounds)
    print(f"grammar tokenizer build: {result['grammar_tokenizer_build_s']:.2f} s (once per model)")
    print(f"{'side':12s} {'tok/s':>8s} {'ratio':>6s} {'tokens':>6s} {'finish':>7s} {'sample us':>9s} "
          f"{'1st mask ms':>11s} {'mask us p50':>11s} {'p90':>7s}")
    for side, r in result["sides"].items():
        print(f"{side:12s} {r['decode_tok_s_median']:8.1f} {r['ratio_to_no_grammar']:6.2f} "
              f"{statistics.median(r['generated']):6.0f} {r['finish']:>7s} {r['sample_us_median']:9.1f} "
              f"{r.get('first_mask_ms', 0):11.2f} "
              f"{r.get('mask_us_median', 0):11.1f} {r.get('mask_us_p90', 0):7.1f}")
        print(f"    {r['text'][:110]!r}")
    save({"benchmark": "structured_output", "hardware": describe(), "tokens": args.tokens, **result},
         args.out, plot)


if __name__ == "__main__":
    main()
