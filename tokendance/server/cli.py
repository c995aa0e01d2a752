"""`tokendance serve`: its arguments and start-up. Importing this module stays cheap (no torch, no
FastAPI): the top-level CLI builds every subcommand's parser on each call."""

from __future__ import annotations

import argparse
import os
import sys

from tokendance import registry
from tokendance.cli_types import parse_bytes
from tokendance.config import AUTO
from tokendance.round_core import fidelity_control
from tokendance.errors import ModelLoadError
from tokendance.tool_formats import TOOL_CALL_FORMATS

DEFAULT_GATHER_MS = 50.0

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="GGUF file, Hugging Face folder or model pack, e.g. qwen2.5-coder-0.5b "
        "(default: SmolLM2-135M-Instruct; with --engine vllm a pack is served from its Hugging Face folder)")
    add("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add("--port", type=int, default=8000, help="port to listen on")
    add("--reuse", default=registry.DEFAULT_REUSE, choices=list(registry.REUSE_POLICIES),
        help="how rounds reuse shared messages (" + registry.describe(registry.REUSE_POLICIES) + ")")
    add("--dtype", default=registry.DEFAULT_DTYPE, choices=list(registry.DTYPES), help=registry.describe(registry.DTYPES))
    add("--kv-cache-bytes", type=parse_bytes, default="auto",
        help="KV pool budget, e.g. 512M or 2G (default auto: a quarter of the available memory, at most 4G)")
    add("--max-model-len", type=int, default=None, help="context window cap (default: the model's)")
    add("--max-num-seqs", type=int, default=64, help="requests the scheduler runs at once")
    add("--num-threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    add("--recompute-ratio", type=float, default=registry.DEFAULT_RECOMPUTE_RATIO,
        help="share of each reused span's tokens recomputed in its new context")
    add("--selection", default=registry.DEFAULT_SELECTION, choices=list(registry.SELECTIONS),
        help="which tokens of a reused span are recomputed (" + registry.describe(registry.SELECTIONS) + ")")
    add("--anchors", type=int, default=1,
        help="in-round anchors: each shared span computed in full in up to this many agents' contexts, "
             "its reused base the mean of them (1: one master)")
    add("--masters", default=registry.DEFAULT_MASTERS, choices=list(registry.MASTERS),
        help="where shared spans get their base KV: " + registry.describe(registry.MASTERS))
    add("--fidelity", default=None, choices=[*registry.FIDELITY, AUTO],
        help="a named preset of --reuse and --recompute-ratio (" + registry.describe(registry.FIDELITY) + "), or "
             "auto: each simulation moves along --fidelity-ladder by a probe per round kept within --fidelity-target")
    add("--fidelity-target", default=fidelity_control.DEFAULT_TARGET,
        help="--fidelity auto: the bound a round's probe must keep (" + ", ".join(
            f"{k}: KL {t.kl:g}, pull {t.pull:g}" for k, t in fidelity_control.TARGETS.items()) + ")")
    add("--fidelity-ladder", nargs="+", default=list(fidelity_control.DEFAULT_LADDER),
        help="--fidelity auto: the settings it moves along, cheapest first, ending at exact")
    add("--batch-invariant", action="store_true",
        help="greedy outputs independent of what else runs in the batch (full and prefix reuse; costs speed)")
    add("--gather-window-ms", type=float, default=None,
        help="a round of chat requests forms when none has come for this long (0: no transparent rounds; default: "
             f"{DEFAULT_GATHER_MS:g} where rounds share KV across agents, --reuse {' or '.join(registry.SHARING)}, else 0)")
    add("--round-timeout-ms", type=float, default=2000.0,
        help="how long a declared round (round_id + round_size) waits for its missing members, "
             "and a transparent one at most")
    add("--api-key", action="append", default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes; repeat for several tenants, whose prefix "
             "caches, sessions and shared KV are kept apart (default: $TOKENDANCE_API_KEY, comma-separated; else none)")
    add("--max-concurrent-requests", type=int, default=1024,
        help="engine requests in flight (each prompt x choice, each agent of a /v1/rounds counts one); "
             "a request that would pass this is answered 429; one larger than it counts as half of it")
    add("--max-body-bytes", type=parse_bytes, default=8 * 2**20, help="larger request bodies are answered 413")
    add("--default-max-tokens", type=int, default=None,
        help="tokens a chat, responses or round request may generate when it sends no max_tokens "
             "(default: none, as OpenAI: up to the context window)")
    add("--max-tokens-limit", type=int, default=None,
        help="most tokens one request may generate: a request asking for more is refused with 400 "
             "(default: none)")
    add("--tool-call-format", default="auto", choices=["auto", *TOOL_CALL_FORMATS],
        help="how the model writes tool calls (auto: from its chat template; hermes: <tool_call> blocks, Qwen's and "
             "the generic one; llama3_json: Llama 3.1+ JSON calls; mistral: [TOOL_CALLS])")
    add("--no-warm-up", dest="warm_up", action="store_false",
        help="ready sooner: skip the two small warm-up rounds at start (the first clients' requests then pay "
             "for compiling the kernels)")
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="server log level")
    add("--replicas", type=int, default=1,
        help="engine replicas behind one endpoint, deployed with Ray Serve (needs 'tokendance[ray]'); "
             "rounds and agents are routed to the replica that holds their KV")
    add("--ray-address", default=None,
        help="with --replicas: join this Ray cluster (e.g. auto, or ray://HOST:10001) instead of starting one")
    add("--engine", default="tokendance", choices=["tokendance", "vllm"],
        help="what each replica runs: this engine, or vLLM with the TokenDance connector (`vllm serve`, a fleet "
             "on Ray Serve even with --replicas 1; --model then names a Hugging Face folder)")
    add("--router", default="tokendance", choices=["tokendance", "prefix", "pow2"],
        help="with replicas: how requests pick one (tokendance: rounds, sessions and prefixes where their KV is; "
             "prefix: Ray Serve's PrefixCacheAffinityRouter; pow2: Ray Serve's default)")
    add("--max-round-agents", type=int, default=None,
        help="with replicas: a round with more agents is split into groups, each on one replica (default: never)")
    add("--vllm-python", default=sys.executable,
        help="with --engine vllm: the Python that has vLLM and this package (default: this one)")
    add("--vllm-arg", action="append", default=None,
        help="with --engine vllm: one more argument for each `vllm serve`; repeat, e.g. --vllm-arg=--enforce-eager")
    add("--store-gib", type=float, default=0.0,
        help="with --engine vllm: each replica's session store (the connector's store_gib)")


def run_server(args: argparse.Namespace) -> int:
    """Check every argument, bind the port, then load the model while the port answers 503."""
    import socket
    import sys

    from tokendance.config import EngineConfig
    from tokendance.errors import InvalidRequestError
    from tokendance.model.loader import check_model_path
    from tokendance.model.packs import PACKS, pack_path

    if args.replicas < 1:
        raise InvalidRequestError("--replicas must be >= 1")
    if args.max_round_agents is not None and args.max_round_agents < 1:
        raise InvalidRequestError("--max-round-agents must be >= 1")
    if args.fidelity == AUTO and args.engine != "tokendance":
        raise InvalidRequestError("--fidelity auto runs in TokenDance's engine (--engine tokendance) for now", "fidelity")
    engine_args = {"recompute_ratio": args.recompute_ratio, "selection": args.selection, "fidelity": args.fidelity,
                   "fidelity_target": args.fidelity_target, "fidelity_ladder": tuple(args.fidelity_ladder),
                   "anchors": args.anchors, "masters": args.masters,
                   "max_model_len": args.max_model_len, "num_threads": args.num_threads}
    llm_args = {"model": args.model, "dtype": args.dtype, "reuse": args.reuse, "kv_cache_bytes": args.kv_cache_bytes,
                "max_num_seqs": args.max_num_seqs, "batch_invariant": args.batch_invariant,
                **{k: v for k, v in engine_args.items() if v is not None}}
    EngineConfig(**llm_args)  # the engine's own checks, before the long load
    server_config(args, args.served_model_name or "model")
    if args.engine == "tokendance":
        check_model_path(args.model)
    elif args.model in PACKS:
        pack_path(args.model)  # installed, or refused with the command that installs it
    # Bind first: a busy port fails in a second with one line, not after loading the model.
    try:
        sock = socket.create_server((args.host, args.port), backlog=2048)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        print(f"error: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 1
    if args.replicas > 1 or args.ray_address or args.engine == "vllm":
        sock.close()  # Ray Serve's proxy listens there
        try:
            from tokendance.server.fleet.launch import run_replicas
        except ImportError as exc:
            print(f"error: --replicas needs Ray Serve: pip install 'tokendance[ray]' ({exc})", file=sys.stderr)
            return 1
        name = args.served_model_name or ("smollm2" if args.engine == "vllm" and not args.model else None)
        if args.engine == "vllm" and args.model in PACKS:  # vLLM serves a pack from its folder
            name, args.model = name or args.model, pack_folder(args.vllm_python, args.model)
        if args.engine == "vllm" and name is None:
            name = os.path.basename(os.path.normpath(args.model))
        return run_replicas(args, llm_args, server_config(args, name))
    return _serve_one(args, sock, llm_args)


def pack_folder(python: str, pack: str) -> str:
    """The Hugging Face folder of an installed model pack, written once by the vLLM environment's
    transformers (`tokendance models folder`)."""
    import subprocess

    done = subprocess.run([python, "-m", "tokendance.cli", "models", "folder", pack], capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelLoadError(f"the folder of model pack {pack!r} could not be written: {done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1]


def gather_window_ms(args: argparse.Namespace) -> float:
    """The gather window asked, else DEFAULT_GATHER_MS where the reuse shares KV across agents (a
    round of exact reuse gains nothing from waiting for its members)."""
    if args.gather_window_ms is not None:
        return args.gather_window_ms
    if args.fidelity == AUTO:
        return DEFAULT_GATHER_MS
    reuse = registry.FIDELITY[args.fidelity].settings.get("reuse", args.reuse) if args.fidelity else args.reuse
    return DEFAULT_GATHER_MS if reuse in registry.SHARING else 0.0


def server_config(args: argparse.Namespace, model_name: str | None):
    from tokendance.server.config import ServerConfig

    return ServerConfig(
        model_name=model_name,
        api_keys=tuple(args.api_key or [k for k in os.environ.get("TOKENDANCE_API_KEY", "").split(",") if k]),
        gather_window_s=gather_window_ms(args) / 1000,
        round_timeout_s=args.round_timeout_ms / 1000,
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        tool_call_format=args.tool_call_format,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
    )


def _serve_one(args: argparse.Namespace, sock, llm_args: dict) -> int:
    """Serve on `sock` at once: 503 while the model loads and warms up (server/starting.py), then
    the app. A failed load stops the server with its reason in one line and exit status 1."""
    import sys
    import time

    import uvicorn

    from tokendance.server.starting import StartingApp

    failure: list[BaseException] = []
    url = f"http://{args.host}:{sock.getsockname()[1]}"  # the port bound (--port 0: any free one)

    def build():
        from tokendance import LLM
        from tokendance.server.app import create_app

        started = time.perf_counter()
        print(f"loading {llm_args['model'] or 'the default model (SmolLM2-135M-Instruct)'}; {url}/health answers "
              f"503 until it is ready", flush=True)
        llm = LLM(**llm_args)
        loaded = time.perf_counter()
        if args.warm_up:
            print(f"loaded in {loaded - started:.1f} s; warming up (compiling the kernels)", flush=True)
            llm.warm_up()  # compile the kernels now, not on the first clients' round
        else:
            print(f"loaded in {loaded - started:.1f} s (--no-warm-up: the first requests compile the kernels)",
                  flush=True)
        app = create_app(llm, server_config(args, args.served_model_name or llm.engine.model_name))
        _announce(args, llm, app.state.config, url, time.perf_counter() - started)
        return app

    def failed(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    server = uvicorn.Server(uvicorn.Config(StartingApp(build, failed), log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    if failure:
        if args.debug:
            raise failure[0]
        from tokendance.errors import error_line

        print(f"error: {error_line(failure[0])}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _announce(args, llm, config, url: str, seconds: float) -> None:
    engine = llm.engine
    reuse = engine.config
    print(f"ready in {seconds:.1f} s: serving {config.model_name} (reuse={reuse.reuse}, recompute ratio "
          f"{reuse.recompute_ratio:g}, fidelity {reuse.fidelity_name}{', batch-invariant' if reuse.batch_invariant else ''}, "
          f"dtype {engine.dtype}, CPU {engine.cpu.describe()}, KV pool {engine.kv_cache_bytes >> 20} MiB) on {url}/v1",
          flush=True)
    if engine.sampling_defaults:
        print(f"default sampling from the model's generation_config.json: {engine.sampling_defaults}", flush=True)
    for warning in reuse.warnings:
        print(f"warning: {warning}", flush=True)
