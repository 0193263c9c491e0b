"""``dapo-mcore train|eval --nproc-per-node N CONFIG ...``: one machine, N processes, without torchrun's noise.

Built on torch.distributed.run's own API (``parse_args`` + ``config_from_args`` + ``elastic_launch``, the code
torchrun runs), not a process manager of ours. What it changes for a user:

- the config is validated once, here, before any rank starts: a refusal is one line and exit 2;
- a user error a rank reports later (a checkpoint, a dataset) is printed once, not once per rank: ranks write
  their one line to a file in ``ERROR_DIR_ENV``'s directory and the launcher prints each distinct line;
- the ranks' exit code comes back (2 refused, 75 requeue, 130 Ctrl-C), not torch's ``ChildFailedError``
  traceback and exit 1;
- SIGINT/SIGTERM/SIGUSR1 are forwarded once to every rank's process group (the ranks run in sessions of their
  own, so a terminal's Ctrl-C reaches only this process): the ranks finish the step, checkpoint and exit 130 (75),
  and a second Ctrl-C abandons the step, as in a single process. torchrun instead treats the signal as its own
  death and kills the ranks after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s) seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

ERROR_DIR_ENV = "DAPO_MCORE_ERROR_DIR"
"""Set by the launcher for its ranks: where each rank writes its one-line user error (``rank<N>``)."""
COMMAND_ENV = "DAPO_MCORE_COMMAND"
"""Set by the launcher for its ranks: how the user started ``dapo-mcore`` (``.venv/bin/dapo-mcore``)."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def exit_code_of(exitcode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _worker_pgids() -> list[int]:
    """The process groups of the ranks: each rank is a child of this process and leads a session of its own."""
    import psutil

    pgids = []
    for child in psutil.Process().children():
        try:
            pgids.append(os.getpgid(child.pid))
        except ProcessLookupError:
            continue
    return [g for g in pgids if g != os.getpgid(0)]


def _forward(signum: int, _frame: object) -> None:
    for pgid in _worker_pgids():
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            continue


def _print_rank_errors(error_dir: Path) -> None:
    """Each distinct one-line error the ranks wrote, once, naming the ranks that wrote it."""
    by_line: dict[str, list[str]] = {}
    for path in sorted(error_dir.glob("rank*"), key=lambda p: int(p.name[4:] or 0)):
        line = path.read_text(errors="replace").strip()
        if line:
            by_line.setdefault(line, []).append(path.name[4:])
    for line, ranks in by_line.items():
        which = f" (rank {ranks[0]})" if len(ranks) == 1 else f" (ranks {','.join(ranks)})"
        print(f"{line}{which}" if len(by_line) > 1 else line, file=sys.stderr)


def launch(command: str, nproc: int, config: str, overrides: list[str], extra: list[str],
           flags: list[str] | None = None) -> int:
    """Validate ``config`` for ``nproc`` ranks, then run ``dapo-mcore COMMAND [FLAGS] CONFIG OVERRIDES`` on them (the
    ranks add ``extra``, DAPO_MCORE_EXTRA_OVERRIDES, themselves); their exit code."""
    from dapo_mcore.commands.config import precheck

    # A ConfigError: the caller's one line, exit 2. eval evaluates an async run's checkpoint colocated (as each rank's
    # own check does); the ranks' rank 0 logs the warnings, once.
    checked = [*overrides, *extra, *(["rollout.pipeline.mode=sync"] if command == "eval" else [])]
    cfg = precheck(config, checked, world_size=nproc, warn=False)
    from dapo_mcore.run.checkpoints import finished_step

    if command == "train" and finished_step(cfg) is not None:  # no rank to start for a finished run
        logging.getLogger(__name__).info("run already finished %d steps (%s); nothing to do", finished_step(cfg),
                                         Path(cfg.run.dir) / "checkpoints")
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    for name in list(logging.root.manager.loggerDict):  # torch's own notices ("failed (exitcode: 130)", SIGTERM
        if name.startswith("torch.distributed"):  # sent to rank N, banners): the exit code and our lines say it
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its 5-line banner
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                       "--module", "dapo_mcore.cli", command, *(flags or []), config, *overrides])
    args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"  # what torchrun --standalone does in run()
    args.rdzv_id = f"dapo-mcore-{os.getpid()}"
    args.master_port = args.master_port or 29500
    args.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGINT/SIGTERM/SIGUSR1: forwarded to the ranks, see _forward
    launch_config, cmd, cmd_args = config_from_args(args)
    error_dir = Path(tempfile.mkdtemp(prefix="dapo-mcore-ranks-"))
    os.environ[ERROR_DIR_ENV] = str(error_dir)
    os.environ.setdefault(COMMAND_ENV, sys.argv[0] if Path(sys.argv[0]).name == "dapo-mcore" else "dapo-mcore")
    previous = {sig: signal.signal(sig, _forward) for sig in FORWARDED}
    try:
        elastic_launch(launch_config, cmd)(*cmd_args)
        code = 0
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        code = exit_code_of(failure.exitcode)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _print_rank_errors(error_dir)
        for path in error_dir.iterdir():
            path.unlink()
        error_dir.rmdir()
    return code
