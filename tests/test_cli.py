"""The command line's help, without the model."""

from __future__ import annotations

import argparse

from tokendance.cli import build_parser


def test_every_option_of_every_command_says_what_it_does():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"generate", "chat", "demo", "serve", "bench", "models"}
    for name, command in commands.choices.items():
        assert command.description, name
        for action in command._actions:
            assert action.help, (name, action.option_strings or action.dest)
        text = command.format_help()
        if name == "serve":
            assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text


def test_version(capsys):
    import importlib.metadata

    import pytest

    from tokendance.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokendance {importlib.metadata.version('tokendance')}"


def test_bench_against_a_server_that_is_not_up_is_one_line(capsys):
    """No traceback: one line naming the target and what to do, exit status 1."""
    import socket

    from tokendance.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = main(["bench", "--target", f"http://127.0.0.1:{port}/v1", "--workload", "generative-agents",
                   "--agents", "2", "--rounds", "1"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"error: cannot reach http://127.0.0.1:{port}/v1") and "tokendance serve" in err


def test_serve_is_exact_by_default_and_gathers_rounds_only_where_they_share_kv():
    from tokendance.server.cli import DEFAULT_GATHER_MS, gather_window_ms

    def parse(*argv):
        return build_parser().parse_args(["serve", *argv])

    assert parse().reuse == "prefix" and gather_window_ms(parse()) == 0  # nothing to gain from holding a chat
    assert gather_window_ms(parse("--reuse", "tokendance")) == DEFAULT_GATHER_MS
    assert gather_window_ms(parse("--fidelity", "fast")) == DEFAULT_GATHER_MS
    assert gather_window_ms(parse("--fidelity", "exact", "--gather-window-ms", "20")) == 20


def test_bench_quality_with_a_target_is_refused_not_run_as_the_latency_bench(capsys):
    from tokendance.cli import main

    assert main(["bench", "quality", "--target", "http://127.0.0.1:9/v1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: bench quality runs in process") and "--loop closed" in err
