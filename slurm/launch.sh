#!/usr/bin/env bash
# The one launch path of every dapo-mcore job: run COMMAND once per task (one task per GPU) with
# torch.distributed's env rendezvous, forward the pre-emption signal, and requeue on request.
#
# Usage (inside an sbatch allocation):  slurm/launch.sh COMMAND [ARGS...]
#   e.g. slurm/launch.sh dapo-mcore train examples/qwen2.5-7b.yaml run.dir=/runs/x
#
# Rendezvous: MASTER_ADDR = first host of `scontrol show hostnames $SLURM_JOB_NODELIST`,
# MASTER_PORT = DAPO_MASTER_PORT_BASE + SLURM_JOB_ID % 10000 (per job, so jobs sharing a node do not
# collide; a requeued job keeps its id and port). Each task gets RANK/LOCAL_RANK/WORLD_SIZE from
# SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, so any torch `env://` program works unchanged.
# Before the tasks start, one probe task per node checks that COMMAND resolves there (PATH, DAPO_VENV,
# the container of DAPO_SRUN_ARGS): a node without it stops the job in one line, exit 2.
#
# Signals and requeue (contract with the trainer):
#   The sbatch scripts ask for `--signal=B:USR1@<secs>`: Slurm signals only this batch shell, which
#   is waiting on srun in the background. The trap forwards USR1 with `kill -USR1 <srun pid>`; srun
#   relays it to every task of the step on every node. (`scancel --signal=USR1 --batch` would signal
#   the batch shell again, not the tasks; without `B:` Slurm would signal the tasks directly but this
#   shell would not know a requeue was asked for, and a signal arriving before srun starts would be
#   lost.) The trainer finishes its step, checkpoints and exits 75 (EX_TEMPFAIL); then this script
#   runs `scontrol requeue $SLURM_JOB_ID` and the job restarts later under the same id, resuming
#   from the latest checkpoint. Only that exit code requeues: any other failure (a typo in the config
#   exits 2, a crash 1, a task killed by a signal) ends the job with its code, signal or not.
#   srun is started with --kill-on-bad-exit=1, so the first rank to exit 75 gets its peers sent SIGTERM
#   (SIGKILL after Slurm's KillWait). srun reports the highest exit code, but a task that died of a
#   signal outranks every exit code; so each task's wrapper shell outlives that SIGTERM (the command
#   gets it too, from slurmstepd) and exits with the command's own status: 75, not 128+15.
#   A rank that hangs: its peers' collectives time out (parallel.timeout_minutes), they name it and exit 75;
#   srun's SIGTERM cannot end it, so its wrapper kills it after DAPO_TASK_KILL_GRACE s and exits 1 (below 75).
#   DAPO_MAX_REQUEUES bounds the restarts.
#   SIGTERM (scancel, or the time limit without a USR1 warning) is forwarded too, so the trainer can
#   checkpoint, but never leads to a requeue: the job is being ended on purpose, and requeueing it
#   would turn a user's `scancel` into a restart two minutes later.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=env.sh
source "$here/env.sh"

log() { echo "[launch.sh $(date '+%F %T')] $*" >&2; }

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    log "not inside a Slurm allocation: submit an sbatch script from slurm/ (or use salloc)"
    exit 2
fi
if (( $# == 0 )); then
    log "usage: launch.sh COMMAND [ARGS...], e.g. launch.sh dapo-mcore train examples/qwen2.5-7b.yaml run.dir=RUN_DIR"
    exit 2
fi

# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch/salloc: without this each task
# gets one core, shared by its rank, its reward workers and vLLM's scheduler thread.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
fi

mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${MASTER_ADDR:-${hosts[0]}}
export MASTER_PORT=${MASTER_PORT:-$(( DAPO_MASTER_PORT_BASE + SLURM_JOB_ID % 10000 ))}
log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_NTASKS} tasks on ${#hosts[@]} node(s)," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, command: $*"

srun_pid=""
warned=""       # USR1: the pre-emption warning, a requeue request
terminating=""  # TERM: scancel or the time limit, never requeued
# shellcheck disable=SC2317  # invoked by the traps below
forward() {
    local sig=$1
    if [[ "$sig" == USR1 ]]; then warned=1; else terminating=1; fi
    if [[ -n "$srun_pid" ]] && kill -0 "$srun_pid" 2>/dev/null; then
        log "got SIG$sig: forwarding to srun (pid $srun_pid)"
        kill -s "$sig" "$srun_pid" || log "srun exited before SIG$sig could be forwarded"
    else
        log "got SIG$sig before/after the step ran: nothing to forward"
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# DAPO_SRUN_ARGS is split as a shell splits words: quotes keep a space inside one argument
# (DAPO_SRUN_ARGS="--container-image=/shared/img.sqsh '--container-mounts=/shared/my data:/data'"), not on every space.
extra_srun_args=()
if [[ -n "${DAPO_SRUN_ARGS:-}" ]]; then
    if ! xargs -r printf '%s\0' <<<"$DAPO_SRUN_ARGS" >/dev/null 2>&1; then
        log "DAPO_SRUN_ARGS has an unmatched quote: $DAPO_SRUN_ARGS"
        exit 2
    fi
    mapfile -d '' -t extra_srun_args < <(xargs -r printf '%s\0' <<<"$DAPO_SRUN_ARGS")
fi

# One probe task per node, in the tasks' own environment (and container): does COMMAND resolve there?
# Checked before the real step, so a node without the venv stops the job in one line instead of
# failing one of 128 tasks after the others have loaded their models.
# shellcheck disable=SC2016  # expanded by each probe task
if ! missing=$(srun --nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node=1 \
        --kill-on-bad-exit=0 "${extra_srun_args[@]}" \
        bash -c 'command -v "$1" >/dev/null 2>&1 || echo "$(hostname)"' dapo-check "$1"); then
    log "the per-node check of '$1' could not run (srun failed; see above)"
    exit 2
fi
if [[ -n "$missing" ]]; then
    log "'$1' is not on PATH on node(s) $(echo "$missing" | sort -u | paste -sd, -): activate the venv there" \
        "(DAPO_VENV in slurm/env.sh, or PATH), or put it in the container of DAPO_SRUN_ARGS"
    exit 2
fi

# A task that does not exit within DAPO_TASK_KILL_GRACE s of the step's SIGTERM (a hung rank: stopped, frozen,
# stuck in a kernel) is killed by its wrapper, which then exits 1: left to Slurm, it would be SIGKILLed after
# KillWait and srun would report the signal (137), which outranks the 75 of the peers that detected the hang.
# Default: KillWait - 2 s (Slurm's SIGKILL comes at KillWait).
if [[ -z "${DAPO_TASK_KILL_GRACE:-}" ]]; then
    kill_wait=$(scontrol show config 2>/dev/null | awk '$1 == "KillWait" {print $3}') || true
    [[ "$kill_wait" =~ ^[0-9]+$ ]] || kill_wait=30
    DAPO_TASK_KILL_GRACE=$(( kill_wait > 3 ? kill_wait - 2 : 1 ))
fi
export DAPO_TASK_KILL_GRACE

# One task per allocated task slot (the sbatch scripts ask for one per GPU). The bash wrapper exports
# torch's env names and runs the command (in the background, so that its traps run at once); its traps
# keep it alive through the SIGTERM/SIGUSR1 that slurmstepd sends every process of the step (the command
# receives them itself), so the task's status is the command's exit code (see "Signals and requeue" above).
# The first SIGTERM starts the kill timer above.
# shellcheck disable=SC2016  # the $SLURM_* and $child variables are expanded per task, not here
read -r -d '' task_wrapper <<'WRAPPER' || true
export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-$SLURM_NTASKS}
killer=""
on_term() {
    [[ -n "$killer" ]] && return 0
    ( trap '' TERM USR1
      sleep "$DAPO_TASK_KILL_GRACE" &
      timer=$!
      trap 'kill -KILL "$timer" 2>/dev/null; exit 0' USR2
      wait "$timer"
      kill -0 "$child" 2>/dev/null || exit 0
      echo "[launch.sh $(date '+%F %T')] rank $RANK on $(hostname) did not exit within" \
          "${DAPO_TASK_KILL_GRACE}s of SIGTERM (hung?): killing it (SIGKILL); its task exits 1" >&2
      kill -KILL $(cat /proc/"$child"/task/*/children 2>/dev/null) "$child" 2>/dev/null ) &
    killer=$!
}
trap 'early=1' TERM  # until $child is known (on_term's own `&` would change $! before it is read)
trap : USR1
# The command's status comes back in a file: a trapped SIGTERM makes `wait` return 143 at once, and when the command
# exits in that moment bash has reaped it and a second `wait` loses the status (75 would become 143: no requeue).
# $child is a subshell that runs the command in the foreground: its own TERM/USR1 traps run only after the command
# ends (bash defers them), and a trap, unlike an ignored signal, is reset to the default in the command.
status_file=$(mktemp "${TMPDIR:-/tmp}/dapo-task-status.XXXXXX")
( trap - INT QUIT; trap : TERM USR1; "$@"; echo "$?" >"$status_file" ) <&0 &
child=$!
trap on_term TERM
[[ -n "${early:-}" ]] && on_term
while true; do
    wait "$child" && rc=0 || rc=$?
    kill -0 "$child" 2>/dev/null || break
done
[[ -s "$status_file" ]] && rc=$(<"$status_file")
rm -f "$status_file"
if [[ -n "$killer" ]]; then
    kill -USR2 "$killer" 2>/dev/null || true  # the command ended: stop the timer
    (( rc == 137 )) && exit 1
fi
exit "$rc"
WRAPPER
srun --kill-on-bad-exit=1 "${extra_srun_args[@]}" bash -c "$task_wrapper" dapo-task "$@" &
srun_pid=$!

# A trapped signal makes `wait` return early (status > 128) while srun still runs: wait again.
rc=0
while true; do
    wait "$srun_pid" && rc=0 || rc=$?
    if kill -0 "$srun_pid" 2>/dev/null; then
        continue
    fi
    break
done
srun_pid=""
log "step exited with $rc"

if (( rc == 0 )); then
    exit 0
fi
if [[ -n "$terminating" ]]; then
    log "terminated by SIGTERM (scancel or time limit): not requeueing"
    exit "$rc"
fi
if (( rc == DAPO_REQUEUE_EXIT_CODE )); then
    restarts=${SLURM_RESTART_COUNT:-0}
    if (( restarts >= DAPO_MAX_REQUEUES )); then
        log "requeue requested but the job already restarted $restarts times (DAPO_MAX_REQUEUES); giving up"
        exit "$rc"
    fi
    log "requeueing job $SLURM_JOB_ID (restart $(( restarts + 1 )))"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if [[ -n "$warned" ]]; then
    log "a requeue was asked for (SIGUSR1) but the step failed with $rc, not $DAPO_REQUEUE_EXIT_CODE: not requeueing"
fi
exit "$rc"
