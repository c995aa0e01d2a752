"""What the plugin's modules load, each imported in a fresh interpreter: the package (imported by
every vLLM process) loads no engine, neither torch nor vLLM; the scheduler side (in vLLM's engine
core, plain Python over what vLLM hands it) and the plan it sends the workers load neither torch
nor vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def loaded_modules(module: str) -> set[str]:
    """`sys.modules` of a fresh interpreter that imported `module`."""
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_package_imports_neither_torch_nor_vllm_nor_the_engine():
    modules = loaded_modules("tokendance.vllm_plugin")
    assert {"torch", "vllm", "tokendance.llm", "tokendance.engine"} & modules == set()


@pytest.mark.parametrize("module", ["tokendance.vllm_plugin.scheduler.side", "tokendance.vllm_plugin.step_plan"])
def test_the_scheduler_side_imports_neither_torch_nor_vllm(module):
    modules = loaded_modules(module)
    assert {"torch", "vllm"} & modules == set()
