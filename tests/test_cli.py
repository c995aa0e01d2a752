"""The command line's help, without the model."""

from __future__ import annotations

import argparse

from tokendance.cli import build_parser


def test_every_option_of_every_command_says_what_it_does():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"generate", "chat", "demo", "serve", "bench"}
    for name, command in commands.choices.items():
        assert command.description, name
        for action in command._actions:
            assert action.help, (name, action.option_strings or action.dest)
        text = command.format_help()
        if name == "serve":
            assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text
