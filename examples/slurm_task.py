"""One Slurm task of a NeMo-Run job (examples/nemo_run/launch.py): run a module or script in this process and flag a requeue request.

    python examples/slurm_task.py -m dapo_mcore.cli train CONFIG ...
    python examples/slurm_task.py slurm/probe.py OUT_DIR

The trainer checkpoints on the pre-emption signal and exits 75 (``EXIT_REQUEUE``, EX_TEMPFAIL) on every rank. srun runs
with ``--kill-on-bad-exit=1`` (NeMo-Run's default), so the first rank to exit 75 gets its peers killed and srun may
report 128+9 rather than 75: the batch shell cannot tell a requeue request from a crash by srun's exit code. So a task
that exits with the requeue code creates the file ``$DAPO_REQUEUE_MARKER`` (on shared storage, one per job run), and
the batch shell's exit trap (examples/nemo_run/launch.py) requeues only when it exists. The command runs in this process (runpy), so the
pre-emption signal reaches the trainer's own handlers directly. RANK/WORLD_SIZE/LOCAL_RANK are set from Slurm's
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID where unset, so a plain ``env://`` script (slurm/probe.py) runs as well as the
trainer (which reads either).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REQUEUE_EXIT_CODE = 75  # dapo_mcore.trainer.EXIT_REQUEUE, slurm/env.sh's DAPO_REQUEUE_EXIT_CODE


def _exit_code(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` would give (a message goes to stderr, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _torch_env_from_slurm() -> None:
    for torch_var, slurm_var in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"),
                                 ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm_var in os.environ:
            os.environ.setdefault(torch_var, os.environ[slurm_var])


def main(argv: list[str]) -> int:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: slurm_task.py -m MODULE [ARGS...] | slurm_task.py SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    _torch_env_from_slurm()
    requeue_code = int(os.environ.get("DAPO_REQUEUE_EXIT_CODE", REQUEUE_EXIT_CODE))
    module = argv[1] if argv[0] == "-m" else None
    target = module or argv[0]
    sys.argv = [target, *argv[2 if module else 1:]]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    marker = os.environ.get("DAPO_REQUEUE_MARKER")
    if code == requeue_code and marker:
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).touch()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
