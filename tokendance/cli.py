"""Command line: `tokendance generate "..."`, `tokendance chat`, `tokendance demo`."""

from __future__ import annotations

import argparse
import sys
import time

from tokendance.errors import TokenDanceError

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokendance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a raw text prompt")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="chat with the model (one message with -m, else interactive)")
    chat.add_argument("-m", "--message", help="send one message, print the reply and exit")
    demo = sub.add_parser("demo", help="a small closed-loop multi-agent simulation: tokendance vs prefix caching")
    demo.add_argument("--agents", type=int, default=8)
    demo.add_argument("--rounds", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    demo.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    for p in (gen, chat):
        p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
        p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with round-aware sharing")
    from tokendance.server.cli import add_serve_arguments

    add_serve_arguments(serve)
    bench = sub.add_parser("bench", help="a multi-agent workload against the reuse modes side by side")
    from tokendance.bench.cli import add_bench_arguments

    add_bench_arguments(bench)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except TokenDanceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _load(args):
    from tokendance import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, max_tokens=args.max_tokens,
    )
    return llm, params, time.perf_counter() - started


def _timing(output, load_seconds: float | None = None) -> str:
    prefill = output.first_token_time - output.arrival_time
    decode = output.finish_time - output.first_token_time
    rate = (output.num_generated_tokens - 1) / decode if decode > 0 else float("nan")
    parts = [] if load_seconds is None else [f"load {load_seconds:.1f}s"]
    parts += [
        f"prompt {output.num_prompt_tokens} tok ({output.num_cached_tokens} cached)",
        f"time to first token {prefill * 1000:.0f} ms",
        f"{output.num_generated_tokens} tok generated at {rate:.1f} tok/s",
        f"finish: {output.finish_reason}",
    ]
    return " | ".join(parts)


def cmd_generate(args) -> int:
    llm, params, load_seconds = _load(args)
    (output,) = llm.generate(args.prompt, params)
    print(output.text)
    print(_timing(output, load_seconds), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm, params, _ = _load(args)
    messages = []
    incoming = [args.message] if args.message else _read_lines()
    for line in incoming:
        messages.append({"role": "user", "content": line})
        (output,) = llm.chat(messages, params)
        messages.append({"role": "assistant", "content": output.text})
        print(output.text, flush=True)
        print(_timing(output), file=sys.stderr, flush=True)
    return 0


def _read_lines():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def cmd_demo(args) -> int:
    from tokendance.bench.demo import run_demo

    return run_demo(args)


def cmd_serve(args) -> int:
    from tokendance.server.cli import run_server

    return run_server(args)


def cmd_bench(args) -> int:
    from tokendance.bench.cli import run_bench

    return run_bench(args)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "demo": cmd_demo, "serve": cmd_serve, "bench": cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
