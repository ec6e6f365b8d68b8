"""The guard under vLLM's parallel layouts on the CPU engine: tensor parallelism (two
workers, each holding two of the model's four KV heads), pipeline parallelism (two
workers, one layer each) and data parallelism (two engine cores, each with its worker),
stock and guarded side by side.

TP and PP: the engine core runs in this process (its scheduler can be read), its two
workers in processes of their own that receive each step's ``SchedulerOutput``
through vLLM's broadcast queue (pickled). The NaN counts come from one worker (the
first of the last stage: the driver's sampler) while every worker writes KV, so
these tests read each worker's own KV tensors (``collective_rpc`` answers once per
rank). vLLM's CPU build binds each worker's OpenMP threads to a NUMA node of its own;
this machine has one, so the workers are bound by hand, one core each (``BIND``).

DP: vLLM's ``LLM`` refuses ``data_parallel_size > 1``; its async engine (what ``vllm
serve`` runs) starts one engine core process per rank, each with its own scheduler
and pool, and a test sends each request to the rank it names.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from kvguard.adapters.vllm.workers.audit import AUDIT_FIELD
    from kvguard.adapters.vllm.workers.slots import SLOTS_FIELD
    from kvguard.results import SlotRange

    from .conftest import guard_in_this_process, in_process, kvguard_log, shutdown
    from .engine import (
        ENGINE_KWARGS,
        Result,
        apply_env,
        engine_env,
        faults_fired,
        generate,
        output_to,
        restore_env,
        result,
        scan_kv_cache,
        scheduler,
        tokens,
        trigger,
        with_token,
    )
    from .server import server_env, serving, start

BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per worker. vLLM's default (``auto``) binds each worker to a NUMA node of
its own and refuses to start on a one-node machine: ``AssertionError: Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers``."""

LAYOUTS: dict[str, dict[str, int]] = {
    "tp": {"tensor_parallel_size": 2},
    "pp": {"pipeline_parallel_size": 2},
}

START_UP = re.compile(r"kvguard: guard in force \(.*\): workers checked: (?P<workers>\d+) OK;")


# ---------------------------------------------------------------- TP and PP


def _build(model_dir: str, layout: str, **kwargs: Any) -> Any:
    from vllm import LLM

    saved = apply_env(BIND)
    try:
        with in_process():
            llm = LLM(model=model_dir, **ENGINE_KWARGS, **LAYOUTS[layout], **kwargs)
    finally:
        restore_env(saved)
    try:
        llm.collective_rpc(_allocate_stage_input)
    except BaseException:
        shutdown(llm)  # (its worker processes)
        raise
    return llm


def _allocate_stage_input(worker: Any) -> bool:
    """In each worker: the buffer a later pipeline stage receives its input in, which
    vLLM's model runner allocates in its warm-up run -- and vllm-cpu 0.32 skips that
    run in eager mode, so without this stage 2 fails its first step (``assert
    self.intermediate_tensors is not None``), stock or guarded. What the warm-up does."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
    return True


START_UP_LOG: dict[tuple[str, str], list[Any]] = {}
"""What kvguard logged while each (layout, engine) was built."""


@pytest.fixture(scope="class", params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="class")
def stock(model_dir: str, reference: Any, layout: str) -> Iterator[Any]:
    with kvguard_log() as START_UP_LOG[layout, "stock"]:
        llm = _build(model_dir, layout)
    try:  # (its workers stopped however the fixture is left)
        assert type(scheduler(llm)).__name__ == "Scheduler"
        yield llm
    finally:
        shutdown(llm)


@pytest.fixture(scope="class")
def guarded(model_dir: str, reference: Any, layout: str, stock: Any) -> Iterator[Any]:
    with guard_in_this_process():
        with kvguard_log() as START_UP_LOG[layout, "guarded"]:
            llm = _build(model_dir, layout)
        try:
            assert type(scheduler(llm)).__name__ == "GuardedScheduler"
            yield llm
        finally:
            shutdown(llm)


def both(stock: Any, guarded: Any) -> list[tuple[str, Any]]:
    return [("stock", stock), ("guarded", guarded)]


def per_rank_non_finite(llm: Any) -> list[set[int]]:
    """Per worker (rank order): the blocks holding a non-finite value in its KV."""
    scans = llm.collective_rpc(scan_kv_cache, args=(None,))
    return [{b for b, (non_finite, _) in scan.items() if non_finite} for scan in scans]


def _step_start(runner: Any) -> str:
    """Where a step starts in the worker, its ``SchedulerOutput`` in hand: V1's CPU runner
    (0.32), or 0.34's standalone CPU runner (a V2 runner)."""
    return "_update_states" if hasattr(type(runner), "_update_states") else "update_requests"


def _record_fields(worker: Any) -> None:
    """In each worker: record what every step's ``SchedulerOutput`` carries for the
    workers -- vLLM's ``new_block_ids_to_zero`` and the attributes kvguard adds."""
    runner = worker.model_runner
    seen: list[dict[str, Any]] = []
    runner._kvguard_test_seen = seen
    stock_update = getattr(type(runner), _step_start(runner))

    def step_start(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(
            {
                "zero": list(scheduler_output.new_block_ids_to_zero or ()),
                "slots": getattr(scheduler_output, SLOTS_FIELD, None),
                "audit": getattr(scheduler_output, AUDIT_FIELD, None),
            }
        )
        return stock_update(runner, scheduler_output, *args, **kwargs)

    setattr(runner, _step_start(runner), step_start)


def _recorded(worker: Any) -> list[dict[str, Any]]:
    runner = worker.model_runner
    seen = list(runner.__dict__.pop("_kvguard_test_seen", []))
    runner.__dict__.pop(_step_start(runner), None)
    return seen


class TestTensorAndPipelineParallel:
    """Two workers behind one engine core (its engines are torn down with the class)."""

    def test_the_start_up_check_covers_both_workers(
        self, layout: str, stock: Any, guarded: Any
    ) -> None:
        """The engine core asks every worker whether the guard is in force there
        (``kvguard_report``) before it builds its scheduler: both ranks answer."""
        lines = [r.getMessage() for r in START_UP_LOG[layout, "guarded"]]
        starts = [m for m in map(START_UP.search, lines) if m]
        assert len(starts) == 1, lines
        assert starts[0]["workers"] == "2", lines
        assert not START_UP_LOG[layout, "stock"]
        for llm in (stock, guarded):
            assert len(llm.collective_rpc(scan_kv_cache, args=([0],))) == 2

    def test_nan_in_prefill_chunk_2_aborts_only_that_request(
        self, reference: Any, layout: str, stock: Any, guarded: Any
    ) -> None:
        """A's second prefill chunk computes NaN (in every worker: TP's ranks share the
        poisoned hidden state, PP's first stage sends it on); B (with A) and C (after A)
        share A's first 128 tokens. Stock delivers NaN-derived tokens; guarded ends A alone
        with "error", and B and C get the fault-free output."""
        a = with_token(tokens(201, 158), 90, trigger(0))
        b = a[:128] + tokens(202, 30)
        c = a[:128] + tokens(203, 30)
        ref_a, ref_b, ref_c = generate(reference, [a, b, c])
        out = {}
        for name, llm in both(stock, guarded):
            a_out, b_out = generate(llm, [a, b])
            (c_out,) = generate(llm, [c])
            assert (90, trigger(0)) in faults_fired(llm), name
            out[name] = (a_out, b_out, c_out)

        a_out, b_out, c_out = out["stock"]
        assert a_out.finish_reason == "length" and a_out.token_ids != ref_a.token_ids
        assert c_out.num_cached_tokens == 128 and c_out.token_ids != ref_c.token_ids

        a_out, b_out, c_out = out["guarded"]
        assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
        assert b_out == Result(ref_b.token_ids, "length", 64)  # A's validated chunk 1
        assert c_out == Result(ref_c.token_ids, "length", 128)  # B's recomputed blocks

    def test_every_rank_zeroes_the_quarantined_blocks_before_reuse(
        self, reference: Any, layout: str, stock: Any, guarded: Any
    ) -> None:
        """A fails in chunk 2 (NaN from position 70): both workers hold NaN in their share
        of A's chunk-2 blocks -- under TP both blocks in each rank (their heads), under PP
        the first stage only the block of position 70 (its layer reads the embeddings),
        the second both (its layer reads attention over the NaN row). R then needs four
        new blocks. Guarded: kvguard reuses the quarantined blocks first, every worker
        gets them in ``new_block_ids_to_zero`` and zeroes its share, so no rank holds a
        non-finite value anywhere afterwards. Stock: A's NaN blocks stay cached."""
        a = with_token(tokens(220, 126), 70, trigger(0))
        r = tokens(221, 120)
        (ref_r,) = generate(reference, [r], max_tokens=4)
        for name, llm in both(stock, guarded):
            before = per_rank_non_finite(llm)
            (a_out,) = generate(llm, [a], max_tokens=1)
            poisoned = [
                now - old for now, old in zip(per_rank_non_finite(llm), before, strict=True)
            ]
            assert len(poisoned) == 2 and all(poisoned), (name, poisoned)
            assert len(poisoned[0] | poisoned[1]) == 2, (name, poisoned)  # A's chunk 2
            if layout == "tp":
                assert poisoned[0] == poisoned[1], poisoned
            llm.collective_rpc(_record_fields)
            (r_out,) = generate(llm, [r], max_tokens=4)
            seen = llm.collective_rpc(_recorded)
            assert r_out.token_ids == ref_r.token_ids, name
            left = per_rank_non_finite(llm)
            if name == "stock":
                assert a_out.finish_reason == "length"
                assert all(p & rank_left for p, rank_left in zip(poisoned, left, strict=True))
                continue
            assert a_out.finish_reason == "error"
            assert left == [set(), set()], left
            assert seen[0] == seen[1]  # every rank gets the same steps
            zeroed = {b for step in seen[0] for b in step["zero"]}
            assert poisoned[0] | poisoned[1] <= zeroed, (poisoned, seen[0])

    def test_kvguard_step_attributes_reach_every_worker(self, layout: str, guarded: Any) -> None:
        """kvguard's own ``SchedulerOutput`` attributes (the slots ``recover()`` rolled
        back, the blocks the KV audit scans) are not fields of vLLM's dataclass: they
        reach the workers only if vLLM's transport keeps them. Its broadcast queue
        pickles the object whole, so every rank sees them. (The scheduler's state is set
        by hand here: the audit is refused under TP and PP, and a recovery needs a fault.)"""
        sched = scheduler(guarded)
        slots = [SlotRange(3, 0, 5)]  # vLLM's CPU caches are rewritten, not wiped: harmless
        guarded.collective_rpc(_record_fields)
        sched._kvguard_slots = list(slots)
        sched._kvguard_audit = True
        try:
            (out,) = generate(guarded, [tokens(230, 70)], max_tokens=2)
        finally:
            sched._kvguard_audit = False
        seen = guarded.collective_rpc(_recorded)
        assert out.finish_reason == "length"
        assert len(seen) == 2
        for rank_seen in seen:
            assert rank_seen[0]["slots"] == slots, rank_seen
            audited = [step["audit"] for step in rank_seen if step["audit"]]
            assert audited and all(isinstance(a, dict) for a in audited), rank_seen
        assert seen[0] == seen[1]

    def test_the_kv_audit_is_refused_under_tp(
        self, model_dir: str, layout: str, guarded: Any, tmp_path: Path
    ) -> None:
        """Each worker audits only its share of the KV and vLLM returns one worker's
        counts: the engine refuses the audit at start-up rather than run it half-blind.
        (Multiprocess, as deployed: the engine core's error is in its log. The same
        check refuses PP: ``tests/vllm/test_parallel_layouts.py``.)"""
        from vllm import LLM

        if layout != "tp":
            pytest.skip("one engine start shows it; the check is the same for PP")
        log = tmp_path / "engine-core.log"
        saved = apply_env({**engine_env(True), **BIND, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        try:
            with output_to(log), pytest.raises(RuntimeError, match="initialization failed"):
                LLM(
                    model=model_dir,
                    **ENGINE_KWARGS,
                    **LAYOUTS[layout],
                    additional_config={"kvguard": {"audit": True}},
                )
        finally:
            restore_env(saved)
        text = log.read_text(errors="replace")
        refusal = re.search(r"GuardModeUnsupported: kvguard's KV audit .*", text)
        assert refusal, text[-3000:]
        assert "(tensor_parallel_size=2)" in refusal[0], refusal[0]


# ---------------------------------------------------------------- DP


DP_LOG: dict[str, Path] = {}
"""What each DP engine's processes write (this process's fds 1 and 2 while it was built)."""
DP_PROCESS = re.compile(r"^\((?P<process>EngineCore\S*) pid=(?P<pid>\d+)\) ")


class DPEngine:
    """vLLM's async engine with two data-parallel engine cores, driven from a loop of
    its own."""

    def __init__(self, model_dir: str, guard: bool, log: Path) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        env = {**engine_env(guard), **BIND}
        saved = apply_env(env)
        try:
            with output_to(log):
                args = AsyncEngineArgs(model=model_dir, data_parallel_size=2, **ENGINE_KWARGS)
                self.llm = AsyncLLM.from_engine_args(args)
        finally:
            restore_env(saved)
        self.count = 0

    def generate(self, prompts: Sequence[tuple[Sequence[int], int]]) -> list[Result]:
        """Each (prompt, data-parallel rank), submitted together; greedy, 8 tokens."""
        return self.loop.run_until_complete(self._together(prompts))

    async def _together(self, prompts: Sequence[tuple[Sequence[int], int]]) -> list[Result]:
        return list(await asyncio.gather(*(self._one(p, rank) for p, rank in prompts)))

    async def _one(self, prompt: Sequence[int], rank: int) -> Result:
        from vllm import SamplingParams, TokensPrompt

        self.count += 1
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = [
            out
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=list(prompt)),
                params,
                f"dp-{self.count}",
                data_parallel_rank=rank,
            )
        ]
        return result(outputs[-1])

    def non_finite(self) -> list[set[int]]:
        """Per engine core (rank order): the blocks of its worker's KV holding a
        non-finite value."""
        per_engine = self.loop.run_until_complete(
            self.llm.engine_core.call_utility_all_async(
                "collective_rpc", scan_kv_cache, None, (None,), None
            )
        )
        return [{b for b, (n, _) in scan.items() if n} for (scan,) in per_engine]

    def faults_fired(self) -> list[list[tuple[int, int]]]:
        """Per engine core: (position, trigger) of every fault its worker's model fired."""
        per_engine = self.loop.run_until_complete(
            self.llm.engine_core.call_utility_all_async(
                "collective_rpc", _fired_in_worker, None, (), None
            )
        )
        return [[tuple(f) for f in fired] for (fired,) in per_engine]  # (msgpack: lists)

    def close(self) -> None:
        """Shut the engine down from inside its loop (vLLM closes its sockets and
        cancels its tasks there), let its tasks finish, close the loop, and the
        client's ZMQ context."""

        async def shutdown() -> None:
            self.llm.shutdown()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.loop.run_until_complete(shutdown())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
        # vLLM's async client closes its sockets but never its ZMQ context.
        self.llm.engine_core.resources.ctx.destroy(linger=0)


def _fired_in_worker(worker: Any) -> list[tuple[int, int]]:
    return list(worker.model_runner.model.fired)


@pytest.fixture(scope="class")
def dp(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, DPEngine]]:
    logs = tmp_path_factory.mktemp("dp-logs")
    DP_LOG.update(stock=logs / "stock.log", guarded=logs / "guarded.log")
    built: dict[str, DPEngine] = {}
    try:
        for name in ("stock", "guarded"):
            built[name] = DPEngine(model_dir, name == "guarded", DP_LOG[name])
        yield built
    finally:
        for engine in built.values():
            engine.close()


def _dp_lines(name: str, needle: str) -> list[str]:
    with open(DP_LOG[name], errors="replace") as f:
        return [line.rstrip("\n") for line in f if needle in line]


class TestDataParallel:
    """Two engine cores (torn down with the class)."""

    def test_dp_each_engine_core_checks_its_worker_and_runs_its_own_guard(
        self,
        dp: dict[str, DPEngine],
    ) -> None:
        """One start-up line per engine core, from two processes: each checked its one
        worker and built its own guarded scheduler. Stock logs no kvguard line."""
        lines = _dp_lines("guarded", "kvguard: guard in force")
        found = [(DP_PROCESS.match(line), START_UP.search(line)) for line in lines]
        assert all(process and start for process, start in found), lines
        processes = sorted((p["process"], p["pid"]) for p, _ in found if p)
        assert [name for name, _ in processes] == ["EngineCore_DP0", "EngineCore_DP1"], lines
        assert len({pid for _, pid in processes}) == 2, lines
        assert [s["workers"] for _, s in found if s] == ["1", "1"], lines
        assert not _dp_lines("stock", "kvguard:")

    def test_dp_nan_on_one_rank_aborts_only_that_request(
        self, reference: Any, dp: dict[str, DPEngine]
    ) -> None:
        """A (NaN in its chunk 2) runs on rank 0, B (A's first 64 tokens) on rank 1 at
        the same time, C (A's first 128) on rank 0 after A. Rank 1's pool never saw A:
        B computes everything. Guarded: A alone fails; C hits only A's validated chunk 1
        on rank 0, and the blocks rank 0 quarantined are zeroed once R reuses them."""
        a = with_token(tokens(240, 158), 90, trigger(0))
        b = a[:64] + tokens(241, 94)  # (A's trigger would fire again in rank 1's model)
        c = a[:128] + tokens(242, 30)
        r = tokens(243, 120)
        ref_a, ref_b, ref_c, ref_r = generate(reference, [a, b, c, r])
        out = {}
        for name, engine in dp.items():
            a_out, b_out = engine.generate([(a, 0), (b, 1)])
            (c_out,) = engine.generate([(c, 0)])
            fired = engine.faults_fired()
            assert (90, trigger(0)) in fired[0] and not fired[1], (name, fired)
            out[name] = (a_out, b_out, c_out)
            poisoned = engine.non_finite()
            (r_out,) = engine.generate([(r, 0)])
            assert r_out.token_ids == ref_r.token_ids[: len(r_out.token_ids)]
            left = engine.non_finite()
            assert not poisoned[1] and not left[1], (name, poisoned, left)
            if name == "stock":
                assert poisoned[0] & left[0], (poisoned, left)
            else:
                assert left[0] == set(), (poisoned, left)

        a_out, b_out, c_out = out["stock"]
        assert a_out.finish_reason == "length" and a_out.token_ids != ref_a.token_ids
        assert b_out == Result(ref_b.token_ids, "length", 0)
        assert c_out.num_cached_tokens == 128 and c_out.token_ids != ref_c.token_ids

        a_out, b_out, c_out = out["guarded"]
        assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
        assert b_out == Result(ref_b.token_ids, "length", 0)
        assert c_out == Result(ref_c.token_ids, "length", 64)
        aborts = _dp_lines("guarded", "kvguard: aborted request")
        assert len(aborts) == 1 and aborts[0].startswith("(EngineCore_DP0 "), aborts


class TestServeDataParallel:
    """``vllm serve --data-parallel-size 2``, guarded: the API server's ``/metrics``
    carries kvguard's counters once per engine core."""

    def test_metrics_show_one_sample_per_engine_core(
        self, model_dir: str, reference: Any, tmp_path: Path
    ) -> None:
        log = str(tmp_path / "serve.log")
        dp = ["--data-parallel-size", "2"]
        with serving(lambda: start("guarded-dp", model_dir, log, server_env(True), extra=dp)) as (
            server,
        ):
            for seed in range(4):
                status, _ = server.complete(tokens(250 + seed, 40), max_tokens=4)
                assert status == 200
            with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
                metrics = response.read().decode()
            starts = server.log_lines("kvguard: guard in force")
        samples = re.findall(
            r'^kvguard:steps_validated_total\{engine="(\d)"\} (\S+)$', metrics, re.M
        )
        assert sorted(engine for engine, _ in samples) == ["0", "1"], metrics
        assert sum(float(value) for _, value in samples) > 0, samples
        processes = sorted(m["process"] for m in map(DP_PROCESS.match, starts) if m)
        assert processes == ["EngineCore_DP0", "EngineCore_DP1"], starts
