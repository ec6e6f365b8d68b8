"""count_nonfinite_per_request: exact per-request counts, one launch, no host sync."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import importlib
import itertools

import torch

from kvguard.kernels import NonFiniteMode, count_nonfinite_per_request

from .cases import ALL_DTYPES, finite, on_device, seeded

NAN, INF = float("nan"), float("inf")

# The package re-exports the function under the module's name; fetch the module itself.
count_module = importlib.import_module("kvguard.kernels.count_nonfinite")


def _expected(logits: torch.Tensor, cu_rows: list[int], mode: NonFiniteMode) -> list[int]:
    """Independent oracle: a Python loop over rows and values."""
    values = logits.float().tolist()
    out = []
    for r in range(len(cu_rows) - 1):
        n = 0
        for row in values[cu_rows[r] : cu_rows[r + 1]]:
            for v in row:
                is_nan = v != v
                is_inf = v in (INF, -INF)
                n += is_nan or (mode is NonFiniteMode.NAN_OR_INF and is_inf)
        out.append(n)
    return out


def _count(
    logits: torch.Tensor, cu: list[int] | torch.Tensor, mode: object, backend: str, **kwargs: int
) -> list[int]:
    cu_rows = cu if isinstance(cu, torch.Tensor) else torch.tensor(cu)
    out = count_nonfinite_per_request(logits, cu_rows, mode, backend=backend, **kwargs)  # type: ignore[arg-type]
    assert out.dtype == torch.int32 and out.device == logits.device
    return out.tolist()


@ALL_DTYPES
@pytest.mark.parametrize("vocab", [1, 19, 989])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_clean_logits_count_zero(dtype: torch.dtype, vocab: int, backend: str) -> None:
    logits = finite((6, vocab), dtype, seed=21)
    for mode in NonFiniteMode:
        assert _count(logits, [0, 1, 3, 3, 6], mode, backend) == [0, 0, 0, 0]


@ALL_DTYPES
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dirty_logits_count_exactly(dtype: torch.dtype, backend: str) -> None:
    vocab = 19
    logits = finite((9, vocab), dtype, seed=22)
    # Speculative decoding: request 1 owns rows 1..4, request 2 none, request 4 rows 6..8.
    cu = [0, 1, 5, 5, 6, 9]
    logits[0, 0] = NAN
    logits[2, 18] = NAN
    logits[4, 3] = NAN
    logits[4, 4] = INF
    logits[5, 7] = -INF
    logits[7, :] = NAN  # a whole row
    logits[8, 11] = INF
    for mode in NonFiniteMode:
        want = _expected(logits, cu, mode)
        assert _count(logits, cu, mode, backend) == want
        assert _count(logits, cu, mode.value, backend) == want  # the value works too
    if dtype is not torch.float8_e4m3fn:  # e4m3fn has no Inf: torch saturates it
        assert _expected(logits, cu, NonFiniteMode.NAN) == [1, 2, 0, 0, vocab]
        assert _expected(logits, cu, NonFiniteMode.NAN_OR_INF) == [1, 3, 0, 1, vocab + 1]


def test_triton_matches_reference_on_random_layouts() -> None:
    g = seeded(23)
    for trial in range(4):
        rows, vocab = 1 + trial * 5, 37 + trial * 100
        logits = finite((rows, vocab), torch.float32, seed=trial)
        bad = torch.rand((rows, vocab), generator=g, device="cpu") < 0.05
        which = torch.randint(0, 3, (int(bad.sum()),), generator=g, device="cpu")
        logits[on_device(bad)] = on_device(torch.tensor([NAN, INF, -INF], device="cpu")[which])
        cuts = sorted(torch.randint(0, rows + 1, (trial + 2,), generator=g, device="cpu").tolist())
        cu = [0, *cuts, rows]
        for mode in NonFiniteMode:
            assert _count(logits, cu, mode, "triton", max_programs=2) == _expected(logits, cu, mode)
            assert _count(logits, cu, mode, "torch") == _expected(logits, cu, mode)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_logits(backend: str) -> None:
    wide = finite((5, 40), torch.float16, seed=24)
    wide[1, 31] = NAN  # outside the view: must not count
    wide[2, 4] = NAN  # an even column: skipped by the view
    strided = wide[:, 1:30:2]  # row stride 40, column stride 2
    transposed = finite((19, 4), torch.bfloat16, seed=25).t()  # column stride != 1
    transposed[3, 18] = NAN
    assert _count(strided, [0, 2, 5], "nan", backend) == [0, 0]
    wide[2, 5] = NAN  # column 5 -> view column 2
    assert _count(strided, [0, 2, 5], "nan", backend) == [0, 1]
    assert _count(transposed, [0, 3, 4], "nan", backend) == [0, 1]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_requests_and_no_rows(backend: str) -> None:
    logits = finite((3, 8), torch.float32, seed=26)
    assert _count(logits, [0], "nan", backend) == []
    empty = torch.empty((0, 8))
    assert _count(empty, [0, 0, 0], "nan", backend) == [0, 0]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_malformed_cu_rows_are_clamped_not_read_out_of_bounds(backend: str) -> None:
    logits = torch.full((4, 8), NAN)
    # Past the end, decreasing and negative bounds: clamped into [0, 4].
    assert _count(logits, [0, 2, 9], "nan", backend) == [16, 16]
    assert _count(logits, [3, 1, 2], "nan", backend) == [0, 8]
    assert _count(logits, [-5, 1], "nan", backend) == [8]


def test_int32_cu_rows() -> None:
    logits = finite((3, 5), torch.float32, seed=27)
    logits[2, 2] = NAN
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    assert _count(logits, cu, "nan", "triton") == [0, 1]


@pytest.mark.parametrize("max_programs", [1, 3, 64])
def test_columns_split_over_programs_add_up(
    max_programs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few requests, many programs: each request's columns are cut into ranges whose
    counts are added atomically. Narrow loads make 337 columns 22 chunks, so ranges end
    mid-row and the last one is partial."""
    monkeypatch.setattr(count_module, "COLUMNS_PER_LOAD", 16)
    g = seeded(31)
    logits = finite((7, 337), torch.float32, seed=31)
    bad = torch.rand((7, 337), generator=g, device="cpu") < 0.1
    logits[on_device(bad)] = NAN
    logits[on_device(torch.rand((7, 337), generator=g, device="cpu") < 0.05)] = -INF
    cu = [0, 3, 3, 4, 7]  # multi-row, empty, single-row, multi-row
    for mode in NonFiniteMode:
        want = _expected(logits, cu, mode)
        assert sum(want) > 0
        assert _count(logits, cu, mode, "triton", max_programs=max_programs) == want


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_synchronisation(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher never reads device values back (.item(), .tolist(), .cpu(), bool())."""
    logits = finite((4, 16), torch.float32, seed=28)
    cu_rows = torch.tensor([0, 1, 4])

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host synchronisation inside count_nonfinite_per_request")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, forbidden)
        out = count_nonfinite_per_request(logits, cu_rows, "nan", backend=backend)  # type: ignore[arg-type]
    assert out.tolist() == [0, 0]


def test_rejects_bad_inputs() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"\[num_rows, vocab\]"):
        count_nonfinite_per_request(torch.zeros(3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="not a supported float"):
        count_nonfinite_per_request(torch.zeros(3, 4, dtype=torch.int32), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="cu_rows"):
        count_nonfinite_per_request(logits, torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="cu_rows"):
        count_nonfinite_per_request(logits, torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="not a valid NonFiniteMode"):
        count_nonfinite_per_request(logits, torch.tensor([0, 3]), "inf")


def test_sum_rows_per_request_matches_a_loop_and_never_syncs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counts an engine took per row, summed per request (vLLM's ``num_nans`` under
    speculative decoding): multi-row, empty and single-row requests, rows past the last
    request (padding) ignored, malformed bounds clamped; no device value read back."""
    g = seeded(41)
    per_row = torch.randint(0, 5, (11,), generator=g, dtype=torch.int32)
    values = per_row.tolist()
    cases = [[0, 3, 3, 4, 9], [0, 11], [0], [0, 2, 99], [4, 1, 3]]
    want = [
        [sum(values[max(0, a) : min(max(a, b), 11)]) for a, b in itertools.pairwise(cu)]
        for cu in cases
    ]
    got = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("host synchronisation"))
        for cu in cases:
            got.append(
                count_module.sum_rows_per_request(on_device(per_row), on_device(torch.tensor(cu)))
            )
    assert [out.tolist() for out in got] == want
    assert all(out.dtype == torch.int32 for out in got)
    assert want[0] == [sum(values[0:3]), 0, values[3], sum(values[4:9])]
