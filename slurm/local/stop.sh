#!/usr/bin/env bash
# Stop the private Slurm started by start.sh STATE_DIR: kill the daemons by their recorded pids.
set -euo pipefail

state_dir=${1:?usage: stop.sh STATE_DIR}

# Jobs still queued or running (a hung test job, a requeued one) are cancelled through the controller first:
# slurmstepd and the tasks outlive slurmd, and a hung task would keep its rendezvous port. scancel escalates
# to SIGKILL after KillWait (5 s in start.sh's slurm.conf).
ctld_pid_file="$state_dir/slurmctld.pid"
if [[ -f "$state_dir/slurm.conf" && -s "$ctld_pid_file" ]] && kill -0 "$(<"$ctld_pid_file")" 2>/dev/null; then
    export SLURM_CONF="$state_dir/slurm.conf"
    mapfile -t jobs < <(squeue -h -o %A)
    if (( ${#jobs[@]} )); then
        echo "stop.sh: cancelling jobs left in the local cluster: ${jobs[*]}" >&2
        scancel "${jobs[@]}"
        for _ in $(seq 1 60); do
            [[ -z "$(squeue -h -o %A)" ]] && break
            sleep 0.5
        done
    fi
fi
for daemon in slurmd slurmctld munged; do
    pid_file="$state_dir/$daemon.pid"
    [[ -s "$pid_file" ]] || continue
    pid=$(<"$pid_file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "stop.sh: $daemon (pid $pid) ignored SIGTERM; sending SIGKILL" >&2
            kill -KILL "$pid"
        fi
    fi
    rm -f "$pid_file"
done
