"""Kill -9 soak: saves killed at random moments, and after every kill the latest checkpoint is proven whole.

    python tests/helpers/soak.py [--trials 200] [--configs local-sync,local-async,mpi-sync,...]
                                 [--clients 4] [--saves 4] [--seed S] [--dir D] [--json]

Each *config* is a launcher (``local``: one process; ``torch``: ``torchrun --standalone``
with ``--clients`` processes over gloo; ``mpi``: ``mpiexec -n --clients``; ``s3``: one process
saving to a folder on an S3-protocol server, moto's, started by the driver, with ``stale_after`` 0
since one writer at a time means every upload it did not commit is a dead save's) and a mode
(``sync`` / ``async`` saves; ``disagree``: sync saves, every third first tried with one
client disagreeing on a tensor's shape, which must fail everywhere and commit nothing; ``skip``:
sync saves numbered by generation, every third skipped by one client, which goes on to the next:
both saves must fail everywhere, commit nothing, and the clients then save on together;
``tiered``: sync saves through a manager with a local tier of two simulated nodes, every third
also persistent, where a kill of one client may take its whole node).
Every config has a directory of its own. A *trial* runs tests/helpers/soak_worker.py once:
it resumes through ``CheckpointManager.restore_or_initialize`` from ``latest_checkpoint``
(checking every restored value on every client), then saves ``--saves`` generations with
``max_to_keep=2``. Every config first runs once to its end, which times its saves; in each
trial, at a random moment between READY and a bit past the run's expected length (learnt from
the runs that ended by themselves) the driver SIGKILLs the local process, one random
client, or the whole job (launcher and clients, as a lost node). After every trial, with no
process of the job left, it checks the directory:

* **latest**: ``latest_checkpoint`` names a checkpoint once any save was reported committed,
  and never one older than the newest reported (``COMMITTED G`` lines); it holds generation
  ``N`` (``ckpt-N``) bit-exactly in every value, every entry's CRC32C verifies, and so does every
  checkpoint the state file lists. Anything else counts as *corrupt* or *missing*;
* **leftovers**: what dead saves left (temporary folders, ``.tempstate`` files, data files no
  index uses, checkpoints the state file does not name, among them an old checkpoint whose
  retention deletion a kill cut short, and ``.deleting`` markers) is recorded; once a later trial of the
  config has committed a save, every one of them must be gone (else *not cleaned*);
* **tiered**: the resume never restores a generation older than a save that returned (a
  ``COMMITTED`` or ``LOCAL`` line), else *missing*; at the end every file in the tier folders
  belongs to a committed bundle (else *leaked bytes*);
* **hangs**: a job with one killed client must end by itself within the coordination
  timeout plus a margin (else a *hang*; the job is then killed). Clients still alive after
  their launcher ended are counted (*orphans*) and killed before the checks, which always
  run with no process of the job left. The job is the launcher's process tree and every
  client that announced its pid, not its session: torchrun starts each client in a session
  of its own, and a client outlives a SIGKILLed torchrun.

At the end every config runs once to completion (no kill); then its directory must hold
exactly the state file and the two kept checkpoints: *leaked bytes* counts everything else.
The summary (per config and total) is printed; the exit status is 0 only when corrupt,
missing, not cleaned, hangs and leaked bytes are all 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "soak_worker.py"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import soak_worker  # noqa: E402  (tests/helpers)
from launchers import clean_env, tool  # noqa: E402

ALL_CONFIGS = ("local-sync", "local-async", "mpi-sync", "mpi-async", "torch-sync", "torch-async", "mpi-disagree",
               "torch-disagree", "mpi-skip", "torch-skip", "s3-sync", "s3-async", "mpi-tiered", "torch-tiered")
START_LIMIT = 180.0  # seconds for a job to reach READY (torch imports on a busy machine)
HANG_LIMIT = soak_worker.TIMEOUT + 60.0  # a job with a dead client must end by itself within this
FIRST_WINDOW = {"local": 0.5, "mpi": 2.0, "torch": 2.0, "s3": 2.0}  # seconds, before any save was timed
_PREFIX = re.compile(r"ckpt-(\d+)")


@dataclass
class ConfigStats:
    """Counts of one config (see the module docstring for what each means)."""

    trials: int = 0
    killed_whole_job: int = 0
    killed_one_client: int = 0
    killed_one_node: int = 0  # tiered: every client of one simulated node (counted in killed_one_client too)
    finished_before_kill: int = 0
    commits_reported: int = 0
    refused: int = 0  # disagreeing saves that failed on every client, as they must
    kills_after_a_commit: int = 0  # the trial had reported at least one commit when it was killed
    latest_advanced_unreported: int = 0  # latest is newer than the last COMMITTED line (killed after the commit)
    leftovers_seen: int = 0
    corrupt: int = 0
    missing_latest: int = 0
    not_cleaned: int = 0
    hangs: int = 0
    survivors_killed: int = 0  # clients still alive after their launcher ended (killed before the checks)
    leaked_bytes: int = 0
    generations: int = 0  # the newest generation reached
    seconds: float = 0.0
    failures: List[str] = field(default_factory=list)


def _command(launcher: str, clients: int, directory: str, mode: str, saves: int) -> List[str]:
    args = [str(WORKER), directory, mode, str(saves)]
    if launcher in ("local", "s3"):
        return [sys.executable] + args
    if launcher == "torch":
        return [str(tool("torchrun")), "--standalone", f"--nproc-per-node={clients}"] + args
    if launcher == "mpi":
        return [str(tool("mpiexec")), "--allow-run-as-root", "--oversubscribe", "-n", str(clients),
                sys.executable] + args
    raise ValueError(f"unknown launcher {launcher!r}")


def _processes() -> Dict[int, Tuple[int, int, str, bytes]]:
    """Every live process: pid -> (parent pid, session id, start time, command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), int(fields[3]), fields[19], cmdline)
    return found


class _Job:
    """A launched run, its own process group, its stdout lines with arrival times."""

    def __init__(self, cmd: List[str], env: Optional[Dict[str, str]] = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**clean_env(), **(env or {})}, cwd=str(HERE.parent.parent),
                                     start_new_session=True)
        self.lines: List[Tuple[float, str]] = []
        self.survivors = 0
        self._known: Dict[int, str] = {}  # every process of the job seen so far: pid -> its start time
        self._killed: Set[int] = set()  # those this driver sent a SIGKILL
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, word: str, limit: float) -> Optional[float]:
        """Arrival time of the first line starting with ``word`` (None: the job ended or ``limit`` passed)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if line.startswith(word):
                    return t
            if self.proc.poll() is not None and not self._reader.is_alive():
                return None
            time.sleep(0.005)
        return None

    def pids(self) -> Dict[int, int]:
        return {int(m.group(1)): int(m.group(2)) for _, line in list(self.lines)
                if (m := re.match(r"PID (\d+) (\d+)$", line))}

    def committed(self) -> List[int]:
        return [int(line.split()[1]) for _, line in list(self.lines) if line.startswith("COMMITTED ")]

    def members(self) -> List[int]:
        """Live processes of the job that run the soak worker or a launcher of it.

        The job is the launcher, its descendants and the clients that announced their pids.
        Its session is not enough: torchrun starts every client in a session of its own, and a
        client outlives a SIGKILLed torchrun. So the tree is walked while the launcher lives, and
        every process seen is remembered with its start time: an orphan reparented elsewhere is
        still found, and a reused pid is not taken for one.
        """
        table = _processes()
        announced = set(self.pids().values())
        tree, frontier = {self.proc.pid}, [self.proc.pid]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, (ppid, _, _, _) in table.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier += children
        for pid, (_, session, started, cmdline) in table.items():
            if pid in self._known and self._known[pid] != started:
                continue  # the pid was reused by another process
            if WORKER.name.encode() not in cmdline:
                continue
            if pid in tree or pid in announced or pid in self._known or session == self.proc.pid:
                self._known[pid] = started
        return [pid for pid in self._known if pid in table and table[pid][2] == self._known[pid]]

    def kill_all(self) -> int:
        """SIGKILL every process of the job (the launcher and all clients); return how many of them
        were alive and not yet sent a SIGKILL by this driver."""
        fresh = 0
        for pid in self.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            fresh += pid not in self._killed
            self._killed.add(pid)
        return fresh

    def kill_client(self, pid: int) -> None:
        """SIGKILL one client of the job."""
        self.members()  # the tree, seen while the launcher lives
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self._killed.add(pid)

    def end(self, limit: float) -> bool:
        """Wait up to ``limit`` s for the job to end by itself; True if it did. Nothing of it is left after."""
        try:
            self.proc.wait(timeout=limit)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
        self.kill_all()  # the launcher if it hung, with its clients
        self.proc.wait()
        self.survivors = self.kill_all()  # clients a launcher that ended left behind
        deadline = time.monotonic() + 30
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.01)  # SIGKILLed: gone in a moment
        self._reader.join(timeout=10)
        return ended

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])


# -- what is on disk ----------------------------------------------------------------------

def check_checkpoint(prefix: str, mode: str = "sync") -> Optional[str]:
    """None when ``prefix`` (``.../ckpt-N``) holds generation ``N`` exactly, every entry verified; else why not.

    ``mode`` ``skip``: ``N`` must not be a generation a client skipped, and ``save_counter`` counts the others.
    """
    import shardckpt

    m = _PREFIX.fullmatch(os.path.basename(prefix))
    if m is None:
        return f"unexpected checkpoint name {prefix}"
    generation = int(m.group(1))
    if soak_worker.skipped(generation, mode):
        return f"{prefix}: generation {generation}, whose save a client skipped, was committed"
    want = soak_worker.values(generation)
    try:
        with shardckpt.load_checkpoint(prefix) as reader:
            keys = {k.decode() for k in reader.bundle.keys()}
            expected = {soak_worker.checkpoint_key(n) for n in want}
            expected |= {"save_counter/.ATTRIBUTES/VARIABLE_VALUE", "_CHECKPOINTABLE_OBJECT_GRAPH"}
            if keys != expected:
                return f"{prefix}: keys {sorted(keys ^ expected)} differ"
            for key in sorted(keys):
                reader.bundle.verify(key)
            if int(reader.get_tensor("save_counter/.ATTRIBUTES/VARIABLE_VALUE")) != \
                    soak_worker.save_counter_of(generation, mode):
                return f"{prefix}: save_counter is not generation {generation}'s"
            for name, value in want.items():
                got = reader.get_tensor(soak_worker.checkpoint_key(name))
                if value.dtype == object:
                    same = [bytes(x) for x in got.ravel()] == [bytes(x) for x in value.ravel()]
                else:
                    same = got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)
                if not same:
                    return f"{prefix}: {name} is not generation {generation}'s value"
    except Exception as exc:  # any failure to read it whole is a broken checkpoint
        return f"{prefix}: {type(exc).__name__}: {exc}"
    return None


def _files_of(prefix: str) -> Set[str]:
    """Names of the index and the data files the index at ``prefix`` uses."""
    from shardckpt.format.merge import read_index_header
    from shardckpt.storage import get_fs

    fs = get_fs(prefix)
    base = fs.basename(prefix)
    n = int(read_index_header(prefix, fs).num_shards)
    return {f"{base}.index"} | {f"{base}.data-{i:05d}-of-{n:05d}" for i in range(n)}


def _listing(directory: str) -> Dict[Tuple[str, object, object], Tuple[str, int]]:
    """Everything in a config's directory: identity -> (name, bytes). A local entry's identity is
    (name, inode, mtime); an object's (name, ETag, mtime): a name written again is another leftover."""
    if "://" in directory:  # an object store
        from shardckpt.storage import get_fs

        details = get_fs(directory).list_details(directory)  # type: ignore[attr-defined]
        return {(name, str(info.get("etag")), info.get("mtime")): (name, int(info.get("size") or 0))
                for name, info in details.items()}
    found: Dict[Tuple[str, object, object], Tuple[str, int]] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        else:
            size = os.path.getsize(path)
        st = os.stat(path)
        found[(name, st.st_ino, st.st_mtime_ns)] = (name, size)
    return found


def inspect_directory(directory: str) -> Tuple[Optional[str], List[str], Dict[Tuple[str, object, object], int]]:
    """(latest, kept checkpoints, leftovers: identity -> bytes) of a config's directory (a local folder, or
    an ``s3://`` one).

    Raises whatever reading the state file raises (a broken state file is a failure).
    """
    import shardckpt
    from shardckpt.storage import get_fs

    state = shardckpt.get_checkpoint_state(directory)
    latest = shardckpt.latest_checkpoint(directory)
    kept = list(state.all_model_checkpoint_paths) if state is not None else []
    wanted = {"checkpoint"}
    for prefix in kept:
        if get_fs(prefix).exists(prefix + ".index"):
            wanted |= _files_of(prefix)
    return latest, kept, {identity: size for identity, (name, size) in _listing(directory).items()
                          if name not in wanted}


def tier_leftovers(directory: str) -> Dict[Tuple[str, object, object], int]:
    """tiered: every file in the simulated nodes' tier folders that no committed bundle (marker present,
    every file it names whole) holds: identity -> bytes."""
    from shardckpt.tiers.tier import read_marker

    root = soak_worker.tier_folder(directory).replace("/{node}", "")
    found: Dict[Tuple[str, object, object], int] = {}
    for path in Path(root).rglob("*") if os.path.isdir(root) else []:
        if not path.is_file():
            continue
        m = re.fullmatch(r"(ckpt-\d+)(\.index|\.data-\d+-of-\d+|\.committed)", path.name)
        marker = read_marker(str(path.parent / m.group(1))) if m else None
        if marker is None or path.name not in {str(n) for n, _ in marker["files"]} | {m.group(1) + ".committed"}:
            st = path.stat()
            found[(str(path.relative_to(root)), st.st_ino, st.st_mtime_ns)] = st.st_size
    return found


# -- one config ---------------------------------------------------------------------------

class ConfigSoak:
    """Trials of one config in its own directory."""

    def __init__(self, name: str, root: str, clients: int, saves: int, rng: random.Random,
                 log: bool = False, s3_root: Optional[str] = None) -> None:
        self.name = name
        self.log = log
        self.launcher, self.mode = name.split("-")
        self.clients = clients
        self.saves = saves
        self.rng = rng
        self.env: Dict[str, str] = {}
        if self.launcher == "s3":  # a folder on the S3 server the environment points at (AWS_ENDPOINT_URL)
            if s3_root is None:
                raise ValueError(f"config {name} needs an S3 folder (s3_root)")
            self.directory = f"{s3_root.rstrip('/')}/{name}"
            self.env = {"SHARDCKPT_SOAK_STALE_AFTER": "0"}  # one writer at a time: every dead upload is stale
        else:
            self.directory = os.path.join(root, name)
            os.makedirs(self.directory, exist_ok=True)
        self.stats = ConfigStats()
        self.window = FIRST_WINDOW[self.launcher]  # until a run shows how long its saves take
        self.windows: List[float] = []  # extrapolated from killed runs
        self.whole_windows: List[float] = []  # measured on runs that ended by themselves
        self.newest_reported = 0  # the newest generation any run reported committed
        self.newest_returned = 0  # tiered: the newest generation whose save returned (tiers or persistent)
        self.pending_leftovers: Dict[Tuple[str, object, object], int] = {}

    def _fail(self, what: str) -> None:
        self.stats.failures.append(what)
        if self.log:
            print(f"FAIL {self.name}: {what}", flush=True)

    def _cmd(self) -> List[str]:
        return _command(self.launcher, self.clients, self.directory, self.mode, self.saves)

    def run_to_end(self) -> None:
        """One run without a kill (the final cleaning run)."""
        job = _Job(self._cmd(), self.env)
        ready = job.wait_for("READY", START_LIMIT)
        ended = job.end(START_LIMIT)
        if ready is None or not ended or job.proc.returncode != 0:
            self._fail(f"uninterrupted run failed (exit {job.proc.returncode}):\n{job.output()}")
            return
        self._after(job, committed_in_run=bool(job.committed()), whole_run=True)

    def trial(self) -> None:
        self.stats.trials += 1
        job = _Job(self._cmd(), self.env)
        ready = job.wait_for("READY", START_LIMIT)
        if ready is None:
            ended = job.end(1.0)
            self._fail(f"trial {self.stats.trials}: no READY (ended: {ended}, exit {job.proc.returncode}):"
                       f"\n{job.output()}")
            self._after(job, committed_in_run=False)
            return
        time.sleep(self.rng.uniform(0.0, 1.15 * self.window))
        whole = self.launcher in ("local", "s3") or self.rng.random() < 0.5  # one process: the whole job
        before = job.committed()
        finished = job.proc.poll() is not None
        if finished:
            self.stats.finished_before_kill += 1
        elif whole:
            job.kill_all()
            self.stats.killed_whole_job += 1
        else:
            pids = job.pids()
            if not pids:
                self._fail(f"trial {self.stats.trials}: no client announced its pid:\n{job.output()}")
                job.kill_all()
            else:
                victims = [self.rng.choice(sorted(pids))]
                if self.mode == "tiered" and self.rng.random() < 0.5:  # a whole simulated node
                    node = soak_worker.node_of(victims[0], self.clients)
                    victims = [r for r in sorted(pids) if soak_worker.node_of(r, self.clients) == node]
                    self.stats.killed_one_node += 1
                for victim in victims:
                    job.kill_client(pids[victim])
            self.stats.killed_one_client += 1
        if before:
            self.stats.kills_after_a_commit += 1
        if not job.end(HANG_LIMIT):
            self.stats.hangs += 1
            self._fail(f"trial {self.stats.trials}: the job did not end within {HANG_LIMIT:.0f} s of a kill")
        self.stats.survivors_killed += job.survivors
        self._after(job, committed_in_run=bool(job.committed()), whole_run=finished)

    def _learn_window(self, job: _Job, whole_run: bool) -> None:
        """The kill window: READY to the last commit of a whole run, from the runs seen so far.

        A run that ended by itself measures it; a killed run only extrapolates from its first
        commits, which overestimates (the first save pays for lazy imports and pool starts), so
        extrapolations count only until a whole run was seen."""
        ready = next((t for t, line in job.lines if line == "READY"), None)
        commits = [t for t, line in job.lines if line.startswith("COMMITTED")]
        if ready is None or not commits:
            return
        if whole_run:
            self.whole_windows.append(commits[-1] - ready)
        else:
            self.windows.append((commits[-1] - ready) / len(commits) * self.saves)
        # the median: one slow run on a busy machine does not set it
        self.window = float(np.median(self.whole_windows or self.windows))

    def _after(self, job: _Job, committed_in_run: bool, whole_run: bool = False) -> None:
        """The checks after a run (module docstring), with every process of the job gone."""
        self._learn_window(job, whole_run)
        for _, line in job.lines:
            if line.startswith("MISMATCH"):
                self.stats.corrupt += 1
                self._fail(f"trial {self.stats.trials}: restored values differ: {line}")
        reported = job.committed()
        if self.mode == "tiered":  # the resume never restores a step older than a save that returned
            restored = [int(line.split()[1]) for _, line in job.lines if line.startswith("RESTORED ")]
            if restored and restored[0] < self.newest_returned:
                self.stats.missing_latest += 1
                self._fail(f"trial {self.stats.trials}: restored generation {restored[0]}, older than "
                           f"generation {self.newest_returned} whose save returned")
            returned = reported + [int(line.split()[1]) for _, line in job.lines if line.startswith("LOCAL ")]
            self.newest_returned = max([self.newest_returned] + returned)
        self.stats.commits_reported += len(reported)
        self.stats.refused += sum(1 for _, line in job.lines if line.startswith("REFUSED "))
        self.newest_reported = max([self.newest_reported] + reported)
        try:
            latest, kept, leftovers = inspect_directory(self.directory)
        except Exception as exc:
            self.stats.corrupt += 1
            self._fail(f"trial {self.stats.trials}: the state file cannot be read: {type(exc).__name__}: {exc}")
            return
        if latest is None:
            if self.newest_reported:
                self.stats.missing_latest += 1
                self._fail(f"trial {self.stats.trials}: no latest checkpoint after generation "
                           f"{self.newest_reported} was reported committed")
        else:
            generation = int(_PREFIX.fullmatch(os.path.basename(latest)).group(1))  # type: ignore[union-attr]
            self.stats.generations = max(self.stats.generations, generation)
            if generation < self.newest_reported:
                self.stats.missing_latest += 1
                self._fail(f"trial {self.stats.trials}: latest is {latest}, older than generation "
                           f"{self.newest_reported} reported committed")
            elif generation > self.newest_reported and (not reported or generation > max(reported)):
                self.stats.latest_advanced_unreported += 1
            for prefix in dict.fromkeys([latest] + kept):
                problem = check_checkpoint(prefix, self.mode)
                if problem is not None:
                    self.stats.corrupt += 1
                    self._fail(f"trial {self.stats.trials}: {problem}")
        if committed_in_run:  # a save committed since: every older leftover must be gone
            stale = set(self.pending_leftovers) & set(leftovers)
            if stale:
                self.stats.not_cleaned += len(stale)
                self._fail(f"trial {self.stats.trials}: leftovers not cleaned by a committed save: "
                           f"{sorted(n for n, _, _ in stale)}")
            self.pending_leftovers = {}
        new = set(leftovers) - set(self.pending_leftovers)
        self.stats.leftovers_seen += len(new)
        self.pending_leftovers.update(leftovers)

    def finish(self) -> None:
        """The final run to its end; then nothing but the state file and the kept checkpoints may remain."""
        self.run_to_end()
        try:
            _, kept, leftovers = inspect_directory(self.directory)
        except Exception as exc:
            self._fail(f"final: {type(exc).__name__}: {exc}")
            return
        if self.mode == "tiered":
            leftovers.update(tier_leftovers(self.directory))
        self.stats.leaked_bytes = sum(leftovers.values())
        if leftovers:
            self._fail(f"final: left in {self.directory}: {sorted(n for n, _, _ in leftovers)}")
        if len(kept) != 2:
            self._fail(f"final: the state file keeps {kept}, expected 2 checkpoints (max_to_keep=2)")


# -- the whole soak -----------------------------------------------------------------------

def start_s3_server(root: str) -> Tuple[subprocess.Popen, str]:
    """Start moto's S3 server, point this process (and the jobs it starts, through the environment) at it,
    create a bucket; return the server and an ``s3://`` folder for the configs."""
    import uuid

    import s3_moto  # tests/helpers

    proc, endpoint = s3_moto.start_moto(open(os.path.join(root, "moto.log"), "wb"))
    os.environ.update(s3_moto.client_env(endpoint))
    import shardckpt.storage as storage

    storage.reset()
    bucket = "shardckpt-soak"
    storage.get_fs("s3://" + bucket).fs.mkdir(bucket)  # type: ignore[attr-defined]
    return proc, f"s3://{bucket}/soak-{uuid.uuid4().hex[:8]}"


def draw_seed() -> int:
    """The soak's seed: ``SHARDCKPT_SOAK_SEED`` when set (to replay a run), else a fresh random one."""
    chosen = os.environ.get("SHARDCKPT_SOAK_SEED")
    return int(chosen) if chosen else int.from_bytes(os.urandom(4), "little")


def soak(trials: int, configs: List[str], clients: int = 4, saves: int = 4, seed: Optional[int] = None,
         root: Optional[str] = None, log: bool = True, s3_root: Optional[str] = None) -> Dict[str, ConfigStats]:
    """Run ``trials`` trials round-robin over ``configs`` (a config named twice gets twice the trials); return
    the stats per config.

    ``s3-*`` configs save into ``s3_root`` (an ``s3://`` folder on the server the environment points at);
    without one, a moto server is started for the run. ``seed``: :func:`draw_seed` when ``None``; it is
    printed (also with ``log=False``) so that a run can be replayed with ``--seed`` / ``SHARDCKPT_SOAK_SEED``.
    """
    seed = draw_seed() if seed is None else seed
    rng = random.Random(seed)
    root = root or tempfile.mkdtemp(prefix="shardckpt-soak-")
    print(f"soak: {trials} trials over {', '.join(configs)}; {clients} clients; seed {seed} "
          f"(replay: SHARDCKPT_SOAK_SEED={seed}); in {root}", flush=True)
    server = None
    if s3_root is None and any(c.startswith("s3-") for c in configs):
        server, s3_root = start_s3_server(root)
    try:
        return _soak(trials, configs, clients, saves, rng, root, log, s3_root)
    finally:
        if server is not None:
            server.kill()
            server.wait()


def _soak(trials: int, configs: List[str], clients: int, saves: int, rng: random.Random, root: str, log: bool,
          s3_root: Optional[str]) -> Dict[str, ConfigStats]:
    soaks = {name: ConfigSoak(name, root, clients, saves, rng, log, s3_root) for name in dict.fromkeys(configs)}
    for s in soaks.values():  # one whole run first: it times the saves, so that the first kill lands inside them
        t0 = time.monotonic()
        s.run_to_end()
        s.stats.seconds += time.monotonic() - t0
    for i in range(trials):
        s = soaks[configs[i % len(configs)]]
        t0 = time.monotonic()
        s.trial()
        s.stats.seconds += time.monotonic() - t0
        if log and (i + 1) % 10 == 0:
            bad = sum(len(x.stats.failures) for x in soaks.values())
            print(f"  {i + 1}/{trials} trials, {bad} failures", flush=True)
    for s in soaks.values():
        t0 = time.monotonic()
        s.finish()
        s.stats.seconds += time.monotonic() - t0
    return {name: s.stats for name, s in soaks.items()}


def summary(stats: Dict[str, ConfigStats]) -> str:
    """A table of the counts per config, with a total row."""
    cols = ["trials", "killed_whole_job", "killed_one_client", "finished_before_kill", "commits_reported", "refused",
            "kills_after_a_commit", "latest_advanced_unreported", "leftovers_seen", "corrupt", "missing_latest",
            "not_cleaned", "hangs", "survivors_killed", "leaked_bytes", "seconds"]
    short = ["trials", "kill-job", "kill-1", "done", "commits", "refused", "after-commit", "unreported", "leftovers",
             "corrupt", "missing", "uncleaned", "hangs", "orphans", "leaked-B", "s"]
    rows = [["config"] + short]
    total = ConfigStats()
    for name, s in stats.items():
        rows.append([name] + [f"{getattr(s, c):.0f}" for c in cols])
        for c in cols:
            setattr(total, c, getattr(total, c) + getattr(s, c))
    rows.append(["total"] + [f"{getattr(total, c):.0f}" for c in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for name, s in stats.items():
        for failure in s.failures[:5]:
            lines.append(f"FAIL {name}: {failure}")
    return "\n".join(lines)


def ok(stats: Dict[str, ConfigStats]) -> bool:
    return all(not s.failures and not (s.corrupt or s.missing_latest or s.not_cleaned or s.hangs or s.leaked_bytes)
               for s in stats.values())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS))
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4, help="saves per run")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where the configs' directories go (default: a new temp dir)")
    parser.add_argument("--json", default=None, help="also write the stats as JSON to this file")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(ALL_CONFIGS))
    # (a config may be named more than once: it gets that share of the trials)
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(ALL_CONFIGS)}")
    stats = soak(args.trials, configs, args.clients, args.saves, args.seed, args.dir)
    print(summary(stats), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({k: asdict(v) for k, v in stats.items()}, indent=1))
    good = ok(stats)
    print("soak: OK" if good else "soak: FAILED", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
