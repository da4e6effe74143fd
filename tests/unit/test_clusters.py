"""``CLUSTER_ENVIRONMENTS``: each built-in launcher read from its own variables, the order they
are tried in, a user's own environment, requeueing, and what ``torchrig env`` says."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

import torchrig
from torchrig.cli import main
from torchrig.clusters import CLUSTER_ENVIRONMENTS, ClusterEnvironment, detect_environment

pytestmark = pytest.mark.timeout(60)

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "node[07-08]",
}
TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "9",
    "GROUP_RANK": "1",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-host-77@1",
}


def place(env: ClusterEnvironment) -> tuple[Any, ...]:
    return env.kind, env.global_rank, env.local_rank, env.node_rank, env.world_size, env.local_world_size


def test_the_builtins_are_registered_in_the_order_they_are_tried() -> None:
    assert [name for name, _ in CLUSTER_ENVIRONMENTS.classes()] == ["torchrun", "mpi", "slurm", "lsf", "kubeflow"]
    assert torchrig.CLUSTER_ENVIRONMENTS is CLUSTER_ENVIRONMENTS
    assert "requeues with scontrol" in CLUSTER_ENVIRONMENTS.describe()["slurm"]


def test_torchrun() -> None:
    env = detect_environment(TORCHRUN)
    assert place(env) == ("torchrun", 3, 1, 1, 4, None)
    assert (env.master_addr, env.master_port, env.launched) == ("h", 9, True)
    assert "RANK, WORLD_SIZE, LOCAL_RANK" in env.reason


def test_slurm_step_and_its_rendezvous_from_the_node_list_and_job_id() -> None:
    env = detect_environment(SLURM_STEP)
    assert place(env) == ("slurm", 3, 1, 1, 4, 2)
    assert (env.master_addr, env.master_port) == ("node07", 15000 + 4242)
    assert env.reason == "SLURM_PROCID and SLURM_NTASKS=4 are set (srun)"
    given = detect_environment({**SLURM_STEP, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (given.master_addr, given.master_port) == ("head", 1234)


def test_a_one_task_slurm_job_leaves_starting_processes_to_torchrig_but_can_requeue() -> None:
    one_task = {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    env = detect_environment(one_task)
    assert env.kind == "none" and not env.launched
    assert env.reason == "slurm job 4242 runs this as one task: torchrig starts the processes itself"
    assert CLUSTER_ENVIRONMENTS.job(one_task)[::2] == ("slurm", "4242")  # type: ignore[index]
    array = {**one_task, "SLURM_ARRAY_JOB_ID": "17", "SLURM_ARRAY_TASK_ID": "3"}
    assert CLUSTER_ENVIRONMENTS.job(array)[2] == "17_3"  # type: ignore[index]


def test_open_mpi_mpich_and_pmix() -> None:
    env = detect_environment(OPEN_MPI)
    assert place(env) == ("mpi", 3, 1, 1, 4, 2)
    # two machines and no MASTER_ADDR: the address is unknown (the process group says how to give it)
    assert env.master_addr is None and env.reason == "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE are set (mpirun)"
    one_node = detect_environment({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert one_node.master_addr == "127.0.0.1" and one_node.node_rank == 0
    # every process of one MPI job derives the same port from the job's name
    assert one_node.master_port == detect_environment({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0"}).master_port
    assert one_node.master_port != detect_environment({**OPEN_MPI, "PMIX_NAMESPACE": "other@1"}).master_port
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "MASTER_PORT": "5"}
    assert place(detect_environment(mpich)) == ("mpi", 2, 2, 0, 3, 3)
    assert detect_environment(mpich).master_port == 5
    assert place(detect_environment({"PMIX_RANK": "1", "PMI_SIZE": "2"}))[:2] == ("mpi", 1)


def test_lsf_jsrun() -> None:
    lsf = {
        "LSB_JOBID": "99",
        "JSM_NAMESPACE_RANK": "5",
        "JSM_NAMESPACE_SIZE": "8",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
        "JSM_NAMESPACE_LOCAL_SIZE": "4",
        "LSB_MCPU_HOSTS": "batch1 1 gpu01 4 gpu02 4",
    }
    env = detect_environment(lsf)
    assert place(env)[:3] == ("lsf", 5, 1) and (env.world_size, env.local_world_size) == (8, 4)
    assert (env.master_addr, env.master_port) == ("gpu01", 15099)  # the launch node is skipped


def test_kubeflow_pytorchjob_is_one_process_per_pod_and_torchrun_in_a_pod_is_torchrun() -> None:
    pod = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    pod["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
    env = detect_environment(pod)
    assert place(env) == ("kubeflow", 2, 0, 2, 3, 1) and env.master_addr == "job-master-0"
    assert detect_environment({**pod, "LOCAL_RANK": "0"}).kind == "torchrun"
    assert detect_environment({k: v for k, v in pod.items() if k != "KUBERNETES_SERVICE_HOST"}).kind == "none"


def test_the_most_specific_launcher_wins_inside_a_slurm_allocation() -> None:
    # torchrun started by srun, and mpirun run from an sbatch script, both inherit SLURM_*
    assert detect_environment({**SLURM_STEP, **TORCHRUN}).kind == "torchrun"
    assert detect_environment({**SLURM_STEP, **OPEN_MPI}).kind == "mpi"


def test_no_launcher() -> None:
    env = detect_environment({})
    assert (env.kind, env.launched, env.world_size) == ("none", False, 1)
    assert env.reason == "no launcher's variables are set (tried torchrun, mpi, slurm, lsf, kubeflow)"


class _SimEnvironment(ClusterEnvironment):
    """A scheduler of our own, registered by its hook when the class is defined."""

    restart_count_var = "SIM_RESTARTS"

    @classmethod
    def detect(cls, environ: Any) -> ClusterEnvironment | None:
        if "SIM_RANK" not in environ:
            return None
        rank = int(environ["SIM_RANK"])
        return cls(kind="sim", global_rank=rank, world_size=2, master_addr="x", master_port=1, reason="SIM_RANK")

    @classmethod
    def job_id(cls, environ: Any) -> str | None:
        return environ.get("SIM_JOB")

    @classmethod
    def requeue(cls, environ: Any) -> str | None:
        return f"sim cannot requeue {environ['SIM_JOB']} today"


def test_a_users_environment_is_tried_before_the_builtins_until_removed() -> None:
    CLUSTER_ENVIRONMENTS.register("sim", _SimEnvironment, description="tests")
    try:
        env = detect_environment({**TORCHRUN, "SIM_RANK": "1"})
        assert type(env) is _SimEnvironment and place(env)[:2] == ("sim", 1)
        assert CLUSTER_ENVIRONMENTS.requeue({"SIM_JOB": "12"}) == "sim cannot requeue 12 today"
        assert CLUSTER_ENVIRONMENTS.restart_count({"SIM_RESTARTS": "2", "SLURM_RESTART_COUNT": "1"}) == 2

        class Other(ClusterEnvironment):
            pass

        with pytest.raises(ValueError, match=r"cluster environment 'sim' is already registered by .*_SimEnvironment; "):
            CLUSTER_ENVIRONMENTS.register("sim", Other)
    finally:
        CLUSTER_ENVIRONMENTS.remove("sim")
    assert detect_environment({**TORCHRUN, "SIM_RANK": "1"}).kind == "torchrun"
    with pytest.raises(ValueError, match=r"unknown cluster environment 'slrum'.*Did you mean 'slurm'\?"):
        CLUSTER_ENVIRONMENTS.entry("slrum")


def test_a_class_with_the_hook_registers_itself_on_definition() -> None:
    class Hooked(ClusterEnvironment):
        @classmethod
        def register_cluster_environments(cls, registry: Any) -> None:
            registry.register("hooked_test", cls, description="tests", override=True)

    try:
        assert CLUSTER_ENVIRONMENTS.entry("hooked_test").factory is Hooked
    finally:
        CLUSTER_ENVIRONMENTS.remove("hooked_test")


def test_requeue_says_why_it_cannot(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert CLUSTER_ENVIRONMENTS.requeue({}) == "this process runs in no scheduler job (SLURM_JOB_ID is not set)"
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol, no brequeue
    assert CLUSTER_ENVIRONMENTS.requeue({"SLURM_JOB_ID": "5"}) == "scontrol is not on PATH"
    assert CLUSTER_ENVIRONMENTS.requeue({"LSB_JOBID": "6"}) == "brequeue is not on PATH"


def test_restart_count_ignores_what_is_not_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    counts = {"TORCHELASTIC_RESTART_COUNT": "x", "SLURM_RESTART_COUNT": "1"}
    assert CLUSTER_ENVIRONMENTS.restart_count(counts) == 1
    assert "ignoring TORCHELASTIC_RESTART_COUNT='x' (not a number)" in capsys.readouterr().err


def test_an_mpi_job_over_machines_without_an_address_is_refused_with_the_fix() -> None:
    strategy = torchrig.resolve(accelerator="cpu", devices=2, strategy="ddp").strategy
    env = detect_environment(OPEN_MPI)
    with pytest.raises(
        ValueError, match=r"the mpi launcher gave rank 3 of 4 no rendezvous address .*mpirun -x MASTER_ADDR"
    ):
        strategy._init_process_group("gloo", env)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("variables", "detected", "why"),
    [
        ({}, "none", "no launcher's variables are set"),
        (OPEN_MPI, "mpi", "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE are set (mpirun)"),
        (SLURM_STEP, "slurm", "SLURM_PROCID and SLURM_NTASKS=4 are set (srun)"),
    ],
)
def test_torchrig_env_says_which_launcher_and_why(
    variables: dict[str, str],
    detected: str,
    why: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in [*os.environ]:
        if var.startswith(("SLURM_", "OMPI_", "PMI", "LSB_", "JSM_")) or var in TORCHRUN:
            monkeypatch.delenv(var)
    for var, value in variables.items():
        monkeypatch.setenv(var, value)
    assert main(["env", "--json"]) == 0
    cluster = json.loads(capsys.readouterr().out)["cluster"]
    assert cluster["detected"] == detected and cluster["why"].startswith(why)
    assert cluster["known"] == ["torchrun", "mpi", "slurm", "lsf", "kubeflow"]
    if detected == "slurm":
        assert (cluster["global_rank"], cluster["world_size"], cluster["rendezvous"]) == (3, 4, "node07:19242")
        assert cluster["scheduler_job"] == "slurm 4242"
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["env"]) == 0
    table = capsys.readouterr().out
    assert "cluster" in table and why in table
