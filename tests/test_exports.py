"""The package's public names, imported on first use (`tokendance/__init__.py`): each is the object
its module defines, and type checkers and the API reference read the same names from the same
modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import tokendance


def test_each_public_name_is_the_object_its_module_defines():
    for name, module in tokendance._EXPORTS.items():
        assert getattr(tokendance, name) is getattr(importlib.import_module(module), name)
    assert sorted(tokendance.__all__) == sorted(tokendance._EXPORTS)


def test_the_type_checking_imports_are_the_public_names():
    tree = ast.parse(Path(tokendance.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    imported = {alias.name: statement.module for statement in block.body for alias in statement.names}
    assert imported == tokendance._EXPORTS
