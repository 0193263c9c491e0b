#!/usr/bin/env bash
# Start a private single-node Slurm (munged + slurmctld + slurmd) under STATE_DIR.
#
# Usage: slurm/local/start.sh STATE_DIR
# Everything lives in STATE_DIR: slurm.conf, cgroup.conf, munge socket, spool, state, logs, pid
# files. munged gets its own socket so a system munged (if any) is left alone. Ports are picked
# free on loopback. Clients must use it through:   export SLURM_CONF=STATE_DIR/slurm.conf
# Stop it with slurm/local/stop.sh STATE_DIR (kills by the recorded pids only).
# Requires root (slurmd launches tasks as the submitting user) and the packages from install.sh.
set -euo pipefail

state_dir=${1:?usage: start.sh STATE_DIR}
mkdir -p "$state_dir"
state_dir=$(cd "$state_dir" && pwd)
chmod 700 "$state_dir"
mkdir -p "$state_dir"/{spool,state,log,munge}
chmod 700 "$state_dir/munge"

for exe in munged slurmctld slurmd sinfo; do
    command -v "$exe" >/dev/null || { echo "start.sh: $exe not found; run slurm/local/install.sh" >&2; exit 2; }
done

host=$(hostname -s)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS, often 1 on a cluster login shell
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
ctld_port=$(free_port)
slurmd_port=$(free_port)
munge_socket="$state_dir/munge/munge.socket"

cat >"$state_dir/slurm.conf" <<CONF
ClusterName=dapolocal
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$munge_socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
ReturnToService=2
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool/slurmd-%n
SlurmctldPidFile=$state_dir/slurmctld.pid
SlurmdPidFile=$state_dir/slurmd.pid
SlurmctldLogFile=$state_dir/log/slurmctld.log
SlurmdLogFile=$state_dir/log/slurmd.log
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
# Requeue tests: a requeued job may start again at once, and keep its id.
JobRequeue=1
KillWait=5
MinJobAge=300
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

# Slurm 22.05 does not know CgroupPlugin=disabled; autodetect is accepted (task/none, proctrack/linuxproc
# mean no cgroup is used anyway).
cat >"$state_dir/cgroup.conf" <<CONF
CgroupPlugin=autodetect
CONF

munged --socket="$munge_socket" --pid-file="$state_dir/munged.pid" \
    --log-file="$state_dir/log/munged.log" --seed-file="$state_dir/munge/munged.seed" --force
export SLURM_CONF="$state_dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"

# Wait until the node is idle (the controller and slurmd have registered with each other); seconds when the
# machine is idle, much longer at a load average of ~10 on 2 cores.
for _ in $(seq 1 240); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx 'idle'; then
        echo "local slurm up: SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "start.sh: node did not become idle in 120 s; see $state_dir/log/" >&2
sinfo >&2 || true
exit 1
