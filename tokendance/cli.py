"""Command line: `tokendance generate "..."`, `tokendance chat`, `tokendance demo`."""

from __future__ import annotations

import argparse
import sys
import time

from tokendance.errors import TokenDanceError

DEMO_PROMPT = "In three sentences, why do multi-agent simulations need efficient LLM serving?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokendance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a raw text prompt")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="chat with the model (one message with -m, else interactive)")
    chat.add_argument("-m", "--message", help="send one message, print the reply and exit")
    demo = sub.add_parser("demo", help="answer one chat prompt and print its timing")
    for p in (gen, chat, demo):
        p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
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
    llm, params, load_seconds = _load(args)
    print(f"model: {llm.engine.model_name} ({args.dtype}), loaded in {load_seconds:.1f}s")
    print(f"user: {DEMO_PROMPT}")
    (output,) = llm.chat([{"role": "user", "content": DEMO_PROMPT}], params)
    print(f"assistant: {output.text}")
    print(_timing(output))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "demo": cmd_demo}

if __name__ == "__main__":
    sys.exit(main())
