"""tools/fetch_vllm_tests.py on a tiny hand-made sdist (served from a file: URL): the
copies byte for byte, idempotent, offline once cached; a hash mismatch or a missing
member is an error that writes nothing."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tools.fetch_vllm_tests import (
    PINS,
    ROOT,
    Copy,
    FetchError,
    Pin,
    fetch,
    main,
    missing_copies,
    read_pins,
)

MEMBERS = {
    "tests/v1/core/test_x.py": b"import pytest\n\npytestmark = pytest.mark.cpu_test\n",
    "tests/v1/kv_connector/unit/utils.py": b"# helper\r\nX = 1\n",  # bytes kept as they are
}


def _sdist(folder: Path) -> Path:
    path = folder / "vllm-9.9.0.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in MEMBERS.items():
            info = tarfile.TarInfo(f"vllm-9.9.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _pin(sdist: Path, into: Path, *, sha256: str | None = None, extra: str = "") -> Pin:
    copies = [
        Copy("tests/v1/core/test_x.py", "test_x.py"),
        Copy("tests/v1/kv_connector/unit/utils.py", "kv_connector_unit_utils.py"),
    ]
    if extra:
        copies.append(Copy(extra, extra.rsplit("/", 1)[-1]))
    return Pin(
        series="9.9",
        sdist=sdist.as_uri(),
        sha256=sha256 or hashlib.sha256(sdist.read_bytes()).hexdigest(),
        into=into,
        copies=tuple(copies),
    )


def test_copies_are_byte_for_byte_idempotent_and_offline_once_cached(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path)
    into, cache = tmp_path / "v9_9", tmp_path / "cache"
    pin = _pin(sdist, into)
    assert missing_copies(pin) == [into / "test_x.py", into / "kv_connector_unit_utils.py"]

    assert fetch(pin, cache) == [into / "test_x.py", into / "kv_connector_unit_utils.py"]
    assert (into / "test_x.py").read_bytes() == MEMBERS["tests/v1/core/test_x.py"]
    assert (into / "kv_connector_unit_utils.py").read_bytes() == MEMBERS[
        "tests/v1/kv_connector/unit/utils.py"
    ]
    assert missing_copies(pin) == []

    sdist.unlink()  # the index is gone: the cached sdist serves
    assert fetch(pin, cache) == []
    (into / "test_x.py").write_bytes(b"edited\n")
    assert fetch(pin, cache) == [into / "test_x.py"]
    assert (into / "test_x.py").read_bytes() == MEMBERS["tests/v1/core/test_x.py"]


def test_a_download_of_another_hash_is_refused_and_not_cached(tmp_path: Path) -> None:
    into, cache = tmp_path / "v9_9", tmp_path / "cache"
    pin = _pin(_sdist(tmp_path), into, sha256="0" * 64)
    with pytest.raises(FetchError, match=r"sha256 \w+, but vllm-tests\.ini pins 0000"):
        fetch(pin, cache)
    assert list(cache.iterdir()) == []
    assert not into.exists()


def test_a_cached_sdist_of_another_hash_is_refused(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path)
    into, cache = tmp_path / "v9_9", tmp_path / "cache"
    cache.mkdir()
    (cache / sdist.name).write_bytes(b"not the sdist")
    with pytest.raises(FetchError, match="delete the file to download it again"):
        fetch(_pin(sdist, into), cache)
    assert not into.exists()


def test_a_member_missing_from_the_sdist_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    into = tmp_path / "v9_9"
    pin = _pin(_sdist(tmp_path), into, extra="tests/v1/core/test_gone.py")
    with pytest.raises(FetchError, match=r"has no file tests/v1/core/test_gone\.py"):
        fetch(pin, tmp_path / "cache")
    assert not into.exists()


def test_the_pins_name_a_kvguard_folder_per_series() -> None:
    pins = read_pins()
    assert set(pins) == {"0.33", "0.34"}
    for series, pin in pins.items():
        assert pin.into == ROOT / "tests/vllm/upstream" / f"v{series.replace('.', '_')}"
        assert (pin.into / "__init__.py").is_file()
        assert pin.top == f"vllm-{series}.0"
        assert len(pin.sha256) == 64
    renamed = [c for c in pins["0.34"].copies if c.member.endswith("kv_connector/unit/utils.py")]
    assert renamed == [Copy("tests/v1/kv_connector/unit/utils.py", "kv_connector_unit_utils.py")]


def test_an_unknown_series_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["0.1"]) == 2
    err = capsys.readouterr().err
    assert err == f"fetch_vllm_tests: error: no vLLM series '0.1' in {PINS} (it pins 0.33, 0.34)\n"
