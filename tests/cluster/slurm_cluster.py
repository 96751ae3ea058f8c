"""A real two-node Slurm on one machine: munged, slurmctld and two slurmd (node1 on 127.0.0.2, node2
on 127.0.0.3), two placeholder GPUs per node, everything under one folder (SLURM_CONF points at it;
nothing under /etc changes, nothing listens outside 127.0.0.0/8).

Each daemon runs in its own UTS and mount namespace (`unshare --uts --mount`, root only): its own
hostname (per-node `srun --output=train-%N.log` files stay per node and torchrun's host checks see
node1 / node2) and a private bind mount of a hosts file over /etc/hosts, so node1, node2 and the
controller resolve inside every job without touching the machine's /etc/hosts.

By hand (root, slurm-wlm and munge installed):

    python tests/cluster/slurm_cluster.py /tmp/slurm-test   # prints the SLURM_CONF to export; Ctrl-C stops it
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = {"node1": "127.0.0.2", "node2": "127.0.0.3"}
CONTROLLER = ("slurmctl", "127.0.0.1")
GPUS_PER_NODE = 2
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "unshare")
HOW_TO_ENABLE = ("the cluster tests need a real Slurm: as root, `apt-get install -y slurm-wlm munge` "
                 "(Debian / Ubuntu); see slurm/README.md")


def missing() -> str | None:
    """Why a test cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return f"not root; {HOW_TO_ENABLE}"
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    return f"{', '.join(absent)} not found; {HOW_TO_ENABLE}" if absent else None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def slurm_conf(root: Path, ctl_port: int, node_ports: list[int]) -> str:
    """slurm.conf of the test cluster. No cgroups (proctrack/linuxproc: Slurm ends a step's process
    tree), no accounting daemon (jobcomp/filetxt records every job's end), short timers
    (cred_expire is also how long a requeued job waits before it may start again: 120 s by default)."""
    nodes = "\n".join(f"NodeName={name} NodeAddr={addr} Port={port} CPUs=2 RealMemory=2000 "
                      f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
                      for (name, addr), port in zip(NODES.items(), node_ports))
    return f"""\
ClusterName=megatronrl-test
SlurmctldHost={CONTROLLER[0]}({CONTROLLER[1]})
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
MinJobAge=3600
KillWait=5
UnkillableStepTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MessageTimeout=10
MpiDefault=none
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    """Start with start(), stop with stop() (every daemon by pid, after cancelling every job)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ---- files ---------------------------------------------------------------------------------
    def _write(self) -> None:
        for sub in ("state", "munge", "spool/node1", "spool/node2", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctl_port, *node_ports = _free_ports(1 + len(NODES))
        self.conf.write_text(slurm_conf(self.root, ctl_port, node_ports))
        # Slurm 22.05 drops file-less GPUs ("Removing file-less GPU"): point each at a character
        # device with the null device's numbers.
        lines = []
        for node in NODES:
            for i in range(GPUS_PER_NODE):
                dev = self.root / "dev" / f"{node}-gpu{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
                lines.append(f"NodeName={node} Name=gpu File={dev}")
        (self.root / "gres.conf").write_text("\n".join(lines) + "\n")
        hosts = [f"{CONTROLLER[1]} {CONTROLLER[0]}"] + [f"{addr} {name}" for name, addr in NODES.items()]
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "\n".join(hosts) + "\n")

    # ---- daemons -------------------------------------------------------------------------------
    def _spawn(self, hostname: str | None, argv: list[str], log: str) -> None:
        if hostname is not None:  # its own hostname and a private /etc/hosts; exec keeps the pid
            argv = ["unshare", "--uts", "--mount", "sh", "-c",
                    f'hostname {hostname} && mount --bind "$0" /etc/hosts && exec "$@"',
                    str(self.root / "hosts"), *argv]
        out = open(self.root / log, "ab")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True))

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        self._write()
        m = self.root / "munge"
        self._spawn(None, ["munged", "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                           f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                           f"--seed-file={m}/munged.seed"], "munged.out")
        self._wait(lambda: (m / "munge.socket").exists(), timeout_s, "munged socket")
        self._spawn(CONTROLLER[0], ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._wait(lambda: self.scontrol("ping").returncode == 0 and "UP" in self.scontrol("ping").stdout,
                   timeout_s, "slurmctld")
        for name in NODES:
            self._spawn(name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out")
        self.wait_idle(timeout_s)
        return self

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until both nodes are idle (after a job, a node can stay `completing` for a moment)."""
        self._wait(lambda: self.node_states() == {n: "idle" for n in NODES}, timeout_s,
                   "both nodes idle", lambda: f"states {self.node_states()}")

    def node_states(self) -> dict[str, str]:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)

    def _wait(self, ok, timeout_s: float, what: str, detail=lambda: "") -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            dead = [p.args[-4:] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))
                raise RuntimeError(f"test Slurm: no {what} after {timeout_s:.0f} s {detail()} "
                                   f"(exited: {dead}){logs}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons we started (by pid): TERM, then KILL."""
        if self.procs and self.procs[0].poll() is None:
            subprocess.run(["scancel", "--full", "--partition=test"], env=self.env, capture_output=True)
            time.sleep(1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


if __name__ == "__main__":
    cluster = SlurmCluster(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm-test"))
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(0))  # as Ctrl-C: the finally stops it
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}   # both nodes idle; Ctrl-C stops the cluster", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
