"""``freetoken``: generate, serve, calibrate, convert.

Every user error ends as one line on stderr and exit code 2 (no traceback): argparse errors,
``EngineError`` and the OS errors of reading a model folder.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import env   # (the package sets OMP_WAIT_POLICY=PASSIVE before torch loads: __init__.py)
from .config import SPECULATIVE_METHODS
from .errors import ConfigError, EngineError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_ngram(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be MIN,MAX (two integers), got {text!r}") from None
    return lo, hi


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="model folder (Hugging Face layout); default: embedded SmolLM2 MoE")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--expert-cache-experts", type=int, help="slots in the shared expert cache")
    g.add_argument("--expert-cache-gb", type=float, help="expert cache size in GB")
    p.add_argument("--cpu-expert-fraction", type=float,
                   help="force the share (0..1) of each step's cache misses computed in place")
    p.add_argument("--max-context", type=int, help="limit the context length (tokens)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per prefill step (default 512 on the CPU, 8192 on a GPU, where each step "
                        "streams the experts the cache lacks over PCIe whatever its size: larger steps prefill "
                        "long prompts faster, for more memory and a longer pause of the requests decoding alongside)")
    p.add_argument("--decode-pause-ms", type=float, metavar="MS",
                   help="a prefill step that takes longer than MS runs the requests decoding alongside as "
                        "steps of their own between its layers, each time they have waited MS (default 100 "
                        "on a GPU, 500 on the CPU; 0: they get one token per prefill step, riding in it)")
    p.add_argument("--state-checkpoints", type=int, metavar="N",
                   help="hybrid models (Gated DeltaNet layers): recurrent-state checkpoints kept at anchors "
                        "(turn ends, thinking blocks, tool calls), so a conversation or an agent resumes "
                        "from the nearest one instead of prefilling again (default: as many as 1 GB holds "
                        "on the CPU, 0.5 GB on a GPU, 4 to 64; 0: none)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: each decode step also checks up to K tokens drafted from an "
                        "earlier occurrence of the context's last words (prompt lookup; 0, the default: off). "
                        "The output is unchanged; code edits and quoted text then take fewer passes")
    p.add_argument("--speculative-method", default="ngram", choices=SPECULATIVE_METHODS,
                   help="where drafts come from: ngram (prompt lookup, any model; the default) or mtp (the "
                        "model's own multi-token-prediction layer, as Qwen3-Next and Qwen3.5/3.6 ship it: "
                        "drafts for any text, at one extra layer's pass per draft token, a CUDA graph on a GPU; "
                        "it pays when most drafts are kept: on the H200, a 16-layer Qwen3.6-shaped hybrid ran "
                        "1.4-1.8x with every draft kept, 0.9-1.1x with 70%% and 0.8-0.9x with half; "
                        "docs/speculative.md)")
    p.add_argument("--speculative-draft-vocab", type=int, default=0, metavar="N",
                   help="mtp: draft among the first N token ids only (BPE vocabularies list the most frequent "
                        "first), reading N rows of the LM head per draft token instead of all of them; the "
                        "output is unchanged (default 0: every id)")
    p.add_argument("--speculative-ngram", default="2,4", metavar="MIN,MAX", type=_parse_ngram,
                   help="the shortest and longest suffix a draft is matched on (default 2,4)")
    p.add_argument("--speculative-max-batch", type=int, default=1, metavar="N",
                   help="draft only in decode steps of at most N requests (default 1: a batch already reads "
                        "each weight once for all its rows, and each draft row adds compute)")
    p.add_argument("--expert-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="expert cache control and kernels: triton on CUDA by default")
    p.add_argument("--expert-format", default="auto", choices=["auto", "mxfp4", "dense"],
                   help="experts a checkpoint stores in MXFP4 (gpt-oss): auto keeps them in 4 bits (a quarter "
                        "of the memory; on the CPU about twice the expert speed) unless a GPU holds them all "
                        "dense, where dense runs faster; dense always dequantizes")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode eagerly instead of as captured CUDA graphs (CUDA only)")
    p.add_argument("--graph-warmup", type=int, default=4, metavar="N",
                   help="capture the decode graphs of batch sizes 1..N before serving (default 4; "
                        "0: capture each on its first use)")
    p.add_argument("--graph-warmup-widths", type=int, default=1, metavar="W",
                   help="... at the narrowest W context widths (256, 512, ... keys; default 1, 0: every "
                        "width); a server captures the wider ones while idle, otherwise on first use")
    p.add_argument("--graph-memory-gb", type=float, default=0.5, metavar="GB",
                   help="device memory the decode graphs may take, about (default 0.5, some 36 graphs of a "
                        "48-layer MoE; 0: no limit): once their measured memory reaches it, their number "
                        "stays, and a new batch size or context width takes the place of the graph used "
                        "least recently")
    p.add_argument("--split-tuning", action="store_true",
                   help="refine the calibrated q* online by measured decode step time (CUDA only; "
                        "see docs/gpu.md for when it helps)")
    p.add_argument("--no-cpu-rate-probe", dest="cpu_rate_probe", action="store_false",
                   help="keep the calibrated q* as measured: by default a GPU engine measures the CPU's "
                        "rate on this model's experts at start and again while another process holds "
                        "some of the kernel's CPUs, and moves the split by it")
    p.add_argument("--no-fused-cpu-decode", dest="fused_cpu_decode", action="store_false",
                   help="run every layer's modules in a CPU decode step: by default a plain layer's step is "
                        "two compiled calls, the same result (docs/cpu_kernel.md)")


def _engine_kwargs(args) -> dict:
    kw = dict(device=args.device, dtype=args.dtype, expert_cache_experts=args.expert_cache_experts,
              expert_cache_gb=args.expert_cache_gb, cpu_expert_fraction=args.cpu_expert_fraction,
              max_context=args.max_context, prefill_chunk=args.prefill_chunk, decode_pause_ms=args.decode_pause_ms,
              state_checkpoints=args.state_checkpoints,
              expert_backend=args.expert_backend, expert_format=args.expert_format, cuda_graphs=args.cuda_graphs,
              graph_warmup=args.graph_warmup,
              graph_warmup_widths=args.graph_warmup_widths, graph_memory_gb=args.graph_memory_gb,
              split_tuning=args.split_tuning,
              cpu_rate_probe=args.cpu_rate_probe, fused_cpu_decode=args.fused_cpu_decode,
              speculative_tokens=args.speculative_tokens,
              speculative_ngram=args.speculative_ngram, speculative_max_batch=args.speculative_max_batch,
              speculative_method=args.speculative_method, speculative_draft_vocab=args.speculative_draft_vocab)
    return kw



def _model_dir(args) -> Path:
    if args.model is not None:
        return args.model
    from .models.default import default_model_dir
    return default_model_dir(progress=True)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",")] if text.strip() else []
    except ValueError:
        raise ConfigError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _guide(args):
    """--json-schema (inline JSON or a file) or --regex as the answer's grammar."""
    from .executor import guide
    if args.regex is not None:
        return guide.GuideSpec(guide.regex(args.regex, "--regex"))
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise ConfigError(f"--json-schema: cannot read {args.json_schema}: {exc.strerror}") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--json-schema is not JSON: {exc}") from None
    return guide.GuideSpec(guide.json_schema(schema, "--json-schema"))


def cmd_generate(args) -> int:
    from .executor.sampler import SamplingParams
    from .llm import LLM
    llm = LLM(_model_dir(args), **_engine_kwargs(args))
    if args.prompt_ids is not None:
        ids = _parse_ids(args.prompt_ids)
    elif llm.tokenizer is None:
        raise ConfigError("this model has no tokenizer (tokenizer.json or tiktoken.model): use --prompt-ids")
    elif llm.tokenizer.chat_template:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.tokenizer.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, guide=_guide(args))
    out = llm.generate(ids, params)
    text = llm.tokenizer.decode(out.token_ids) if llm.tokenizer else None
    if args.json:
        if text is not None:
            print(text)
        print(json.dumps({"token_ids": out.token_ids, "text": text, "finish_reason": out.finish_reason,
                          "stats": out.stats}))
    else:
        print(text if text is not None else ",".join(map(str, out.token_ids)))
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import load_or_measure
    from .config import check_device
    result = load_or_measure(check_device(args.device) if args.device else "cuda" if _cuda() else "cpu",
                             refresh=args.refresh)
    if args.json:
        print(json.dumps(result))
    else:
        for key in ("pcie_gbps", "cpu_expert_gbps", "fill_fraction"):
            print(f"{key:16} {result[key]}")
        print(f"{'concurrent':16} {result['concurrent']}")
    return 0


def cmd_serve(args) -> int:
    from .server.serve import serve_main
    return serve_main(args) or 0


def cmd_convert(args) -> int:
    from .packed import convert
    convert(args.model, args.out, expert_format=args.expert_format)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="freetoken", description="Edge-native MoE inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    _add_engine_options(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (goes through the chat template when present)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, sent as they are")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="SCHEMA", help="the answer is JSON matching this JSON Schema "
                     "(inline, or a file)")
    fmt.add_argument("--regex", metavar="PATTERN", help="the answer matches this regular expression")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve OpenAI- and Anthropic-compatible APIs")
    _add_engine_options(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=1919)
    srv.add_argument("--api-key", default=env.api_key(),
                     help="require this key for inference endpoints (default: $FREETOKEN_API_KEY)")
    srv.add_argument("--admin-token", default=env.admin_token(),
                     help="require this token for /admin/* (default: $FREETOKEN_ADMIN_TOKEN; "
                          "none: loopback only)")
    srv.add_argument("--served-model-name", help="model name in the API (default: folder name)")
    srv.add_argument("--max-batch", type=int, default=32, help="requests decoded together")
    srv.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    srv.set_defaults(func=cmd_serve)

    cal = sub.add_parser("calibrate", help="measure PCIe and CPU-expert bandwidth for q*")
    cal.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    cal.add_argument("--json", action="store_true")
    cal.add_argument("--refresh", action="store_true", help="re-measure instead of using the cache")
    cal.set_defaults(func=cmd_calibrate)

    conv = sub.add_parser("convert", help="write the pre-packed fast-start format")
    conv.add_argument("--model", type=Path, required=True, help="a checkpoint folder or a GGUF file")
    conv.add_argument("--out", type=Path, required=True)
    conv.add_argument("--expert-format", default="auto", choices=["auto", "mxfp4", "dense"],
                      help="experts published in MXFP4 (gpt-oss): kept in 4 bits (auto) or dequantized "
                           "(dense: 3.8x the bytes, faster only on a GPU that holds them all)")
    conv.set_defaults(func=cmd_convert)
    return parser


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.func in (cmd_generate, cmd_serve, cmd_calibrate):
            from . import env
            env.validate()      # before anything slow (the default model's first conversion)
        if args.func in (cmd_generate, cmd_serve):
            from .packed import PackedFormatError, early_cuda, is_packed, preload
            early_read = env.preload()      # "auto" on 2 CPUs: only a read that maps the bank
            if env.preload(mapped=True) and args.model is not None and is_packed(args.model):
                try:   # torch is not imported yet: the read and the CUDA context overlap it
                    early_read |= preload(args.model, device=args.device, mapped_only=not early_read)
                except PackedFormatError:
                    pass    # the load says it as usual: one line here, /health for a server
            if early_read:
                early_cuda.start(args.device)   # any model: the CUDA context beside the imports (once)
        return args.func(args)
    except EngineError as exc:
        print(f"freetoken: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"freetoken: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
