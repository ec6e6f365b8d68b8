"""Mutation check of the transition kernel and its compiled twins (a developer tool).

Each mutation below changes one thing in ``kvguard/_speedups.c`` (the C twins of
``allocate``, ``acquire``, ``release_held`` and ``validate_held``, their eviction and
queue helpers and their decline paths) or in ``kvguard/transition_kernel.py`` (the
Python primitives). For each, in a temporary copy of the tree: apply it, rebuild the
extension, run the tests that must notice it, restore. (The copy is of the working tree:
tracked files and untracked ones git does not ignore.) A mutation is *caught* when a
test fails (or the run crashes or times out). The table at the end says which test
caught each one; a mutation that survives is a gap in the tests.

Which tests run:

* C mutations: ``tests/test_fast_path.py`` (and ``tests/test_fast_path_mutations.py``),
  the compiled pool against the pure-Python one;
* Python mutations: the pure-Python core suite (``KVGUARD_PURE_PYTHON=1``, without
  ``tests/kernels``, ``tests/vllm`` and ``tests/e2e``, and one timing-dependent CLI
  test) and, for a primitive with a C twin (or a helper of one), the fast-path tests
  too.

First, the unmutated copy must pass every suite, importing its own ``kvguard`` and its
own freshly built ``kvguard._speedups`` (checked); otherwise the check stops (exit 2).
Hypothesis runs without shrinking and with a fixed seed (``--seed``), so that a run is
repeatable and a caught mutation fails fast.

It is run by hand, not by CI: it takes minutes (about 10 on two cores). From the
repository root, with the development environment (a C compiler at hand)::

    python tools/mutation_check.py              # every mutation
    python tools/mutation_check.py C07 P03      # some of them
    python tools/mutation_check.py --list       # the mutations, nothing run

Exit status: 0 every mutation caught, 1 some survived, 2 the sanity run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
C_SOURCE = "kvguard/_speedups.c"
KERNEL = "kvguard/transition_kernel.py"
FAST_TESTS = ("tests/test_fast_path.py", "tests/test_fast_path_mutations.py")
CORE_IGNORES = ("tests/kernels", "tests/vllm", "tests/e2e")
# Timing-dependent (it interrupts a child process after a fixed sleep), and blind to the
# kernel: on a loaded machine it fails by itself.
CORE_DESELECT = ("tests/sim/test_cli.py::test_ctrl_c_stops_cleanly_and_says_so",)
PROFILE_MODULE = "_mutation_check_profile"
PROFILE = '''"""Hypothesis profile of tools/mutation_check.py (a pytest plugin)."""
from hypothesis import Phase, settings

settings.register_profile(
    "mutation_check",
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
    database=None,
)
'''
FAST = "fast"
CORE = "core"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One change: ``old`` (which must occur exactly once in ``file``) becomes ``new``."""

    id: str
    file: str
    description: str
    old: str
    new: str
    suites: tuple[str, ...]


def _c(mid: str, description: str, old: str, new: str) -> Mutation:
    return Mutation(mid, C_SOURCE, description, old, new, (FAST,))


def _py(mid: str, description: str, old: str, new: str, *, twin: bool) -> Mutation:
    """A Python mutation; ``twin``: in a primitive with a C twin (or a helper of one)."""
    return Mutation(mid, KERNEL, description, old, new, (CORE, FAST) if twin else (CORE,))


MUTATIONS: tuple[Mutation, ...] = (
    # -- allocate ----------------------------------------------------------------------
    _c(
        "C01",
        "allocate: wrong target state (write=True ALLOCATED, write=False WRITTEN)",
        "PyObject *state = write ? self->st_written_from_allocated : self->st_allocated;",
        "PyObject *state = write ? self->st_allocated : self->st_written_from_allocated;",
    ),
    _c(
        "C02",
        "allocate: ref_cnt not set to 1",
        "        set_field(block, self->off_ref_cnt, one);\n",
        "",
    ),
    _c(
        "C03",
        "allocate: held ignored (always a block-level reference)",
        "held ? one : zero",
        "one",
    ),
    _c(
        "C04",
        "allocate: generation not bumped",
        "failed = add_to_field(block, self->off_generation, generation, 1) < 0;",
        "failed = add_to_field(block, self->off_generation, generation, 0) < 0;",
    ),
    _c(
        "C05",
        "allocate(write=True): no writer recorded",
        "if (write && PyDict_SetItem(self->writers_map",
        "if (0 && PyDict_SetItem(self->writers_map",
    ),
    _c(
        "C06",
        "allocate: reused quarantined blocks not queued for zeroing (suspect)",
        "if (PyDict_SetItem(self->zero_blocks, PyList_GET_ITEM(ids, k), Py_None) < 0)",
        "if (0)",
    ),
    _c(
        "C07",
        "allocate: blocks_zeroed counter not bumped",
        "blocks_zeroed,\n                         num_quarantined) < 0)",
        "blocks_zeroed,\n                         0) < 0)",
    ),
    _c(
        "C08",
        "allocate: ids taken from a queue tail in queue order, not last-first",
        "PyObject *id_obj = PyList_GET_ITEM(from, len - 1 - k);",
        "PyObject *id_obj = PyList_GET_ITEM(from, len - count + k);",
    ),
    _c(
        "C09",
        "allocate: free queue size off by one",
        "add_to_field(self->free_queue, self->off_size, size, -n)",
        "add_to_field(self->free_queue, self->off_size, size, 1 - n)",
    ),
    _c(
        "C10",
        "allocate: one FREE block too few taken (evicts while FREE blocks remain)",
        "num_empty = n - num_quarantined;",
        "num_empty = n - num_quarantined - 1;",
    ),
    # -- eviction (inside allocate) ----------------------------------------------------
    _c(
        "C11",
        "evict: wrong eviction order (newest released first)",
        "PyObject_CallOneArg(popitem, Py_False)",
        "PyObject_CallOneArg(popitem, Py_True)",
    ),
    _c(
        "C12",
        "evict: hash not removed from the prefix index",
        "        if (PyDict_DelItem(self->index, block_hash) < 0)\n            goto error;\n",
        "",
    ),
    _c(
        "C13",
        "evict: no BlockRemoved event",
        "    if (events != Py_None) {\n        PyObject *event",
        "    if (0) {\n        PyObject *event",
    ),
    _c(
        "C14",
        "evict: blocks_evicted counter not bumped",
        "bump_field(self->counters, self->off_blocks_evicted, count)",
        "bump_field(self->counters, self->off_blocks_evicted, 0)",
    ),
    _c(
        "C15",
        "evict: parent hash kept",
        "        set_field(block, self->off_parent_hash, Py_None);\n        Py_INCREF(id_obj);",
        "        Py_INCREF(id_obj);",
    ),
    _c(
        "C16",
        "evict: num_evictable off by one",
        "bump_field(self->free_queue, self->off_num_evictable, -count)",
        "bump_field(self->free_queue, self->off_num_evictable, 1 - count)",
    ),
    # -- acquire -----------------------------------------------------------------------
    _c(
        "C17",
        "acquire: accepts a block in any state (a non-cached block acquired)",
        "if (block == NULL || !in_tuple(self->acquirable, FIELD(block, self->off_state)) ||",
        "if (block == NULL ||",
    ),
    _c(
        "C18",
        "acquire: ref_cnt not incremented",
        "if (add_to_field(block, self->off_ref_cnt, ref_cnt, 1) < 0 ||\n            (held &&",
        "if (add_to_field(block, self->off_ref_cnt, ref_cnt, 0) < 0 ||\n            (held &&",
    ),
    _c(
        "C19",
        "acquire: block-level reference taken when not held",
        "(held && add_to_field(block, self->off_external_refs, refs, 1) < 0)",
        "(add_to_field(block, self->off_external_refs, refs, 1) < 0)",
    ),
    _c(
        "C20",
        "acquire: skipped free-queue removal of an unreferenced hit",
        "        if (!ref_cnt) {\n            if (take_out_of_eviction",
        "        if (0) {\n            if (take_out_of_eviction",
    ),
    _c(
        "C21",
        "acquire: free queue size not decreased on removal",
        "bump_field(self->free_queue, self->off_size, -1)",
        "bump_field(self->free_queue, self->off_size, 0)",
    ),
    _c(
        "C22",
        "acquire: an emptied retention class not dropped",
        "    if (left == 0) {\n        PyObject *r",
        "    if (left < 0) {\n        PyObject *r",
    ),
    # -- release_held ------------------------------------------------------------------
    _c(
        "C23",
        "release: freed block gets wrong target state (ALLOCATED)",
        "set_field(block, self->off_state, self->st_free);",
        "set_field(block, self->off_state, self->st_allocated);",
    ),
    _c(
        "C24",
        "release: skipped free-queue push of a freed block",
        " ||\n                PyList_Append(self->empty, id_obj) < 0)",
        ")",
    ),
    _c(
        "C25",
        "release: free queue size off by one for freed blocks",
        "bump_field(self->free_queue, self->off_size, num_freed)",
        "bump_field(self->free_queue, self->off_size, num_freed - 1)",
    ),
    _c(
        "C26",
        "release: writer entry kept on a freed block",
        "if ((PyDict_GET_SIZE(self->writers_map) && forget(self->writers_map, id_obj) < 0) ||",
        "if ((0) ||",
    ),
    _c(
        "C27",
        "release: deferred publication kept on a freed block",
        "                (PyDict_GET_SIZE(self->pending_map) && forget(self->pending_map, id_obj)"
        " < 0) ||\n                PyList_Append",
        "                PyList_Append",
    ),
    _c(
        "C28",
        "release(steps_passed): block waiting for its publication freed (publication lost)",
        "(steps_passed && state == self->st_written && !deferred)",
        "(steps_passed && state == self->st_written)",
    ),
    _c(
        "C29",
        "release(steps_passed): block waiting for its publication quarantined",
        "else if ((!steps_passed && state == self->st_written) ||",
        "else if ((state == self->st_written) ||",
    ),
    _c(
        "C30",
        "release: unvalidated block gets wrong target state (FREE, not QUARANTINED)",
        "set_field(block, self->off_state, self->st_quarantined);",
        "set_field(block, self->off_state, self->st_free);",
    ),
    _c(
        "C31",
        "release: quarantine without a generation bump",
        "add_to_field(block, self->off_generation, generation, 1) < 0) {",
        "add_to_field(block, self->off_generation, generation, 0) < 0) {",
    ),
    _c(
        "C32",
        "release: blocks_quarantined counter not bumped",
        "(newly && bump_field(self->counters, self->off_blocks_quarantined, newly) < 0)",
        "(0)",
    ),
    _c(
        "C33",
        "release: writer entry kept on a quarantined block",
        "                if (forget(self->writers_map, id_obj) < 0)\n"
        "                    goto error;\n",
        "",
    ),
    _c(
        "C34",
        "release: skipped push of a quarantined block",
        "            if (PyList_Append(self->quarantined, id_obj) < 0)\n"
        "                goto error;\n",
        "",
    ),
    _c(
        "C35",
        "release: deferred publication kept on a quarantined block",
        "            if (PyDict_GET_SIZE(self->pending_map) && forget(self->pending_map, id_obj)"
        " < 0)\n                goto error;\n            if (FIELD(block",
        "            if (FIELD(block",
    ),
    _c(
        "C36",
        "release decline path: undo restores ref_cnt but not the block-level reference",
        "if (add_to_field(block, self->off_external_refs, refs, 1) < 0 ||\n"
        "                add_to_field(block, self->off_ref_cnt, ref_cnt, 1) < 0)",
        "if (add_to_field(block, self->off_external_refs, refs, 0) < 0 ||\n"
        "                add_to_field(block, self->off_ref_cnt, ref_cnt, 1) < 0)",
    ),
    _c(
        "C37",
        "release: cached blocks enqueued in retention class 0 (wrong eviction order)",
        "PyObject *retention = retention_of(self, FIELD(block, self->off_block_id));\n"
        "        if (retention == NULL)\n            goto error;",
        "PyObject *retention = self->zero_int;",
    ),
    _c(
        "C38",
        "release: off-by-one last-reference test (a still-held block enqueued)",
        "if (ref_cnt == 1) {",
        "if (ref_cnt <= 2) {",
    ),
    # -- validate_held -----------------------------------------------------------------
    _c(
        "C39",
        "validate: runs while events are recorded (missing BlockStored event)",
        "if (self->blocks == NULL || self->events != Py_None || !PyList_CheckExact(ids) ||",
        "if (self->blocks == NULL || !PyList_CheckExact(ids) ||",
    ),
    _c(
        "C40",
        "validate: a block with two writers in flight validated",
        "PyLong_AsLong(writers) != 1",
        "PyLong_AsLong(writers) < 1",
    ),
    _c(
        "C41",
        "validate drift: a publication whose hash is not bytes accepted",
        " ||\n             !PyBytes_CheckExact(PyTuple_GET_ITEM(pending, 0)))",
        ")",
    ),
    _c(
        "C42",
        "validate drift: a publication tuple longer than 3 accepted",
        "PyTuple_GET_SIZE(pending) != 3",
        "PyTuple_GET_SIZE(pending) < 3",
    ),
    _c(
        "C43",
        "validate: a publication chained on a tainted parent published",
        "            if (hit == 0)\n"
        "                hit = PySet_Contains(self->tainted, PyTuple_GET_ITEM(pending, 1));\n",
        "",
    ),
    _c(
        "C44",
        "validate: no taint check at all",
        "if (pending != Py_None && PySet_GET_SIZE(self->tainted)) {",
        "if (0) {",
    ),
    _c(
        "C45",
        "validate decline path: undo gives the writers back as 0",
        "PyDict_SetItem(self->writers_map, PyList_GET_ITEM(ids, k), self->one_int)",
        "PyDict_SetItem(self->writers_map, PyList_GET_ITEM(ids, k), self->zero_int)",
    ),
    _c(
        "C46",
        "validate: a block without publication stays WRITTEN (missing VALIDATE)",
        "set_field(block, self->off_state, self->st_validated); /* writers: gone above */",
        "/* mutated: no VALIDATE */",
    ),
    _c(
        "C47",
        "validate: wrong parent hash (the block's own hash)",
        "set_field(block, self->off_parent_hash, PyTuple_GET_ITEM(pending, 1));",
        "set_field(block, self->off_parent_hash, PyTuple_GET_ITEM(pending, 0));",
    ),
    _c(
        "C48",
        "validate: a duplicate hash published again (index entry overwritten)",
        "        if (known) {\n            Py_DECREF(pending);",
        "        if (0) {\n            Py_DECREF(pending);",
    ),
    _c(
        "C49",
        "validate: published block left VALIDATED (wrong target state)",
        "set_field(block, self->off_state, self->st_published);",
        "set_field(block, self->off_state, self->st_validated);",
    ),
    _c(
        "C50",
        "validate: missing index insert",
        "int failed = PyDict_SetItem(self->index, block_hash, id_obj) < 0 ||\n"
        "                     PyList_Append",
        "int failed = PyList_Append",
    ),
    _c(
        "C51",
        "validate: deferred_publications counter not bumped",
        "            held++;\n",
        "",
    ),
    _c(
        "C52",
        "validate: blocks_published counter off by one",
        "bump_field(self->counters, self->off_blocks_published, PyList_GET_SIZE(published))",
        "bump_field(self->counters, self->off_blocks_published, PyList_GET_SIZE(published) - 1)",
    ),
    _c(
        "C53",
        "validate: deferred publication kept after it happened",
        "        if (forget(self->pending_map, id_obj) < 0) {\n            Py_DECREF(pending);",
        "        if (0) {\n            Py_DECREF(pending);",
    ),
    _c(
        "C54",
        "validate: the call's own publication ignored (the deferred one used)",
        "            pending = PyDict_GetItemWithError(publish, id_obj);\n",
        "            pending = NULL;\n",
    ),
    # -- the Python primitives ---------------------------------------------------------
    _py(
        "P01",
        "allocate: generation not bumped",
        "            block.generation += 1\n        if write:",
        "        if write:",
        twin=True,
    ),
    _py(
        "P02",
        "allocate: reused quarantined blocks not queued for zeroing (suspect)",
        "            if num_quarantined and self._zero_suspect:",
        "            if num_quarantined and self._zero_suspect and False:",
        twin=True,
    ),
    _py(
        "P03",
        "acquire: skipped free-queue removal of an unreferenced hit",
        "            if not block.ref_cnt:\n                free.remove_evictable(block)\n",
        "",
        twin=True,
    ),
    _py(
        "P04",
        "release_held(steps_passed): block waiting for its publication freed",
        "steps_passed and state is _WRITTEN and block_id not in self.deferred",
        "steps_passed and state is _WRITTEN",
        twin=True,
    ),
    _py(
        "P05",
        "validate_held: a duplicate hash published again",
        "            if block_hash in index:\n                duplicates.append(block_id)",
        "            if block_hash in index and False:\n"
        "                duplicates.append(block_id)",
        twin=True,
    ),
    _py(
        "P06",
        "validate_held: no deferred publication for a block another step still writes",
        "                    self.deferred[block_id] = publish[block_id]\n",
        "                    pass\n",
        twin=True,
    ),
    _py(
        "P07",
        "_quarantine: generation not bumped",
        "        block.generation += 1\n        # Block-level steps",
        "        # Block-level steps",
        twin=False,
    ),
    _py(
        "P08",
        "chained_on_taint: a refused block's own hash not tainted",
        "                tainted.add(block_hash)\n",
        "                pass\n",
        twin=False,
    ),
    _py(
        "P09",
        "_evict: blocks_evicted counter not bumped",
        "        self.counters.blocks_evicted += len(block_ids)\n",
        "",
        twin=True,
    ),
    _py(
        "P10",
        "write_held: a second writer not counted",
        "writers[block.block_id] = writers.get(block.block_id, 0) + 1",
        "writers[block.block_id] = 1",
        twin=False,
    ),
    _py(
        "P11",
        "store_ack: a late acknowledgement (generation moved on) accepted",
        "            block.generation != generation\n            or block.block_hash",
        "            block.block_hash",
        twin=False,
    ),
    _py(
        "P12",
        "publish_chain: a hash the index holds published again",
        "if caching and block_hash not in index:",
        "if caching:",
        twin=False,
    ),
    _py(
        "P13",
        "_drop_last_refs: released WRITTEN block moved by the table, not quarantined",
        "            if state is _WRITTEN:\n                self._quarantine(block, _RELEASE)\n"
        "                free.push(block)\n                continue\n",
        "",
        twin=True,
    ),
)


@dataclasses.dataclass
class Outcome:
    caught: str  # "yes", "no" or "error" (the mutation could not be built or applied)
    by: str


class Workspace:
    """A copy of the tree, rebuilt and tested in place."""

    def __init__(self, path: Path, *, seed: int, builder: str) -> None:
        self.path = path
        self.seed = seed
        self.builder = builder
        self.originals: dict[str, str] = {}
        self.built: str | None = None  # the C source the extension was last built from
        self.timeouts = {FAST: 600.0, CORE: 1200.0}

    @classmethod
    def create(cls, parent: Path, *, seed: int, builder: str) -> Workspace:
        path = parent / "tree"
        for name in _tree_files():
            source = ROOT / name
            if source.is_file() and not source.is_symlink():  # (deleted, or a submodule)
                (path / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, path / name)
        (path / f"{PROFILE_MODULE}.py").write_text(PROFILE)
        workspace = cls(path, seed=seed, builder=builder)
        for name in (C_SOURCE, KERNEL):
            workspace.originals[name] = (path / name).read_text()
        return workspace

    def env(self, *, pure: bool) -> dict[str, str]:
        env = dict(os.environ)
        # The copy first: never the kvguard of an editable install of another tree.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.path), *filter(None, [env.get("PYTHONPATH")])]
        )
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("KVGUARD_PURE_PYTHON", None)
        if pure:
            env["KVGUARD_PURE_PYTHON"] = "1"
        return env

    def write(self, name: str, text: str) -> None:
        (self.path / name).write_text(text)

    def restore(self) -> None:
        for name, text in self.originals.items():
            self.write(name, text)

    def build(self) -> str | None:
        """Build the extension from the current C source (if not built from it yet);
        the compiler's complaint, or None."""
        source = (self.path / C_SOURCE).read_text()
        if source == self.built:
            return None
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = self.path / "kvguard" / f"_speedups{suffix}"
        target.unlink(missing_ok=True)
        if self.builder == "setuptools":
            command = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"]
        else:
            cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
            include = sysconfig.get_paths()["include"]
            command = [*cc, "-shared", "-fPIC", "-O1", "-I", include, C_SOURCE, "-o", str(target)]
        done = subprocess.run(
            command, cwd=self.path, capture_output=True, text=True, env=self.env(pure=False)
        )
        if done.returncode != 0 or not target.exists():
            self.built = None
            return (done.stdout + done.stderr).strip()[-2000:] or "no extension built"
        self.built = source
        return None

    def check_imports(self) -> str:
        """Where the tests' ``kvguard`` and ``kvguard._speedups`` come from (both must be
        the copy's)."""
        code = "import kvguard, kvguard._speedups as s; print(kvguard.__file__); print(s.__file__)"
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.path,
            capture_output=True,
            text=True,
            env=self.env(pure=False),
        )
        if done.returncode != 0:
            raise SystemExit(f"sanity: the copy does not import:\n{done.stderr}")
        for line in done.stdout.split():
            if not Path(line).resolve().is_relative_to(self.path.resolve()):
                raise SystemExit(f"sanity: the tests would import {line}, not the copy's")
        return done.stdout.strip()

    def command(self, suite: str) -> list[str]:
        pytest = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-p",
            PROFILE_MODULE,
            "--hypothesis-profile=mutation_check",
            f"--hypothesis-seed={self.seed}",
        ]
        if suite == FAST:
            return pytest + [name for name in FAST_TESTS if (self.path / name).exists()]
        return [
            *pytest,
            "tests",
            *[f"--ignore={name}" for name in CORE_IGNORES],
            *[f"--deselect={name}" for name in CORE_DESELECT],
        ]

    def run(self, suite: str) -> tuple[bool, str, float]:
        """Run one suite: (passed, what failed, seconds)."""
        start = time.monotonic()
        try:
            done = subprocess.run(
                self.command(suite),
                cwd=self.path,
                capture_output=True,
                text=True,
                env=self.env(pure=suite == CORE),
                timeout=self.timeouts[suite],
            )
        except subprocess.TimeoutExpired:
            limit = self.timeouts[suite]
            return False, f"timeout after {limit:.0f} s ({suite})", limit
        seconds = time.monotonic() - start
        if done.returncode == 0:
            return True, "", seconds
        return False, _failure(done.returncode, done.stdout + done.stderr), seconds


def _tree_files() -> list[str]:
    """The files of the working tree (tracked, and untracked ones git does not ignore):
    the tests read more than the package (benchmarks, docs, examples)."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [name for name in done.stdout.split("\0") if name and not name.endswith(".so")]


def _failure(returncode: int, output: str) -> str:
    """The first failed test of a pytest run, or how the run ended."""
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if match:
        return match.group(1)
    if returncode < 0:
        return f"crash (signal {-returncode})"
    tail = output.strip().splitlines()[-1:] or ["no output"]
    return f"exit {returncode}: {tail[0][:80]}"


def check(workspace: Workspace, mutation: Mutation) -> Outcome:
    original = workspace.originals[mutation.file]
    count = original.count(mutation.old)
    if count != 1:
        return Outcome("error", f"anchor found {count} times")
    workspace.write(mutation.file, original.replace(mutation.old, mutation.new))
    try:
        complaint = workspace.build()
        if complaint is not None:
            return Outcome("error", "build failed: " + complaint.splitlines()[-1][:80])
        for suite in mutation.suites:
            passed, failed, _ = workspace.run(suite)
            if not passed:
                return Outcome("yes", failed)
        return Outcome("no", "")
    finally:
        workspace.restore()


def table(rows: Sequence[tuple[Mutation, Outcome]]) -> str:
    lines = [
        f"| {'id':<4} | {'file':<28} | {'mutation':<80} | caught | by",
        f"|{'-' * 6}|{'-' * 30}|{'-' * 82}|--------|{'-' * 40}",
    ]
    for mutation, outcome in rows:
        lines.append(
            f"| {mutation.id:<4} | {mutation.file:<28} | {mutation.description:<80} | "
            f"{outcome.caught:<6} | {outcome.by}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("ids", nargs="*", help="mutation ids to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument(
        "--build",
        choices=["cc", "setuptools"],
        default="cc",
        help="build the extension with the C compiler directly (default) or setup.py",
    )
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.ids or m.id in args.ids]
    unknown = set(args.ids) - {m.id for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation ids: {sorted(unknown)}")
    if args.list:
        for mutation in selected:
            print(f"{mutation.id}  {mutation.file:<28}  {mutation.description}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvguard-mutation-") as parent:
        workspace = Workspace.create(Path(parent), seed=args.seed, builder=args.build)
        complaint = workspace.build()
        if complaint is not None:
            print(f"sanity: the unmutated extension does not build:\n{complaint}")
            return 2
        print("sanity: the tests import\n  " + workspace.check_imports().replace("\n", "\n  "))
        for suite in sorted({s for m in selected for s in m.suites}):
            passed, failed, seconds = workspace.run(suite)
            if not passed:
                print(f"sanity: the unmutated copy fails the {suite} suite: {failed}")
                return 2
            # A mutation that makes a suite hang is caught by the timeout.
            workspace.timeouts[suite] = 5 * seconds + 60
            print(f"sanity: {suite} suite passes unmutated ({seconds:.0f} s)", flush=True)
        rows: list[tuple[Mutation, Outcome]] = []
        for mutation in selected:
            outcome = check(workspace, mutation)
            rows.append((mutation, outcome))
            print(f"{mutation.id}: {outcome.caught} {outcome.by}", flush=True)
    print()
    print(table(rows))
    print()
    for name in (C_SOURCE, KERNEL):
        mine = [outcome for mutation, outcome in rows if mutation.file == name]
        if mine:
            caught = sum(outcome.caught == "yes" for outcome in mine)
            print(f"{name}: {caught}/{len(mine)} caught")
    survived = [m.id for m, outcome in rows if outcome.caught != "yes"]
    if survived:
        print("not caught: " + ", ".join(survived))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
