"""Launch dapo-mcore with NeMo-Run: the tiny CPU job locally, the 32B FP8 recipe on Slurm.

    pip install "nemo-run==0.11.1" "leptonai==0.27.3"    # 0.11.1 imports only with leptonai 0.27.3

    # tiny job, 2 processes via torchrun (gloo) on this machine; no activated venv needed
    .venv/bin/python examples/nemo_run/launch.py local --run-dir runs/tiny-nemo
    # the sbatch script NeMo-Run would submit for the 32B recipe, without submitting
    .venv/bin/python examples/nemo_run/launch.py slurm --account ACCT --partition batch --dry-run
    # submit it (from a login node; add --ssh-host/--ssh-user to submit from elsewhere)
    .venv/bin/python examples/nemo_run/launch.py slurm --account ACCT --partition batch --remote-repo /shared/dapo-mcore

Relation to slurm/: NeMo-Run writes its own sbatch script (srun of the command on every task),
so this path does not go through slurm/launch.sh. What stays the same: slurm/env.sh is sourced
in the batch shell (with DAPO_VENV set to the venv to activate: by default the one this launcher runs in),
MASTER_ADDR/MASTER_PORT are exported from the head node, the trainer reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID,
and the layout comes from the same config (examples/qwen2.5-32b-fp8.yaml: TP=8 PP=2, so DP=8 on 16 nodes; check it
with ``dapo-mcore plan examples/qwen2.5-32b-fp8.yaml --nodes 16``).

Logs: NeMo-Run's job directory (sbatch and per-task logs, job metadata) defaults to RUN_DIR/nemo-run inside the
cluster checkout, on shared storage next to the checkpoints, never the login node's /tmp.

Requeue: ``--signal=USR1@3600`` (no ``B:``) lets Slurm signal the tasks directly; the trainer checkpoints and exits 75
(EXIT_REQUEUE). NeMo-Run's own script would requeue any non-zero exit ``retries`` times (a typo's exit 2 included), so
its retries are 0 and the batch shell requeues only a run in which a task exited 75 (examples/slurm_task.py leaves
a marker; srun's own exit code may be 137 after --kill-on-bad-exit), never on SIGTERM (scancel, the time limit), at
most DAPO_MAX_REQUEUES (--max-requeues) times: the contract of slurm/launch.sh.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import nemo_run as run

log = logging.getLogger("dapo_mcore.nemo_run")
REPO = Path(__file__).resolve().parents[2]
# The per-task wrapper, relative to the checkout the tasks run in (--remote-repo). Not in this directory: NeMo-Run
# replaces every "/nemo_run" in the sbatch script with its job directory (its container mount point).
TASK = "examples/slurm_task.py"


class LaunchError(ValueError):
    """A launch that cannot work as asked; the message names the fix."""


def train_args(config: str, run_dir: str, overrides: list[str]) -> list[str]:
    """``-m dapo_mcore.cli train CONFIG run.dir=RUN_DIR OVERRIDES...``"""
    return ["-m", "dapo_mcore.cli", "train", config, f"run.dir={run_dir}", *overrides]


def interpreter_bin() -> Path:
    """The bin directory of the interpreter running this launcher (a venv's, activated or not)."""
    return Path(sys.executable).parent


def local_executor(nproc: int) -> run.LocalExecutor:
    """torchrun with ``nproc`` processes on this machine (gloo on CPU). NeMo-Run calls ``torchrun`` by name: this
    interpreter's bin directory goes first on the job's PATH, so it is the torchrun (and python) of this venv."""
    if not (interpreter_bin() / "torchrun").exists():
        raise LaunchError(f"torchrun not found next to {sys.executable}: install torch into that environment "
                          f"({interpreter_bin() / 'pip'} install torch) or run this launcher with its python")
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun",
                             env_vars={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                                       "PYTHONPATH": str(REPO), "PATH": str(interpreter_bin())})


def local_task(args: argparse.Namespace, overrides: list[str]) -> run.Script:
    if args.script:
        return run.Script(path=args.script, args=[args.run_dir, *overrides], entrypoint="python")
    train = train_args(args.config, args.run_dir, ["parallel.tensor_parallel=2", *overrides])
    return run.Script(path=train[1], args=train[2:], entrypoint="python", m=True)


def default_job_dir(remote_repo: str, run_dir: str) -> str:
    """RUN_DIR/nemo-run inside the cluster checkout: shared storage, beside the run's checkpoints."""
    run_path = Path(run_dir)
    return str((run_path if run_path.is_absolute() else Path(remote_repo) / run_path) / "nemo-run")


def requeue_lines(job_dir: str) -> list[str]:
    """Batch-shell lines: requeue on exit only if a task exited 75 in this run (its marker exists), never after
    SIGTERM (scancel or the time limit), at most DAPO_MAX_REQUEUES restarts (slurm/env.sh, launch.sh's contract)."""
    marker = shlex.quote(f"{job_dir}/requeue") + '/"$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"'
    on_exit = ('dapo_rc=$?; '
               'if [ -e "$DAPO_REQUEUE_MARKER" ] && [ -z "${dapo_terminating:-}" ]; then '
               'if [ "${SLURM_RESTART_COUNT:-0}" -lt "$DAPO_MAX_REQUEUES" ]; then '
               'echo "dapo: a task exited $DAPO_REQUEUE_EXIT_CODE (checkpointed): requeueing job $SLURM_JOB_ID"; '
               'scontrol requeue "$SLURM_JOB_ID"; '
               'else echo "dapo: requeue requested but the job already restarted $DAPO_MAX_REQUEUES times"; fi; '
               'fi; exit $dapo_rc')
    return [f"export DAPO_REQUEUE_MARKER={marker}",
            "trap 'dapo_terminating=1' TERM",
            f"trap {shlex.quote(on_exit)} EXIT"]


def slurm_seconds(limit: str) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, clock = limit.split("-", 1) if "-" in limit else ("0", limit)
    try:
        day, parts = int(days), [int(x) for x in clock.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3:
        raise LaunchError(f"--time {limit!r} is not a Slurm time limit: use HH:MM:SS or D-HH:MM:SS")
    if "-" in limit:
        hours, minutes, secs = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, secs = parts
    else:
        hours, minutes, secs = 0, parts[0], parts[1] if len(parts) == 2 else 0
    return ((day * 24 + hours) * 60 + minutes) * 60 + secs


def slurm_executor(args: argparse.Namespace) -> run.SlurmExecutor:
    """16 nodes x 8 H100 by default, one task per GPU, the pre-emption signal, requeue on exit 75 only."""
    if args.signal_seconds >= slurm_seconds(args.time):
        raise LaunchError(f"--signal-seconds {args.signal_seconds} is not less than --time {args.time}: Slurm would "
                          "send the pre-emption warning at the start; lower --signal-seconds (one step plus a "
                          "checkpoint) or raise --time")
    if args.job_dir.startswith(tempfile.gettempdir() + os.sep):
        log.warning("--job-dir %s is node-local on most clusters: the job's logs will not be where you look; "
                    "put it on shared storage (default: RUN_DIR/nemo-run in --remote-repo)", args.job_dir)
    # NeMo-Run puts each experiment under TUNNEL_JOB_DIR/<title>/<id>; submitting from this machine, it writes the
    # sbatch script into its local experiment dir, BASE_DIR/experiments/<title>/<id> (launch_slurm), the same place.
    jobs = os.path.join(args.job_dir, "experiments")
    if args.ssh_host:
        tunnel = run.SSHTunnel(host=args.ssh_host, user=args.ssh_user, job_dir=jobs)
    else:
        tunnel = run.LocalTunnel(job_dir=jobs)
    env_vars = {"MASTER_ADDR": "$head_node_ip",
                "MASTER_PORT": "$((${DAPO_MASTER_PORT_BASE:-20000} + SLURM_JOB_ID % 10000))",
                "PYTHONPATH": shlex.quote(args.remote_repo), "DAPO_MAX_REQUEUES": str(args.max_requeues)}
    if args.venv:
        env_vars["DAPO_VENV"] = shlex.quote(args.venv)
    executor = run.SlurmExecutor(
        account=args.account, partition=args.partition, job_name_prefix="dapo-", nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node, gpus_per_node=args.gpus_per_node or None,
        cpus_per_task=args.cpus_per_task, mem=args.mem, exclusive=True, time=args.time,
        signal=f"USR1@{args.signal_seconds}", container_image=args.container_image, tunnel=tunnel,
        # A shared-filesystem checkout: no code packaging; the later --chdir wins over NeMo-Run's own.
        packager=run.Packager(), srun_args=["--chdir", args.remote_repo],
        setup_lines="\n".join([f"source {shlex.quote(args.remote_repo)}/slurm/env.sh", *requeue_lines(args.job_dir)]),
        env_vars=env_vars,
    )
    executor.retries = 0  # NeMo-Run's script would requeue ANY non-zero exit: requeue_lines decides instead
    return executor


def slurm_task(args: argparse.Namespace, overrides: list[str]) -> run.Script:
    """``python examples/slurm_task.py -m dapo_mcore.cli train ...`` (or ``slurm_task.py SCRIPT RUN_DIR``) per task."""
    inner = [args.script, args.run_dir, *overrides] if args.script else train_args(args.config, args.run_dir, overrides)
    return run.Script(path=TASK, args=inner, entrypoint="python")


def render_sbatch(executor: run.SlurmExecutor, task: run.Script, name: str) -> str:
    """The sbatch script NeMo-Run would submit (its dry run writes it into the experiment dir)."""
    with run.Experiment(name, executor=executor, log_level="WARN") as exp:
        exp.add(task, name=name)
        exp.dryrun(log=False, delete_exp_dir=False)
        exp_dir = Path(exp._exp_dir)  # noqa: SLF001 (the dry run writes the script there, nowhere else)
        scripts = sorted(exp_dir.rglob("*_sbatch.sh"))
        if len(scripts) != 1:
            raise RuntimeError(f"expected one sbatch script under {exp_dir}, found {scripts}")
        text = scripts[0].read_text()
        shutil.rmtree(exp_dir)
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="where", required=True)
    local = sub.add_parser("local", help="the tiny CPU job with LocalExecutor (torchrun)")
    local.add_argument("--run-dir", default="runs/tiny-nemo")
    local.add_argument("--config", default="examples/tiny_cpu.yaml")
    local.add_argument("--nproc", type=int, default=2)
    local.add_argument("--script", default=None,
                       help="run this python script with torchrun instead of the trainer (e.g. slurm/probe.py); "
                            "its arguments: the run dir, then the rest of the command line")
    local.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    slurm = sub.add_parser("slurm", help="the Qwen2.5-32B FP8 recipe with SlurmExecutor")
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--nodes", type=int, default=16)
    slurm.add_argument("--ntasks-per-node", type=int, default=8, help="one task per GPU")
    slurm.add_argument("--gpus-per-node", type=int, default=8, help="0: request no GPUs (a CPU test cluster)")
    slurm.add_argument("--cpus-per-task", type=int, default=12)
    slurm.add_argument("--mem", default="0", help="per node; 0: all of it")
    slurm.add_argument("--time", default="12:00:00")
    slurm.add_argument("--signal-seconds", type=int, default=3600,
                       help="pre-emption warning: at least one step (~26 min for 32B) plus the checkpoint")
    slurm.add_argument("--max-requeues", type=int, default=20, help="DAPO_MAX_REQUEUES: restarts after exit 75")
    slurm.add_argument("--config", default="examples/qwen2.5-32b-fp8.yaml")
    slurm.add_argument("--run-dir", default="runs/dapo-32b-fp8")
    slurm.add_argument("--script", default=None,
                       help="run this python script on every task instead of the trainer (e.g. slurm/probe.py); "
                            "its arguments: the run dir, then the rest of the command line")
    slurm.add_argument("--remote-repo", default=str(REPO), help="the dapo-mcore checkout on the cluster")
    slurm.add_argument("--venv", default=sys.prefix if sys.prefix != sys.base_prefix else None,
                       help="the virtualenv the tasks activate (DAPO_VENV; default: the one running this launcher)")
    slurm.add_argument("--job-dir", default=None,
                       help="NeMo-Run's job metadata and logs, on shared storage (default: RUN_DIR/nemo-run)")
    slurm.add_argument("--container-image", default=None)
    slurm.add_argument("--ssh-host", default=None)
    slurm.add_argument("--ssh-user", default=None)
    slurm.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    return parser


def launch_local(args: argparse.Namespace, overrides: list[str]) -> int:
    task, executor = local_task(args, overrides), local_executor(args.nproc)
    with run.Experiment("dapo-tiny-local", executor=executor, log_level="WARN") as exp:
        exp.add(task, name="tiny")
        if args.dry_run:
            exp.dryrun()
            return 0
        exp.run(sequential=True, tail_logs=False)
    states = [str(job.status(exp._runner)) for job in exp.jobs]  # noqa: SLF001 (no public runner accessor)
    print(f"job states: {states}")
    return 0 if all(s.endswith("SUCCEEDED") for s in states) else 1


def launch_slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    args.job_dir = args.job_dir or default_job_dir(args.remote_repo, args.run_dir)
    task, executor = slurm_task(args, overrides), slurm_executor(args)
    if args.dry_run:
        print(render_sbatch(executor, task, "32b-fp8"))
        return 0
    base_dir = None if args.ssh_host else args.job_dir  # see slurm_executor: the experiment dir is the job dir
    with run.Experiment("32b-fp8", executor=executor, log_level="WARN", base_dir=base_dir) as exp:
        exp.add(task, name="32b-fp8")
        exp.run(detach=True)
        exp._skip_status_at_exit = True  # noqa: SLF001 (its status reads sacct, which clusters may not have)
    handle = exp.jobs[0].handle
    print(f"submitted slurm job {handle.rsplit('/', 1)[-1]}; logs in {args.job_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args, overrides = build_parser().parse_known_args(argv)
    try:
        return launch_local(args, overrides) if args.where == "local" else launch_slurm(args, overrides)
    except LaunchError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
