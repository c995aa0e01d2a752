"""Model packs' installer on small packs the tests make: real wheels in a folder that real pip
downloads from (`--no-index --find-links`), parts checked one by one, the file renamed into place
only once complete, a second install that does nothing, a pack not installed refused by name."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tokendance.model import packs
from tokendance.model.packs import ModelPack, Part, PackError


def make_wheel(folder: Path, distribution: str, version: str, member: str, data: bytes) -> None:
    """A wheel as the real part wheels are laid out: the part under <module>/data/, stored."""
    module = distribution.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def make_pack(folder: Path, name: str, part_sizes: list[int], seed: int = 0) -> tuple[ModelPack, list[bytes]]:
    """A pack of parts of random bytes, its wheels written into `folder`."""
    rng = __import__("random").Random(seed)
    chunks = [rng.randbytes(size) for size in part_sizes]
    parts = []
    for k, chunk in enumerate(chunks, start=1):
        distribution = f"tdtest-{name}-part{k}"
        member = f"{distribution.replace('-', '_')}/data/part{k:02d}.bin"
        make_wheel(folder, distribution, "1.0", member, chunk)
        parts.append(Part(distribution, "1.0", member, len(chunk), hashlib.sha256(chunk).hexdigest()))
    whole = b"".join(chunks)
    pack = ModelPack(name=name, title=name, about="test", file_name=f"{name}.gguf", size=len(whole),
                     sha256=hashlib.sha256(whole).hexdigest(), parts=tuple(parts))
    return pack, chunks


@pytest.fixture
def index(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    return folder


def pip_args(index: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(index))


def test_a_pack_installs_once_and_a_second_install_does_nothing(index, tmp_path):
    pack, chunks = make_pack(index, "tiny", [1000, 1000, 333])
    root = tmp_path / "cache"
    path, done = packs.install("tiny", root, pip_args(index), progress=False, packs={"tiny": pack})
    assert done and path == root / "tiny.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert packs.pack_path("tiny", root, packs={"tiny": pack}) == path
    assert sorted(p.name for p in root.iterdir()) == [".install.lock", "tiny.gguf", "tiny.gguf.sha256"]  # no download, no partial left
    before = path.stat().st_mtime_ns
    again, done = packs.install("tiny", root, ("--no-index", "--find-links", str(tmp_path / "nowhere")),
                                progress=False, packs={"tiny": pack})
    assert again == path and not done and path.stat().st_mtime_ns == before  # pip was not even asked


def test_a_missing_part_is_named(index, tmp_path):
    pack, _ = make_pack(index, "gap", [500, 500, 500])
    (index / "tdtest_gap_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(PackError, match=r"could not download tdtest-gap-part2==1\.0"):
        packs.install("gap", tmp_path / "cache", pip_args(index), progress=False, packs={"gap": pack})
    assert not (tmp_path / "cache" / "gap.gguf").exists()


@pytest.mark.parametrize("fault", ["digest", "size", "member"])
def test_a_corrupt_part_is_refused_by_number_and_leaves_no_file(index, tmp_path, fault):
    pack, chunks = make_pack(index, "bad", [700, 700, 300])
    broken = bytearray(chunks[1])
    if fault == "digest":
        broken[10] ^= 1
    elif fault == "size":
        broken += b"x"
    member = pack.parts[1].member if fault != "member" else "tdtest_bad_part2/data/other.bin"
    make_wheel(index, pack.parts[1].distribution, "1.0", member, bytes(broken))
    expected = {"digest": r"part 2 \(tdtest-bad-part2==1\.0, .*\) has sha256 [0-9a-f]{64}, expected",
                "size": r"part 2 \(tdtest-bad-part2==1\.0, .*\) is larger than the 700 bytes expected",
                "member": r"part 2 \(tdtest-bad-part2==1\.0\) has no tdtest_bad_part2/data/part02\.bin"}[fault]
    root = tmp_path / "cache"
    with pytest.raises(PackError, match=expected):
        packs.install("bad", root, pip_args(index), progress=False, packs={"bad": pack})
    assert [p.name for p in root.iterdir()] == [".install.lock"]
    with pytest.raises(PackError, match="is not installed: run `tokendance models install bad`"):
        packs.pack_path("bad", root, packs={"bad": pack})


def test_a_pack_whose_digest_is_wrong_as_a_whole_is_refused(index, tmp_path):
    pack, _ = make_pack(index, "whole", [400, 400])
    pack = dataclasses.replace(pack, sha256="0" * 64)
    with pytest.raises(PackError, match="the assembled file is 800 bytes, sha256 .* expected 800 bytes, sha256 0000"):
        packs.install("whole", tmp_path / "cache", pip_args(index), progress=False, packs={"whole": pack})
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".install.lock"]


INSTALL = """
import pickle, sys
from pathlib import Path
from tokendance.model import packs
pack = pickle.loads(bytes.fromhex(sys.argv[1]))
packs.install(pack.name, Path(sys.argv[2]), tuple(sys.argv[3:]), progress=False, packs={pack.name: pack})
"""


def test_an_install_killed_midway_leaves_no_file_where_a_complete_one_is_expected(index, tmp_path):
    """SIGKILL while the parts are copied: the final path is never written, the next install
    removes the temporary file and completes."""
    import pickle

    pack, chunks = make_pack(index, "big", [64 << 20] * 3)
    root = tmp_path / "cache"
    child = subprocess.Popen([sys.executable, "-c", INSTALL, pickle.dumps(pack).hex(), str(root), *pip_args(index)])
    deadline = time.monotonic() + 120
    while not list(root.glob(".big.gguf.*.partial")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "the install finished before it could be interrupted"
    assert list(root.glob(".big.gguf.*.partial")) and not (root / "big.gguf").exists()
    with pytest.raises(PackError, match="not installed"):
        packs.pack_path("big", root, packs={"big": pack})
    path, done = packs.install("big", root, pip_args(index), progress=False, packs={"big": pack})
    assert done and path.stat().st_size == pack.size
    assert [p.name for p in root.glob(".*")] == [".install.lock"]  # the stale partial and download folder are gone


def test_a_file_at_the_final_path_without_its_digest_stamp_is_not_taken_as_installed(index, tmp_path):
    pack, _ = make_pack(index, "stamp", [300])
    root = tmp_path / "cache"
    root.mkdir()
    (root / "stamp.gguf").write_bytes(b"\0" * 300)  # right size, never verified
    assert packs.find_pack_file(pack, root) is None
    path, done = packs.install("stamp", root, pip_args(index), progress=False, packs={"stamp": pack})
    assert done and hashlib.sha256(path.read_bytes()).hexdigest() == pack.sha256


def test_a_pack_name_works_where_a_model_path_does_and_is_refused_with_its_install_command(tmp_path, monkeypatch):
    from tokendance.errors import ModelLoadError
    from tokendance.model.loader import check_model_path

    monkeypatch.setenv(packs.CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"run `tokendance models install qwen2\.5-coder-1\.5b`"):
        check_model_path("qwen2.5-coder-1.5b")
    with pytest.raises(ModelLoadError, match="model pack: smollm2-135m, qwen2.5-coder-0.5b"):
        check_model_path("qwen2.5-coder-7b")
    assert check_model_path("smollm2-135m") == check_model_path(None)  # the default model's wheel, in place
    done = subprocess.run([sys.executable, "-m", "tokendance.cli", "models", "path", "qwen2.5-coder-0.5b"],
                          capture_output=True, text=True, env={**os.environ, packs.CACHE_ENV: str(tmp_path)})
    assert done.returncode == 1 and "tokendance models install qwen2.5-coder-0.5b" in done.stderr
    listed = subprocess.run([sys.executable, "-m", "tokendance.cli", "models"], capture_output=True, text=True,
                            env={**os.environ, packs.CACHE_ENV: str(tmp_path)})
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()[1::2]] == list(packs.PACKS)


def test_every_pack_pins_parts_that_add_up_to_its_file():
    for pack in packs.PACKS.values():
        assert sum(part.size for part in pack.parts) == pack.size
        assert all(len(part.sha256) == 64 and "==" in part.requirement for part in pack.parts)
        assert len({part.member for part in pack.parts}) == len(pack.parts)
