"""Launch dapo-mcore with NeMo-Run: the tiny CPU job locally, the 32B FP8 recipe on Slurm.

    pip install "nemo-run==0.11.1" "leptonai==0.27.3"    # 0.11.1 imports only with leptonai 0.27.3

    # tiny job, 2 processes via torchrun (gloo) on this machine
    python examples/nemo_run/launch.py local --run-dir runs/tiny-nemo
    # the sbatch script NeMo-Run would submit for the 32B recipe, without submitting
    python examples/nemo_run/launch.py slurm --account ACCT --partition batch --dry-run
    # submit it (from a login node; add --ssh-host/--ssh-user to submit from elsewhere)
    python examples/nemo_run/launch.py slurm --account ACCT --partition batch --remote-repo /shared/dapo-mcore

Relation to slurm/: NeMo-Run writes its own sbatch script (srun of the command on every task),
so this path does not go through slurm/launch.sh. What stays the same: slurm/env.sh is sourced
in the batch shell, MASTER_ADDR/MASTER_PORT are exported from the head node, the trainer reads
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, and the layout comes from the same config
(examples/qwen2.5-32b-fp8.yaml: TP=8 PP=2, so DP=8 on 16 nodes; check it with
``dapo-mcore plan examples/qwen2.5-32b-fp8.yaml --nodes 16``). The requeue differs: the script NeMo-Run generates does not
trap signals, so ``--signal=USR1@3600`` (no ``B:``) lets Slurm signal the step's tasks directly;
the trainer checkpoints and exits 75, and NeMo-Run's script requeues any non-zero exit while
``SLURM_RESTART_COUNT < retries``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import nemo_run as run

REPO = Path(__file__).resolve().parents[2]

def train_task(config: str, run_dir: str, overrides: list[str]) -> run.Script:
    """``python -m dapo_mcore.cli train CONFIG run.dir=RUN_DIR OVERRIDES...`` as a NeMo-Run script."""
    return run.Script(path="dapo_mcore.cli", args=["train", config, f"run.dir={run_dir}", *overrides],
                      entrypoint="python", m=True)


def local_executor(nproc: int) -> run.LocalExecutor:
    """torchrun with ``nproc`` processes on this machine (gloo on CPU)."""
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun",
                             env_vars={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                                       "PYTHONPATH": str(REPO)})


def slurm_executor(args: argparse.Namespace) -> run.SlurmExecutor:
    """16 nodes x 8 H100, one task per GPU, pre-emption signal and requeue as in slurm/."""
    if args.ssh_host:
        tunnel = run.SSHTunnel(host=args.ssh_host, user=args.ssh_user, job_dir=args.job_dir)
    else:
        tunnel = run.LocalTunnel(job_dir=args.job_dir)
    executor = run.SlurmExecutor(
        account=args.account, partition=args.partition, job_name_prefix="dapo-", nodes=args.nodes, ntasks_per_node=8, gpus_per_node=8,
        cpus_per_task=12, mem="0", exclusive=True, time=args.time, signal=f"USR1@{args.signal_seconds}",
        container_image=args.container_image, tunnel=tunnel,
        # A shared-filesystem checkout: no code packaging; the later --chdir wins over NeMo-Run's own.
        packager=run.Packager(), srun_args=["--chdir", args.remote_repo],
        setup_lines=f"source {shlex.quote(args.remote_repo)}/slurm/env.sh",
        env_vars={"MASTER_ADDR": "$head_node_ip", "MASTER_PORT": "$((20000 + SLURM_JOB_ID % 10000))",
                  "PYTHONPATH": args.remote_repo},
    )
    executor.retries = args.max_requeues
    return executor


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
                       help="run this python script with torchrun instead of the trainer (e.g. slurm/probe.py)")
    local.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    slurm = sub.add_parser("slurm", help="the Qwen2.5-32B FP8 recipe with SlurmExecutor")
    slurm.add_argument("--account", required=True)
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--nodes", type=int, default=16)
    slurm.add_argument("--time", default="12:00:00")
    slurm.add_argument("--signal-seconds", type=int, default=3600,
                       help="pre-emption warning: at least one step (~26 min for 32B) plus the checkpoint")
    slurm.add_argument("--max-requeues", type=int, default=20)
    slurm.add_argument("--config", default="examples/qwen2.5-32b-fp8.yaml")
    slurm.add_argument("--run-dir", default="runs/dapo-32b-fp8")
    slurm.add_argument("--remote-repo", default=str(REPO), help="the dapo-mcore checkout on the cluster")
    slurm.add_argument("--job-dir", default=os.path.join(tempfile.gettempdir(), "nemo-run-jobs"),
                       help="where NeMo-Run keeps job metadata and logs (on the cluster)")
    slurm.add_argument("--container-image", default=None)
    slurm.add_argument("--ssh-host", default=None)
    slurm.add_argument("--ssh-user", default=None)
    slurm.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    if args.where == "local":
        if args.script:
            task = run.Script(path=args.script, args=[args.run_dir], entrypoint="python")
        else:
            task = train_task(args.config, args.run_dir, ["parallel.tensor_parallel=2", *overrides])
        executor = local_executor(args.nproc)
        with run.Experiment("dapo-tiny-local", executor=executor, log_level="WARN") as exp:
            exp.add(task, name="tiny")
            if args.dry_run:
                exp.dryrun()
                return 0
            exp.run(sequential=True, tail_logs=False)
        states = [str(job.status(exp._runner)) for job in exp.jobs]  # noqa: SLF001 (no public runner accessor)
        print(f"job states: {states}")
        return 0 if all(s.endswith("SUCCEEDED") for s in states) else 1
    task = train_task(args.config, args.run_dir, overrides)
    executor = slurm_executor(args)
    if args.dry_run:
        print(render_sbatch(executor, task, "32b-fp8"))
        return 0
    run.run(task, executor=executor, name="32b-fp8", detach=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
