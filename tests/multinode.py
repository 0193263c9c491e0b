"""A real two-node Slurm cluster on one machine: each "node" in its own network namespace (test helper).

The layout: a Linux bridge on a private subnet with one veth per namespace,
``ctl`` (slurmctld), ``n1`` and ``n2`` (one slurmd each), the bridge's own address in the root namespace so that
``sbatch``/``squeue``/``scontrol`` work from the test. Each daemon runs under
``nsenter --net=/run/netns/NS unshare --uts --mount`` (not ``ip netns exec``, which remounts /sys and hides the
cgroup tree from slurmd) with its own hostname and a private /etc/hosts listing the three hosts, so job processes see
``n1``/``n2`` as their hostname and 127.0.0.1 as their own loopback, as on a cluster. One munged serves every
namespace through its socket file. Nothing can leave the namespaces (no default route); only the bridge's subnet
(10.77.0.0/24) and loopback carry traffic.

The file system is shared by both nodes (namespaces split only the network), except ``node_local``: a directory that
each node's mount namespace covers with its own bind mount, the stand-in for a node-local disk.

`TwoNodeCluster.start` undoes whatever it created if it fails half way; `stop` kills only what it started (daemons
by their pid files, any process left in the node namespaces) and deletes the namespaces, veths and the bridge.
A lock file serializes fixtures across test sessions (they would share the subnet and names). The names (``dmn-*``),
the subnet and the ports differ from the single-node cluster of slurm/local/, which may run at the same time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.77.0"
HOSTS = {"ctl": f"{SUBNET}.1", "n1": f"{SUBNET}.2", "n2": f"{SUBNET}.3"}
BRIDGE, BRIDGE_ADDR = "dmnbr0", f"{SUBNET}.254"
NETNS = {name: f"dmn-{name}" for name in HOSTS}
IFNAME = "eth0"  # the nodes' interface, as on a cluster: what DAPO_SOCKET_IFNAME names
LOCK = Path("/run/dapo-mcore-multinode.lock")
CTLD_PORT, SLURMD_PORT = 6917, 6918  # inside the namespaces: no clash with the host's or slurm/local's ports
NEEDED = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "ip", "nsenter", "unshare")


class ClusterUnavailable(Exception):
    """The machine cannot host the cluster (missing packages or capabilities): the reason, for a skip."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=120)


def preflight() -> None:
    """Raise ClusterUnavailable with the reason if this machine cannot run the cluster."""
    missing = [exe for exe in NEEDED if shutil.which(exe) is None]
    if missing:
        raise ClusterUnavailable(f"not installed: {', '.join(missing)} (run slurm/local/install.sh, apt iproute2)")
    if os.geteuid() != 0:
        raise ClusterUnavailable("needs root (slurmd launches tasks as the submitting user; namespaces, bridge)")
    probe = _run("unshare", "--net", "--uts", "--mount", "true", check=False)
    if probe.returncode != 0:
        raise ClusterUnavailable(f"no CAP_SYS_ADMIN (unshare --net --uts --mount): {probe.stderr.strip()}")
    probe = _run("ip", "link", "add", "dmnprobe0", "type", "bridge", check=False)
    if probe.returncode != 0:
        raise ClusterUnavailable(f"no CAP_NET_ADMIN (ip link add): {probe.stderr.strip()}")
    _run("ip", "link", "del", "dmnprobe0", check=False)


def _slurm_conf(state: Path, munge_socket: Path) -> str:
    # One key per line: several on one line is a parse error in 22.05 ("No SlurmctldHost defined").
    lines = [
        "ClusterName=dapomn", f"SlurmctldHost=ctl({HOSTS['ctl']})", f"SlurmctldPort={CTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}", "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        "SlurmdParameters=config_overrides", "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
        "SchedulerType=sched/backfill", "JobRequeue=1", "KillWait=5", "MinJobAge=600",
        # A dead slurmd is noticed within ~SlurmdTimeout (default 300 s) and the node set DOWN: short here.
        "SlurmdTimeout=10", "SlurmctldTimeout=10", "MessageTimeout=5", "InactiveLimit=0",
        f"StateSaveLocation={state}/state", f"SlurmdSpoolDir={state}/spool/%n",
        f"SlurmctldPidFile={state}/slurmctld.pid", f"SlurmdPidFile={state}/slurmd.%n.pid",
        f"SlurmctldLogFile={state}/log/slurmctld.log", f"SlurmdLogFile={state}/log/slurmd.%n.log",
        f"NodeName=n1 NodeAddr={HOSTS['n1']} CPUs=1 State=UNKNOWN",
        f"NodeName=n2 NodeAddr={HOSTS['n2']} CPUs=1 State=UNKNOWN",
        "PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
    ]
    return "\n".join(lines) + "\n"


class TwoNodeCluster:
    """Start with `start()`, stop with `stop()` (idempotent, safe after a failed start). `env` is for clients."""

    def __init__(self, state: Path) -> None:
        self.state = state.resolve()
        self.conf = self.state / "slurm.conf"
        self.node_local = self.state / "node-local"  # a different directory on each node
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._lock_fd: int | None = None
        self._created_run_netns = False

    # ----------------------------------------------------------------------------------------- start
    def start(self, timeout: float = 240) -> None:
        try:
            self._take_lock(timeout)
            self._files()
            self._network()
            self._daemons()
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _take_lock(self, timeout: float) -> None:
        fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"another two-node cluster holds {LOCK} for > {timeout:.0f} s") from None
                time.sleep(1)
        self._lock_fd = fd
        # A previous session killed before its teardown leaves namespaces/bridge behind: they are ours by name.
        self._delete_network()

    def _files(self) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.state / "munge", 0o700)
        for node in ("n1", "n2"):
            (self.state / f"node-local.{node}").mkdir(exist_ok=True)
        self.node_local.mkdir(exist_ok=True)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in HOSTS.items())
        (self.state / "hosts").write_text(hosts)
        self.munge_socket = self.state / "munge" / "munge.socket"
        self.conf.write_text(_slurm_conf(self.state, self.munge_socket))
        (self.state / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _network(self) -> None:
        self._created_run_netns = not Path("/run/netns").exists()
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for name, addr in HOSTS.items():
            ns, host_end = NETNS[name], f"dmnv-{name}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", f"dmnp-{name}")
            _run("ip", "link", "set", f"dmnp-{name}", "netns", ns)
            _run("ip", "-n", ns, "link", "set", f"dmnp-{name}", "name", IFNAME)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "set", host_end, "master", BRIDGE)
            _run("ip", "link", "set", host_end, "up")

    def _in_node(self, name: str, command: str) -> None:
        """Run ``command`` (a daemon that forks into the background) in node ``name``'s namespaces."""
        setup = f"mount --bind {self.state / 'hosts'} /etc/hosts && hostname {name}"
        if name in ("n1", "n2"):
            setup += f" && mount --bind {self.state / f'node-local.{name}'} {self.node_local}"
        _run("nsenter", f"--net=/run/netns/{NETNS[name]}", "unshare", "--uts", "--mount", "sh", "-c",
             f"{setup} && exec {command}")

    def _daemons(self) -> None:
        key = self.state / "munge" / "munge.key"
        if not key.exists():
            _run("mungekey", "-c", "-k", str(key))
        _run("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={self.state / 'munged.pid'}", f"--log-file={self.state / 'log' / 'munged.log'}",
             f"--seed-file={self.state / 'munge' / 'munged.seed'}")
        self._in_node("ctl", f"slurmctld -f {self.conf}")
        for node in ("n1", "n2"):
            self.start_slurmd(node)

    def start_slurmd(self, node: str) -> None:
        self._in_node(node, f"slurmd -f {self.conf}")

    def sinfo(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True,
                              timeout=60)
        return proc.stdout.strip()

    def wait_idle(self, timeout: float = 240) -> None:
        """Until both nodes are idle (registered with the controller, no job)."""
        deadline = time.monotonic() + timeout
        while self.sinfo().split("\n") != ["n1 idle", "n2 idle"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not idle after {timeout:.0f} s: {self.sinfo()!r}; see {self.state}/log/")
            time.sleep(0.5)

    # ------------------------------------------------------------------------------------- failures
    def node_pids(self, node: str) -> list[int]:
        """Every process in a node's network namespace: its slurmd, slurmstepd and job tasks."""
        out = _run("ip", "netns", "pids", NETNS[node], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: str) -> list[int]:
        """The node dies: SIGKILL to its slurmd and every job process on it. Returns the pids killed."""
        pids = self.node_pids(node)
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        return pids

    def trainer_pid(self, node: str) -> int | None:
        """The trainer process (``python -m dapo_mcore.cli``, not its wrapper shell) of the job on ``node``."""
        for pid in self.node_pids(node):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:  # exited meanwhile
                continue
            if argv[1:3] == [b"-m", b"dapo_mcore.cli"]:
                return pid
        return None

    # ------------------------------------------------------------------------------------------ stop
    def stop(self) -> None:
        self._cancel_jobs()
        for pid_file in ["slurmd.n1.pid", "slurmd.n2.pid", "slurmctld.pid", "munged.pid"]:
            path = self.state / pid_file
            if path.is_file() and path.read_text().strip():
                _terminate(int(path.read_text()))
        for node in ("n1", "n2", "ctl"):  # job tasks outlive slurmd; anything left in our namespaces is ours
            if Path(f"/run/netns/{NETNS[node]}").exists():
                for pid in self.node_pids(node):
                    _terminate(pid)
        self._delete_network()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _cancel_jobs(self) -> None:
        if not self.conf.exists() or not (self.state / "slurmctld.pid").is_file():
            return
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True, text=True,
                              timeout=60).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=self.env, capture_output=True, timeout=60)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True, text=True, timeout=60).stdout:
                time.sleep(0.5)

    def _delete_network(self) -> None:
        for ns in NETNS.values():
            if Path(f"/run/netns/{ns}").exists():
                _run("ip", "netns", "del", ns, check=False)
        for name in HOSTS:  # host ends vanish with their namespace's peer; a half-made one may not have moved
            _run("ip", "link", "del", f"dmnv-{name}", check=False)
        _run("ip", "link", "del", BRIDGE, check=False)
        run_netns = Path("/run/netns")
        if self._created_run_netns and run_netns.is_dir() and not any(run_netns.iterdir()):
            # `ip netns add` leaves /run/netns as a bind mount of itself
            _run("umount", str(run_netns), check=False)
            _run("rmdir", str(run_netns), check=False)


def freezer_root() -> Path:
    """A cgroup v2 hierarchy with the freezer (``cgroup.freeze``); ClusterUnavailable with the reason if none."""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if fstype == "cgroup2" and (Path(mount) / "cgroup.procs").exists():
            probe = Path(mount) / "dapo-mn-probe"
            try:
                probe.mkdir(exist_ok=True)
                ok = (probe / "cgroup.freeze").exists()
            except OSError as exc:
                raise ClusterUnavailable(f"cannot create a cgroup under {mount}: {exc}") from exc
            finally:
                if probe.is_dir():
                    probe.rmdir()
            if ok:
                return Path(mount)
    raise ClusterUnavailable("no cgroup v2 hierarchy with cgroup.freeze (needed to freeze a rank)")


class Frozen:
    """A process hung for real: moved into a frozen cgroup v2, it runs nothing, handles no signal (SIGCONT does not
    thaw it; Slurm sends SIGCONT before SIGTERM, which undoes a SIGSTOP), and only SIGKILL ends it."""

    def __init__(self, pid: int) -> None:
        self.group = freezer_root() / f"dapo-mn-frozen-{pid}"
        self.group.mkdir()
        (self.group / "cgroup.procs").write_text(str(pid))
        (self.group / "cgroup.freeze").write_text("1")
        deadline = time.monotonic() + 10
        while "frozen 1" not in (self.group / "cgroup.events").read_text():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.group} did not freeze")
            time.sleep(0.05)

    def remove(self) -> None:
        """Kill whatever is left in the group and remove it (every exit path of a test)."""
        if not self.group.is_dir():
            return
        for pid in (self.group / "cgroup.procs").read_text().split():
            _kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (self.group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.group.rmdir()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _terminate(pid: int, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; returns once the process is gone."""
    _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        _kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + grace
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
