"""The ``interlace`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import List, Optional


def _load_engine(args: argparse.Namespace):
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.engine import NativeEngine

    path = args.model or embedded_model_dir()
    return NativeEngine.load(path, dtype=args.dtype, device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from interlace.engine_ext.errors import EngineError
    from interlace.engine_ext.protocol import SamplingParams

    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = _load_engine(args)
    tok = engine.tokenizer
    if args.raw or tok is None or not tok.chat_template:
        ids = tok.encode(args.prompt) if tok else [int(t) for t in args.prompt.split()]
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tok.encode_chat(messages + [{"role": "user", "content": args.prompt}])

    async def run() -> None:
        await engine.fill("cli", ids)
        async for ev in engine.generate("cli", sampling):
            sys.stdout.write(ev.text if tok else f"{ev.token_id} ")
            sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(run())
    except EngineError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from interlace.bench import engine as bench_engine

        return bench_engine.main(args.rest)
    print(f"unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="interlace", description="Interlace agent gateway and engine")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply with the native engine (chat-templated, greedy by default)")
    g.add_argument("prompt")
    g.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--system", help="system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="run a benchmark (engine)")
    b.add_argument("what", choices=["engine"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
