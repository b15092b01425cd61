"""A real Slurm controller with 16 virtual GPU nodes on this machine, for integration tests.

Debian's slurm-wlm 22.05 and munge (installed by `.ci/run`, or `apt-get install slurm-wlm
munge` by hand). One slurmctld and one `slurmd -N gpuNNN` per node, all on 127.0.0.1 with
ports picked free at start, every file (config, spool, state, logs, pid files, placeholder GPU
devices) in a temporary folder, so a test run leaves nothing behind and two runs do not clash.
The recipe: gres.conf with AutoDetect=off
and placeholder character devices (a GPU declared by count alone makes the node INVAL),
`SlurmdParameters=config_overrides` so the nodes report the configured hardware, munged run as
the munge user, accounting off.

`start_slurm_cluster` raises `SlurmUnavailable` with the reason when something is missing or
does not come up; the fixture turns that into a skip locally and a failure in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_COUNT = 16
GPUS_PER_NODE = 8
BINARIES = ("slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "scancel", "munged", "munge", "unmunge")
STANDBY_RESERVATION = "gpufail-standby"


class SlurmUnavailable(RuntimeError):
    """Slurm could not be started here; the message says why."""


@dataclass
class SlurmCluster:
    folder: Path
    conf: Path
    nodes: list[str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment for `scontrol`/`sinfo`: SLURM_CONF points at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, dict[str, object]]:
        """Node name -> the node's `sinfo --json` record."""
        done = subprocess.run(["sinfo", "--json"], env=self.env, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sinfo --json: {done.stderr.strip()}")
        return {n["name"]: n for n in json.loads(done.stdout)["nodes"]}

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every node is plain idle (registered, not drained, not down)."""
        deadline = time.monotonic() + timeout
        states: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
            except (RuntimeError, json.JSONDecodeError, subprocess.TimeoutExpired):
                states = {}
            if len(states) == len(self.nodes) and all(
                s.get("state") == "idle" and not s.get("state_flags") for s in states.values()
            ):
                return
            time.sleep(0.2)
        summary = {name: (s.get("state"), s.get("state_flags")) for name, s in states.items()}
        raise SlurmUnavailable(f"nodes did not all become idle within {timeout:.0f}s: {summary}; logs in {self.folder}")

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done

    @property
    def jobcomp(self) -> Path:
        """The job-completion record (`jobcomp/filetxt`): one line per job that ended."""
        return self.folder / "jobcomp.txt"

    def jobs(self) -> dict[str, dict[str, object]]:
        """Job id -> its `squeue --json` record, for the jobs that are pending or running."""
        answer = json.loads(self.run("squeue", "--json").stdout)
        return {str(j["job_id"]): j for j in answer["jobs"] if j["job_state"] in ("PENDING", "RUNNING", "COMPLETING")}

    def reset_nodes(self) -> None:
        """End every job, remove the standby reservation, resume every node and clear its
        weight, so each test starts from an idle cluster."""
        if self.jobs():
            self.run("scancel", "--user=root")
            deadline = time.monotonic() + 60
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.run("scontrol", "delete", f"ReservationName={STANDBY_RESERVATION}", check=False)
        states = self.node_states()
        # RESUME is refused for a node that is neither drained nor down.
        stuck = [n for n, s in states.items() if s.get("state_flags") or s.get("state") == "down"]
        if stuck:
            self.scontrol("update", f"NodeName={','.join(stuck)}", "State=RESUME")
        self.scontrol("update", f"NodeName={','.join(self.nodes)}", "Weight=1")
        self.wait_idle()

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()


def _free_ports(count: int) -> list[int]:
    """`count` consecutive TCP ports that are free on 127.0.0.1 now (a range, as slurm.conf's
    `Port=[a-b]` needs one)."""
    for base in range(20000, 60000, 97):
        candidates = range(base, base + count)
        sockets = []
        try:
            for port in candidates:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return list(candidates)
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise SlurmUnavailable("no range of free TCP ports on 127.0.0.1")


def _munge_works() -> bool:
    try:
        token = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=True).stdout
        subprocess.run(["unmunge"], input=token, capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _start_munge() -> None:
    if _munge_works():
        return  # a munged is already running (another test session, or the machine's own)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    # munged refuses to run as root ("Logfile is insecure"); it daemonizes itself.
    done = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, text=True)
    if done.returncode != 0 or not _munge_works():
        raise SlurmUnavailable(f"munged did not start: {done.stderr.strip() or 'munge -n | unmunge fails'}")


def _write_config(folder: Path, ctld_port: int, node_ports: list[int]) -> Path:
    devices = folder / "dev"
    devices.mkdir()
    gres_lines = ["AutoDetect=off"]
    for i in range(NODE_COUNT):
        name = f"gpu{i + 1:03d}"
        for g in range(GPUS_PER_NODE):
            device = devices / f"{name}-nvidia{g}"
            # Placeholder character devices (the major/minor of /dev/null): Slurm only needs
            # File= to exist to count the GPUs; no job opens them.
            os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))
        gres_lines.append(f"NodeName={name} Name=gpu Type=h100 File={devices}/{name}-nvidia[0-{GPUS_PER_NODE - 1}]")
    (folder / "gres.conf").write_text("\n".join(gres_lines) + "\n")
    host = socket.gethostname().split(".")[0]
    last = f"{NODE_COUNT:03d}"
    conf = folder / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=gpufailtest",
                f"SlurmctldHost={host}",
                f"SlurmctldPort={ctld_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"StateSaveLocation={folder}/state",
                f"SlurmdSpoolDir={folder}/spool/%n",
                f"SlurmctldPidFile={folder}/slurmctld.pid",
                f"SlurmdPidFile={folder}/slurmd-%n.pid",
                f"SlurmctldLogFile={folder}/slurmctld.log",
                f"SlurmdLogFile={folder}/slurmd-%n.log",
                "SlurmdParameters=config_overrides",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                # No slurmdbd here: job ends (NODE_FAIL among them) are read from the
                # job-completion record instead of `sacct`.
                "JobCompType=jobcomp/filetxt",
                f"JobCompLoc={folder}/jobcomp.txt",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "ReturnToService=2",
                "GresTypes=gpu",
                "MpiDefault=none",
                f"NodeName=gpu[001-{last}] NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port=[{node_ports[0]}-{node_ports[-1]}] CPUs=32 RealMemory=64000 "
                f"Gres=gpu:h100:{GPUS_PER_NODE} State=UNKNOWN",
                f"PartitionName=gpu Nodes=gpu[001-{last}] Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    return conf


def start_slurm_cluster(folder: Path) -> SlurmCluster:
    """Start munged (if not running), slurmctld and 16 slurmd under `folder`; return once every
    node is idle. On failure everything started is stopped and `SlurmUnavailable` raised."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster needs root (mknod for the GPU placeholders, drain/resume)")
    _start_munge()
    ports = _free_ports(NODE_COUNT + 1)
    conf = _write_config(folder, ports[0], ports[1:])
    cluster = SlurmCluster(folder=folder, conf=conf, nodes=[f"gpu{i + 1:03d}" for i in range(NODE_COUNT)])
    env = cluster.env
    try:
        cluster.processes.append(
            _spawn(["slurmctld", "-D", "-i", "-f", str(conf)], env, folder / "slurmctld.out")  # -i: ignore old state
        )
        for name in cluster.nodes:
            cluster.processes.append(_spawn(["slurmd", "-D", "-N", name, "-f", str(conf)], env, folder / f"{name}.out"))
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _spawn(argv: list[str], env: dict[str, str], output: Path) -> subprocess.Popen[bytes]:
    with output.open("wb") as out:
        path = shutil.which(argv[0]) or f"/usr/sbin/{argv[0]}"
        return subprocess.Popen([path, *argv[1:]], env=env, stdout=out, stderr=subprocess.STDOUT)
