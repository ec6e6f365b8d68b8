"""Fetch vLLM's own tests that kvguard's suite runs, from the PyPI sdist of each series.

``requirements/vllm-tests.ini`` pins, per vLLM series, the sdist's URL and sha256 and the
files to take from it. For a series this downloads the sdist once into a cache outside
the repository (``$KVGUARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvguard``, else
``~/.cache/kvguard``), checks its sha256 on every run, and writes each listed file byte
for byte into the series' folder (``tests/vllm/upstream/v0_34/`` for 0.34), where git
ignores it. Run from any directory, with any Python 3.10 or later (standard library only)::

    python tools/fetch_vllm_tests.py 0.34

``.ci/install-vllm`` runs it. Idempotent: files already equal are left alone, and once
the sdist is cached nothing is downloaded (it works offline). A hash mismatch, a file
missing from the sdist or a failed download is an error (exit 2), and nothing is written.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import http.client
import os
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "requirements" / "vllm-tests.ini"
_CHUNK = 1 << 20


class FetchError(Exception):
    """A fetch that cannot go on: its message says what and what to do."""


@dataclass(frozen=True)
class Copy:
    """One file taken from the sdist: ``member`` (a path under its top folder) as
    ``name`` in the series' folder."""

    member: str
    name: str


@dataclass(frozen=True)
class Pin:
    """One series' section of the pins file."""

    series: str
    sdist: str
    sha256: str
    into: Path
    copies: tuple[Copy, ...]

    @property
    def archive_name(self) -> str:
        """``vllm-0.34.0.tar.gz``."""
        return self.sdist.rsplit("/", 1)[-1]

    @property
    def top(self) -> str:
        """The sdist's top folder, ``vllm-0.34.0``."""
        return self.archive_name.removesuffix(".tar.gz")


def _copy_of(line: str) -> Copy:
    member, _, name = line.partition(" as ")
    member = member.strip()
    return Copy(member=member, name=name.strip() or member.rsplit("/", 1)[-1])


def read_pins(path: Path = PINS) -> dict[str, Pin]:
    """Every series pinned in ``path``, by series (``"0.34"``)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with path.open(encoding="utf-8") as file:
            parser.read_file(file)
    except (OSError, configparser.Error) as error:
        raise FetchError(f"cannot read the pins file {path}: {error}") from error
    pins = {}
    for series in parser.sections():
        section = parser[series]
        try:
            pins[series] = Pin(
                series=series,
                sdist=section["sdist"],
                sha256=section["sha256"].lower(),
                into=ROOT / section["into"],
                copies=tuple(_copy_of(line) for line in section["files"].split("\n") if line),
            )
        except KeyError as error:
            raise FetchError(f"{path} [{series}] lacks the key {error}") from error
    return pins


def missing_copies(pin: Pin) -> list[Path]:
    """The copies of ``pin`` not (yet) in its folder."""
    return [pin.into / copy.name for copy in pin.copies if not (pin.into / copy.name).is_file()]


def cache_dir() -> Path:
    explicit = os.environ.get("KVGUARD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvguard"


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download(pin: Pin, target: Path) -> None:
    """``pin.sdist`` into ``target`` if its sha256 is the pinned one; nothing otherwise."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # A partial or mismatching download never takes the cached file's name.
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as file, urllib.request.urlopen(pin.sdist, timeout=60) as body:
            while chunk := body.read(_CHUNK):
                file.write(chunk)
        got = _sha256_of(Path(partial))
        if got != pin.sha256:
            raise FetchError(
                f"{pin.sdist}: sha256 {got}, but {PINS.name} pins {pin.sha256} for vLLM "
                f"{pin.series} (a changed file on the index, or a wrong pin)"
            )
        os.replace(partial, target)
    except (OSError, http.client.HTTPException) as error:
        raise FetchError(f"cannot download {pin.sdist} into {target.parent}: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def sdist_of(pin: Pin, cache: Path) -> Path:
    """The pinned sdist, from ``cache`` (downloaded there first if absent), its sha256
    checked."""
    path = cache / pin.archive_name
    if not path.is_file():
        print(f"downloading {pin.sdist}", file=sys.stderr)
        _download(pin, path)
    got = _sha256_of(path)
    if got != pin.sha256:
        raise FetchError(
            f"{path}: sha256 {got}, but {PINS.name} pins {pin.sha256} for vLLM {pin.series}; "
            "delete the file to download it again"
        )
    return path


def _contents(pin: Pin, sdist: Path) -> dict[str, bytes]:
    """Each copy's name -> its bytes in the sdist; every listed member must be there."""
    contents, missing = {}, []
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for copy in pin.copies:
                try:
                    member = archive.getmember(f"{pin.top}/{copy.member}")
                except KeyError:
                    member = None
                file = archive.extractfile(member) if member and member.isfile() else None
                if file is None:
                    missing.append(copy.member)
                    continue
                with file:
                    contents[copy.name] = file.read()
    except (OSError, tarfile.TarError) as error:
        raise FetchError(f"cannot read {sdist}: {error}") from error
    if missing:
        raise FetchError(
            f"{sdist.name} has no file {', '.join(missing)} (under {pin.top}/) that "
            f"{PINS.name} lists for vLLM {pin.series}"
        )
    return contents


def _write(path: Path, data: bytes) -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def fetch(pin: Pin, cache: Path) -> list[Path]:
    """Every copy of ``pin`` in its folder, byte for byte; returns those written (the
    others were already equal)."""
    contents = _contents(pin, sdist_of(pin, cache))
    written = []
    try:
        pin.into.mkdir(parents=True, exist_ok=True)
        for name, data in contents.items():
            path = pin.into / name
            if not path.is_file() or path.read_bytes() != data:
                _write(path, data)
                written.append(path)
    except OSError as error:
        raise FetchError(f"cannot write vLLM {pin.series}'s tests: {error}") from error
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fetch_vllm_tests", description=__doc__.split("\n\n", 1)[0] if __doc__ else None
    )
    parser.add_argument("series", help="a vLLM series pinned in requirements/vllm-tests.ini")
    args = parser.parse_args(argv)
    try:
        pins = read_pins()
        pin = pins.get(args.series)
        if pin is None:
            raise FetchError(
                f"no vLLM series {args.series!r} in {PINS} (it pins {', '.join(pins) or 'none'})"
            )
        written = fetch(pin, cache_dir())
    except FetchError as error:
        print(f"fetch_vllm_tests: error: {error}", file=sys.stderr)
        return 2
    folder = pin.into.relative_to(ROOT)
    print(
        f"vLLM {pin.series}'s tests: {len(pin.copies)} files in {folder} from {pin.archive_name} "
        f"({len(written)} written, {len(pin.copies) - len(written)} already equal)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
