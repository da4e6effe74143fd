"""A one-node SLURM cluster on localhost for the tests: ``munged``, ``slurmctld`` and ``slurmd``
started from a temporary folder (their own key, sockets, ports, state and logs), and stopped.

Nothing here touches the machine's own SLURM or munge set-up: every path is under the folder,
and clients find the cluster through ``SLURM_CONF``. Every start and stop has a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
HOW_TO_GET = "apt-get install slurm-wlm munge (what .ci/run does)"

#: Seconds SLURM waits between SIGTERM and SIGKILL when it cancels a job (``scancel``).
KILL_WAIT = 10
#: slurmctld checks time limits (and sends ``--signal`` warnings) every this many seconds, counted
#: from its start (SLURM's compiled-in ``PERIODIC_TIMEOUT``).
TIME_LIMIT_PERIOD = 30


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def skip_reason() -> str | None:
    """Why the SLURM tests cannot run here (one line), or None."""
    missing = missing_binaries()
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): {HOW_TO_GET}"
    if os.geteuid() != 0:
        return "a test SLURM cluster needs root (slurmd starts jobs as their user); run as root, as .ci/run does"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, cpus: int) -> str:
    return f"""\
ClusterName=torchrig-tests
SlurmctldHost=localhost
SlurmUser={os.environ.get("USER", "root") if os.geteuid() != 0 else "root"}
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
KillWait={KILL_WAIT}
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
NodeName=localhost CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """``start()`` brings the cluster up (``sinfo`` shows the node idle), ``stop()`` takes it down."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = root
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen[bytes]] = []
        #: ``time.monotonic()`` when slurmctld was started: its time-limit checks come no earlier
        #: than every ``TIME_LIMIT_PERIOD`` seconds after it.
        self.controller_started = 0.0

    # -- life cycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> SlurmCluster:
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_config(self.root, self.cpus))
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        os.chmod(self.root / "munge", 0o700)
        self._daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.root}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={self.root}/munge/munged.pid",
            f"--log-file={self.root}/munge/munged.log",
            f"--seed-file={self.root}/munge/munged.seed",
        )
        self._wait_for(lambda: (self.root / "munge.socket").exists(), timeout, "munged to open its socket")
        self.controller_started = time.monotonic()
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", "localhost")
        self._wait_for(self._node_ready, timeout, "the node to become idle (sinfo)")
        return self

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, SIGKILL after ``timeout``)."""
        if not self.daemons:
            return
        self.run("scancel", "--full", "--user", str(os.getuid()), check=False, timeout=10)
        # One at a time, last started first: slurmd and slurmctld still need munged to shut down.
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.daemons.clear()

    def next_time_limit_check(self, after: float) -> float:
        """The earliest ``time.monotonic()`` after ``after`` at which slurmctld may check time
        limits (and send a job's ``--signal`` warning). Its checks run ``TIME_LIMIT_PERIOD`` seconds
        apart from its start, counted in whole seconds (so up to one second early): a job ready
        by this time is ready for its warning."""
        first = self.controller_started - 1  # the start's fraction of a second dropped
        periods = max(1, int((after - first) // TIME_LIMIT_PERIOD) + 1)
        return first + periods * TIME_LIMIT_PERIOD

    def _daemon(self, *cmd: str) -> None:
        log = open(self.root / f"{cmd[0]}.out", "wb")  # noqa: SIM115 (kept open for the daemon's life)
        self.daemons.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _node_ready(self) -> bool:
        for proc in self.daemons:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{self.logs()}")  # type: ignore[index]
        done = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10)
        return done.returncode == 0 and done.stdout.strip() in ("idle", "mix", "alloc")

    def _wait_for(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise TimeoutError(f"waited {timeout:.0f} s for {what}:\n{self.logs()}")

    # -- clients ---------------------------------------------------------------------------------
    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr}\n{self.logs()}")
        return done

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        out = self.run("sbatch", "--parsable", *args, env=env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``Reason``...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(
        self,
        job_id: int,
        states: tuple[str, ...],
        timeout: float,
        *,
        release: bool = True,
        update: tuple[str, ...] = (),
    ) -> dict[str, str]:
        """Wait until the job is in one of ``states``; a requeued job SLURM holds back (reason
        ``BeginTime``) is released at once when ``release``, with ``update``'s changes
        (``scontrol update`` fields such as ``TimeLimit=5``) for its next run."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        held_since: float | None = None
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if release and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                held_since = time.monotonic() if held_since is None else held_since
                # slurmd revokes the job's credential when its previous run is killed and refuses a new
                # one issued in the same second ("Killing non-startable batch JobId=N: Job credential
                # revoked"): SLURM's own hold is far longer; 2 s is enough.
                if time.monotonic() - held_since >= 2.0:
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", *update, check=False)
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} is not {'/'.join(states)} after {timeout:.0f} s: {info}\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


def _running(root: Path) -> Iterator[SlurmCluster]:
    why_not = skip_reason()
    if why_not is not None:
        pytest.skip(why_not)
    cluster = SlurmCluster(root)
    try:
        cluster.start(timeout=60)
        yield cluster
    finally:
        cluster.stop(timeout=30)


@pytest.fixture(scope="session", name="slurm")
def slurm_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The session's cluster: started on first use, stopped (with its jobs) at the session's end."""
    yield from _running(Path(tmp_path_factory.mktemp("slurm")))


@pytest.fixture(name="fresh_slurm")
def fresh_slurm_fixture(tmp_path: Path) -> Iterator[SlurmCluster]:
    """A cluster of the test's own, started now, so the test knows when slurmctld checks time
    limits (``next_time_limit_check``); stopped (with its jobs) after the test."""
    yield from _running(tmp_path / "slurm")
