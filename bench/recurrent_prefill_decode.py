"""A hybrid's recurrent layers on this machine's CPU: the engine against transformers on the same
checkpoint (its reference PyTorch paths, which it takes without the ``mamba_ssm`` /
``causal_conv1d`` / ``fla`` kernels: a CPU has none). ``--family``:

- ``granitemoehybrid``: Granite 4.0-H's Mamba-2 (``layers/mamba2.py``: prompts in the chunked SSD
  form, decode steps in the recurrence), Granite-4.0-H-Tiny's shape (hidden 1536, 48 heads of 64,
  state 128, one group, convolution width 4), ``--layers`` Mamba-2 layers and one attention layer,
  16 experts of 256 beside a shared MLP; results in ``mamba2_prefill_decode.json``.
- ``kimi_linear``: Kimi-Linear's Kimi Delta Attention (``layers/kda.py``: a decay per key
  channel), Kimi-Linear-48B-A3B's shape (hidden 2304, 32 heads of 128, convolution width 4),
  ``--layers`` KDA layers and one latent attention layer (its shape: a 512 latent, 32 heads of
  128 + 64, values of 128), 16 experts of 1024 beside a shared expert; results in
  ``kda_prefill_decode.json``.

The checkpoint is random (float32). A prompt of ``--context`` tokens is prefilled (the engine in
its CPU chunks of 512), then a decode step, once untimed then ``--steps`` times a round, the
sides alternating for ``--rounds`` rounds in one process. Reported: median prefill seconds and
decode step, and whether the next tokens agree.

    python bench/recurrent_prefill_decode.py --family kimi_linear [--context 2048] [--layers 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from hardware import describe  # noqa: E402
from report import bars, parse, save  # noqa: E402

SIDES = ("engine", "transformers")
SHAPES = {
    "granitemoehybrid": dict(hidden_size=1536, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                             mamba_d_conv=4, mamba_expand=2, num_attention_heads=12, num_key_value_heads=4),
    "kimi_linear": dict(hidden_size=2304, linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
                        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
NAMES = {"granitemoehybrid": ("Granite-4.0-H-Tiny Mamba-2", "mamba2_prefill_decode.json"),
         "kimi_linear": ("Kimi-Linear-48B KDA", "kda_prefill_decode.json")}


def model(folder: Path, family: str, layers: int) -> Path:
    from tiny_models import make_tiny_checkpoint
    if family == "granitemoehybrid":
        extra = dict(layer_types=["mamba"] * layers + ["attention"], num_local_experts=16, intermediate_size=256,
                     shared_intermediate_size=1024)
    else:
        extra = dict(layer_types=["linear_attention"] * layers + ["full_attention"], num_experts=16,
                     moe_intermediate_size=1024, mlp_layer_types=["sparse"] * (layers + 1), num_expert_group=1)
    return make_tiny_checkpoint(folder, family, num_hidden_layers=layers + 1, max_position_embeddings=16384,
                                init_std=0.02, **extra, **SHAPES[family])


def run(args) -> dict:
    import torch
    import transformers

    from freetoken_engine import LLM
    from freetoken_engine.executor.inputs import SeqChunk
    ids = [(31 * t + 7) % 300 + 3 for t in range(args.context + 1)]
    prefill, step, logits = {s: [] for s in SIDES}, {s: [] for s in SIDES}, {}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        folder = model(Path(tmp), args.family, args.layers)
        llm = LLM(folder, dtype="float32", max_batch=1, kv_cache_tokens=args.context + 64)
        runner, kv, states = llm.runner, llm.runner.kv, llm.runner.states
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        def engine_prefill():
            blocks, slot = kv.allocate(kv.blocks_for(len(ids))), states.take()
            for start in range(0, args.context, 512):
                runner.forward([SeqChunk(blocks, start, ids[start:min(start + 512, args.context)], state=slot)])
            return blocks, slot

        def hf_prefill():
            return ref(torch.tensor([ids[:args.context]]), use_cache=True).past_key_values

        for _ in range(args.rounds):
            for side in SIDES:
                t0 = time.perf_counter()
                held = engine_prefill() if side == "engine" else hf_prefill()
                prefill[side].append(time.perf_counter() - t0)
                for k in range(args.steps + 1):
                    t0 = time.perf_counter()
                    if side == "engine":        # the same step again: the state and KV move on, as a decode does
                        out = runner.forward([SeqChunk(held[0], args.context, ids[args.context:], state=held[1])])[-1]
                    else:
                        out = ref(torch.tensor([ids[args.context:]]), cache=held, use_cache=True).logits[0, -1]
                    if k:
                        step[side].append(time.perf_counter() - t0)
                    else:
                        logits[side] = out.float()
                if side == "engine":
                    kv.release(held[0])
                    states.give(held[1])
    med = {s: {"prefill_s": statistics.median(prefill[s]), "decode_step_s": statistics.median(step[s])} for s in SIDES}
    return {"hardware": describe(), "family": args.family, "context": args.context, "recurrent_layers": args.layers,
            "shape": SHAPES[args.family],
            "seconds": med, "all": {"prefill": prefill, "step": step},
            "prefill_speedup": med["transformers"]["prefill_s"] / med["engine"]["prefill_s"],
            "decode_speedup": med["transformers"]["decode_step_s"] / med["engine"]["decode_step_s"],
            "same_next_token": int(logits["engine"].argmax()) == int(logits["transformers"].argmax()),
            "max_logit_diff": float((logits["engine"] - logits["transformers"]).abs().max())}


def plot(result: dict, path: Path) -> None:
    s = result["seconds"]
    bars(path, [f"{side}\nprefill" for side in SIDES] + [f"{side}\ndecode x100" for side in SIDES],
         [s[side]["prefill_s"] for side in SIDES] + [100 * s[side]["decode_step_s"] for side in SIDES], "seconds",
         f"{NAMES[result.get('family', 'granitemoehybrid')][0]} shape, "
         f"{result.get('recurrent_layers', result.get('mamba_layers'))} layers, {result['context']} tokens\n"
         f"{result['hardware']['cpu']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(SHAPES), default="granitemoehybrid")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    parsed = parse(ap, lambda a: ROOT / "bench" / "results" / NAMES[a.family][1], plot)
    if parsed is None:
        return
    args, out = parsed
    result = run(args)
    print(f"{'side':13s} {'prefill s':>10s} {'decode ms':>10s}")
    for side in SIDES:
        s = result["seconds"][side]
        print(f"{side:13s} {s['prefill_s']:10.2f} {1e3 * s['decode_step_s']:10.2f}")
    print(f"engine vs transformers: prefill {result['prefill_speedup']:.2f}x, decode {result['decode_speedup']:.2f}x; "
          f"same next token: {result['same_next_token']} (max logit difference {result['max_logit_diff']:.1e}); "
          f"{result['hardware']['cpu']}")
    save(result, out, plot)


if __name__ == "__main__":
    main()
