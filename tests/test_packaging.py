"""The installable wheel: built from the repository with `pip wheel`, installed into a fresh
virtual environment, and run there, with the machine's C compiler (the kernels are built from
the sources the wheel carries) and without one (eager fallback)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import torch

from tokendance.model.platform import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
RUN = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
import tokendance
from tokendance import LLM, SamplingParams
llm = LLM(dtype="float32")
(out,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))
print("module", tokendance.__file__)
print("kernel", llm.engine.runner.model.attention.decode is not None)
print("pointwise", llm.engine.runner.model.pointwise.lib is not None)
print("text", repr(out.text))
print("prefill", LLM(dtype="auto").engine.runner.model.attention.prefill is not None)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory, model_weights) -> Path:
    """A fresh venv holding only the wheel; the dependencies come from this environment's
    site-packages through a path file (which does not run this environment's editable install)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: an in-tree build would leave build/ in the repository
    shutil.copytree(ROOT / "tokendance", source / "tokendance", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "dist").glob("tokendance-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {f"tokendance/model/kernels/{name}" for name in ("paged_decode.c", "prefill_bf16.c", "pointwise.c",
                                                                "kernel_math.h")}
    assert kernels <= set(names)
    venv.create(root / "env", with_pip=False)
    python = root / "env" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return python


@pytest.mark.parametrize("compiler", ["gcc", "no-such-compiler"])
def test_the_installed_wheel_runs(installed, tmp_path, compiler):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CC": compiler, "TOKENDANCE_CACHE": str(tmp_path)}
    # a simulated CPU (docs/architecture.md) is simulated in the wheel's process too
    env.update({k: v for k, v in os.environ.items() if k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                             "TOKENDANCE_NATIVE_BF16")})
    done = subprocess.run([installed, "-c", RUN], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("module", "kernel", "pointwise", "text", "prefill"))
    assert str(installed.parent.parent) in lines["module"]  # the wheel's copy, not the repository's
    assert ast.literal_eval(lines["text"]).strip()
    has_gcc = subprocess.run(["which", "gcc"], capture_output=True).returncode == 0
    assert lines["kernel"] == lines["pointwise"] == str(compiler == "gcc" and has_gcc)
    bf16_dot_products = "avx512_bf16" in cpu_flags() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    # auto: bf16 there; on AMX prefill attention runs in SDPA (CpuInfo.prefers_prefill_kernel)
    assert lines["prefill"] == str(compiler == "gcc" and has_gcc and bf16_dot_products and "amx_bf16" not in cpu_flags())
    if compiler != "gcc":
        assert "no C compiler found" in done.stdout
