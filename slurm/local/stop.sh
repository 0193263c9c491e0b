#!/usr/bin/env bash
# Stop the private Slurm started by start.sh STATE_DIR: kill the daemons by their recorded pids.
set -euo pipefail

state_dir=${1:?usage: stop.sh STATE_DIR}
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
