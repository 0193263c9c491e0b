"""``dapo-mcore train|eval --nproc-per-node N CONFIG ...``: one machine, N processes, without torchrun's noise.

Built on torch.distributed.run's own API (``parse_args`` + ``config_from_args`` + ``elastic_launch``, the code
torchrun runs), not a process manager of ours. What it changes for a user:

- the config is validated once, here, before any rank starts: a refusal is one line and exit 2;
- a user error a rank reports later (a checkpoint, a dataset) is printed once, not once per rank: ranks write
  their one line to a file in ``ERROR_DIR_ENV``'s directory and the launcher prints each distinct line;
- the ranks' exit code comes back (2 refused, 75 requeue, 130 Ctrl-C), not torch's ``ChildFailedError``
  traceback and exit 1;
- SIGINT/SIGTERM/SIGUSR1/SIGHUP are forwarded once to every rank's process group (the ranks run in sessions of
  their own, so a terminal's Ctrl-C reaches only this process): the ranks finish the step, checkpoint and exit 130
  (75), and a second Ctrl-C abandons the step, as in a single process. torchrun instead treats the signal as its
  own death and kills the ranks after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s) seconds;
- a rank that dies (killed, out of memory) is named at once in one line and the other ranks are stopped
  (`RankWatch`), instead of torch's SIGTERM to them (which they would take for a stop request) and a 30 s wait;
- the ranks die with the launcher (``PR_SET_PDEATHSIG``, `bind_to_launcher`): a ``kill -9`` of it leaves no rank
  holding devices and the run's lock.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

ERROR_DIR_ENV = "DAPO_MCORE_ERROR_DIR"
"""Set by the launcher for its ranks: where each rank writes its one-line user error (``rank<N>``)."""
COMMAND_ENV = "DAPO_MCORE_COMMAND"
"""Set by the launcher for its ranks: how the user started ``dapo-mcore`` (``.venv/bin/dapo-mcore``)."""
LAUNCHER_PID_ENV = "DAPO_MCORE_LAUNCHER_PID"
"""Set by the launcher for its ranks: its pid, whose death kills them (`bind_to_launcher`)."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def bind_to_launcher() -> None:
    """In a rank: die (SIGKILL) when the launcher that started it dies, whatever killed it. A launcher already gone
    before this ran (the rank is an orphan by now) means exit at once."""
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        logging.getLogger(__name__).warning("PR_SET_PDEATHSIG failed (errno %d): this rank outlives a killed "
                                            "launcher", ctypes.get_errno())
        return
    if os.getppid() != int(expected):
        os._exit(137)


class RankWatch:
    """Watches the ranks (this process's children) for one that dies of a signal while the others run: names it in
    one line at once, then SIGKILLs the others' process groups (nothing of the run is lost beyond its last
    checkpoint; a peer gone means the others would only wait in a collective). A rank's exit code is read from
    /proc without reaping it, so torch's own bookkeeping still sees it."""

    def __init__(self, command: str, interval_s: float = 0.2) -> None:
        self.command, self.interval_s = command, interval_s
        self.code: int | None = None
        self._ranks: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dapo-mcore-rank-watch", daemon=True)

    def __enter__(self) -> RankWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.code is None:
            self.check()

    def check(self) -> int | None:
        """One look at the children; the dead rank's exit code (128 + signal) once one died, else None."""
        import psutil

        children = psutil.Process().children()
        dead = []
        for child in children:
            if child.pid not in self._ranks:
                try:
                    self._ranks[child.pid] = child.environ().get("RANK", "")
                except (psutil.Error, OSError):
                    continue
            if not self._ranks[child.pid]:  # not a rank (a helper process of whoever called launch): not ours to judge
                continue
            signum = _killed_by(child.pid)
            if signum is not None:
                dead.append((child.pid, signum))
        if not dead:
            return None
        # Torch's agent may have seen the death first and sent the others SIGTERM before this look: a rank killed by
        # anything else is the one that died first (a loaded machine made this look name the SIGTERMed peer instead).
        pid, signum = next((d for d in dead if d[1] != signal.SIGTERM), dead[0])
        self.code = 128 + signum
        own = os.getpgid(0)
        for child in children:
            if child.pid != pid and self._ranks.get(child.pid):
                try:
                    group = os.getpgid(child.pid)
                    if group == own:  # a child in this process's own group: stop it alone, never the group (us)
                        os.kill(child.pid, signal.SIGKILL)
                    else:
                        os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
        print(dead_rank_line(self._ranks.get(pid, "?"), signum, self.command), file=sys.stderr, flush=True)
        return self.code


def dead_rank_line(rank: object, signum: int, command: str) -> str:
    """The launcher's one line for a rank that died of signal `signum` (the others' lines only say a peer left)."""
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
    after = ("the same command resumes the run from its last checkpoint" if command == "train"
             else "run the same command again")
    why = "out of memory: see the kernel log" if signum == 9 else "a crash"
    return (f"dapo-mcore: rank {rank} died of {name} (exit {128 + signum}); the other ranks were stopped. Its log "
            f"above may say why ({why}); {after}")


def _killed_by(pid: int) -> int | None:
    """The signal that killed zombie child `pid` (from /proc/PID/stat's exit code, not reaped), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])  # field 52 of the file: the waitpid status
    return status & 0x7F or None


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


_forwarded: list[int] = []
"""The stop signals this launcher received and passed on to the ranks (none: any stop a rank reports came from
torch stopping the others after one rank failed)."""


def _forward(signum: int, _frame: object) -> None:
    _forwarded.append(signum)
    for pgid in _worker_pgids():
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            continue


def _print_rank_errors(error_dir: Path, *, signalled: bool = True) -> None:
    """Each distinct one-line error the ranks wrote, once, naming the ranks that wrote it. Not `signalled` (the
    launcher passed no stop signal on): a rank's "SIGTERM during start-up ... exiting 75" is torch stopping it after
    another rank failed, not a requeue, so it is left out beside that rank's line (a refusal, exit 2)."""
    from dapo_mcore.signals.startup import STOP_LINE

    stop_prefix, stop_tail = STOP_LINE.split("{name}")[0], STOP_LINE.split("{sender}")[1][:40]
    by_line: dict[str, list[str]] = {}
    for path in sorted(error_dir.glob("rank*"), key=lambda p: int(p.name[4:] or 0)):
        line = path.read_text(errors="replace").strip()
        if line:
            by_line.setdefault(line, []).append(path.name[4:])
    stops = [ln for ln in by_line if ln.startswith(stop_prefix) and stop_tail in ln]
    if not signalled and len(stops) < len(by_line):
        by_line = {ln: ranks for ln, ranks in by_line.items() if ln not in stops}
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
    args.monitor_interval = 1.0  # RankWatch looks every 0.2 s: it names a dead rank before torch stops the others
    args.master_port = args.master_port or 29500
    args.signals_to_handle = "SIGQUIT"  # SIGINT/SIGTERM/SIGUSR1/SIGHUP: forwarded to the ranks, see _forward
    launch_config, cmd, cmd_args = config_from_args(args)
    error_dir = Path(tempfile.mkdtemp(prefix="dapo-mcore-ranks-"))
    os.environ[ERROR_DIR_ENV] = str(error_dir)
    os.environ.setdefault(COMMAND_ENV, sys.argv[0] if Path(sys.argv[0]).name == "dapo-mcore" else "dapo-mcore")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    from dapo_mcore.signals import startup

    startup.disarm()  # armed through the imports (cli): from here signals go to the ranks, which must not inherit
    _forwarded.clear()  # the blocked signal mask
    previous = {sig: signal.signal(sig, _forward) for sig in FORWARDED}
    watch = RankWatch(command)
    try:
        with watch:
            elastic_launch(launch_config, cmd)(*cmd_args)
        code = 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = watch.code if watch.code is not None else exit_code_of(failure.exitcode)
        if watch.code is None and failure.exitcode < 0 and -failure.exitcode not in FORWARDED:
            # torch reaped the dead rank before the watch looked: name it from torch's record, as the watch would
            watch.code = code
            print(dead_rank_line(rank, -failure.exitcode, command), file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if watch.code is None:  # after a rank's death the others' lines only say that a peer went away
            _print_rank_errors(error_dir, signalled=bool(_forwarded))
        for path in error_dir.iterdir():
            path.unlink()
        error_dir.rmdir()
    return code
