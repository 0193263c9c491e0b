"""The ``dapo-mcore`` command: train | eval | config | convert | plan | profile | report | rollouts | audit-reward | diagnose | data.

Each subcommand imports its module only when it runs, so ``dapo-mcore --help`` is instant and a missing GPU
package never breaks an unrelated command. User errors (bad config, data or checkpoint; a missing, read-only or
full file system) print one line on stderr and exit 2, for every subcommand (``_guard``); ``--debug`` or
``DAPO_MCORE_DEBUG=1`` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path


def _report_line(line: str) -> None:
    """Print a user error's one line; a rank under `dapo_mcore.commands.launcher` hands it to the launcher instead, which
    prints each distinct line once (not once per rank)."""
    error_dir = os.environ.get("DAPO_MCORE_ERROR_DIR")
    if error_dir and "RANK" in os.environ:
        try:
            Path(error_dir, f"rank{int(os.environ['RANK'])}").write_text(line + "\n")
            return
        except OSError:
            pass  # the launcher's directory is gone: print it here instead, nothing is lost
    print(line, file=sys.stderr)


def _arm_before_imports(argv: list[str]) -> None:
    """``train`` (a rank, or a lone process; not the --nproc-per-node launcher, which forwards signals itself): the
    start-up watcher (``signals.startup``) is armed before the modules below are imported (seconds: pyarrow, then
    torch), so a stop signal in those seconds is one line and the requeue code (75; Ctrl-C 130), not a silent 143
    or a traceback through an import, and a Slurm pre-emption then is requeued."""
    args = argv[1:] if argv[:1] == ["--debug"] else argv
    if args[:1] == ["train"] and "--nproc-per-node" not in args and not any(a.startswith("--nproc-per-node=")
                                                                          for a in args):
        from dapo_mcore.signals import startup

        startup.arm(_report_line)


if Path(sys.argv[0]).name in ("dapo-mcore", "cli.py"):  # the command itself, not a test importing this module
    _arm_before_imports(sys.argv[1:])

from dapo_mcore import __version__  # noqa: E402
from dapo_mcore.config.tree import ConfigError  # noqa: E402
from dapo_mcore.errors import EXIT_USAGE, UserError, describe_os_error  # noqa: E402

# name -> (module, function, one-line help). Delegated commands parse their own arguments.
_DELEGATED: dict[str, tuple[str, str, str]] = {
    "report": ("dapo_mcore.telemetry.report", "main", "write PNG figures of a run (and compare runs)"),
    "profile": ("dapo_mcore.telemetry.profile", "main", "summarize where a run's time and tokens went"),
    "rollouts": ("dapo_mcore.telemetry.rollout_store", "main", "print decoded rollouts of a step from the zarr store"),
    "audit-reward": ("dapo_mcore.reward.audit", "main", "probe the math verifier with shortcut answers"),
    "plan": ("dapo_mcore.commands.plan", "main", "estimate per-GPU memory and FLOPs of a layout before queueing"),
    "rehearse": ("dapo_mcore.commands.rehearse", "main", "run a recipe at its own layout, shrunk, on this CPU: a few steps, a "
                 "killed rank, a resume"),
    "diagnose": ("dapo_mcore.telemetry.diagnose", "main", "explain why a run stalled, from its metrics and ledger"),
    "config": ("dapo_mcore.commands.config", "main", "print the resolved config and its layout (runs nothing)"),
    "data": ("dapo_mcore.commands.data_check", "main", "check prompt files (columns, prompt format, duplicates) before a job"),
}
_CONVERT: dict[str, tuple[str, str, str]] = {
    "hf-to-mcore": ("conversion.hf_to_mcore", "main", "Hugging Face dir -> Megatron checkpoint at a TP/PP layout"),
    "mcore-to-hf": ("conversion.mcore_to_hf", "main", "Megatron or trainer checkpoint -> Hugging Face safetensors"),
    "mcore-to-bridge": ("conversion.mcore_to_bridge", "main",
                        "this project's (or a trainer) checkpoint -> a Megatron-Bridge checkpoint"),
    "verify": ("conversion.verify", "main", "logit parity between Hugging Face and Megatron on given weights"),
}


def _call(module: str, func: str, argv: list[str]) -> int:
    fn: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return int(fn(argv) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dapo-mcore", description="DAPO reinforcement learning on Megatron-Core.")
    p.add_argument("--version", action="version", version=f"dapo-mcore {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of user errors too (or set DAPO_MCORE_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run DAPO training (--nproc-per-node N on one machine; or torchrun, srun)")
    train.add_argument("config", help="YAML config, e.g. examples/tiny_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.clip_high=0.28 run.dir=runs/x")
    ev = sub.add_parser("eval", help="held-out avg@k / pass@k / maj@k of a checkpoint")
    ev.add_argument("config")
    ev.add_argument("overrides", nargs="*")
    for command in (train, ev):
        command.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                             help="start N processes on this machine (torch.distributed.run underneath): the "
                                  "config is checked once, a refusal is one line, the ranks' exit code is returned")
    ev.add_argument("--checkpoint", default=None,
                    help="a run dir (its latest checkpoint), a checkpoint dir, or 'base' (default: run.dir's latest)")
    ev.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    conv = sub.add_parser("convert", help="checkpoint conversion between Hugging Face and Megatron")
    conv.add_argument("direction", choices=sorted(_CONVERT), help="; ".join(f"{k}: {v[2]}" for k, v in _CONVERT.items()))
    conv.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the conversion (see --help of each)")
    for name, (_, _, help_text) in _DELEGATED.items():
        d = sub.add_parser(name, help=help_text, add_help=False)
        d.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("DAPO_MCORE_DEBUG", "") not in ("", "0")
    if argv[:1] == ["--debug"]:
        debug, argv = True, argv[1:]
    if "RANK" in os.environ and os.environ.get("DAPO_MCORE_LAUNCHER_PID"):
        from dapo_mcore.commands.launcher import bind_to_launcher

        bind_to_launcher()  # a rank of `--nproc-per-node`: it dies with the launcher, even a kill -9 of it
    if argv[:1] == ["train"] and "RANK" in os.environ and "--nproc-per-node" not in argv:
        from dapo_mcore.signals import startup

        startup.arm(_report_line)  # Ctrl-C before the first step: every rank exits 130 at once, one line
    if sys.stderr.isatty():  # live, coloured progress in a terminal; plain lines in logs and pipes
        from rich.logging import RichHandler

        logging.basicConfig(level=logging.INFO, format="%(message)s", datefmt="%H:%M:%S",
                            handlers=[RichHandler(show_path=False, rich_tracebacks=False)])
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    # Megatron logs every config and parameter name at INFO; keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # Progress and start-up lines once, from rank 0; every rank's warnings and errors stay. DAPO_MCORE_LOG_ALL_RANKS=1
    # keeps every rank's INFO lines (which rank loaded what, on which host: debugging a multi-node launch).
    if _rank() != 0 and os.environ.get("DAPO_MCORE_LOG_ALL_RANKS") != "1":
        logging.getLogger().setLevel(logging.WARNING)
    parser = _parser()
    if argv and argv[0] in _DELEGATED:
        module, func, _ = _DELEGATED[argv[0]]
        return _guard(lambda: _call(module, func, argv[1:]), debug)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "convert":
        module, func, _ = _CONVERT[args.direction]
        return _guard(lambda: _call(module, func, args.args), debug)
    return _guard(lambda: _run_training_command(args), debug)


def _rank() -> int:
    """This process's rank in a torchrun/srun launch (0 for a lone process), read before torch is imported."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


ENV_OVERRIDES = "DAPO_MCORE_EXTRA_OVERRIDES"
"""Overrides appended to every train/eval command line, e.g. ``train.steps=4`` to shorten documented commands in CI."""


def _run_training_command(args: argparse.Namespace) -> int:
    """train / eval: config and paths are checked before Megatron and the trainer are imported."""
    import shlex

    from dapo_mcore.commands.config import precheck
    from dapo_mcore.run.checkpoints import finished_step, resolve_eval_checkpoint

    extra = shlex.split(os.environ.get(ENV_OVERRIDES, ""))
    if extra and _rank() == 0:
        logging.getLogger(__name__).warning("%s adds overrides: %s", ENV_OVERRIDES, " ".join(extra))
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1 or "RANK" in os.environ:
            raise UserError(f"--nproc-per-node {args.nproc_per_node}: give N >= 1, and not under torchrun/srun "
                            "(they start the processes themselves)")
        from dapo_mcore.commands import launcher

        rest = ["--checkpoint", args.checkpoint] if args.command == "eval" and args.checkpoint else []
        rest += ["--json"] if args.command == "eval" and args.json else []
        return launcher.launch(args.command, args.nproc_per_node, args.config, args.overrides, extra, rest)
    overrides = [*args.overrides, *extra]
    if args.command == "eval":  # an async run's checkpoint evaluates colocated: the engines share the ranks
        overrides.append("rollout.pipeline.mode=sync")
    cfg = precheck(args.config, overrides, warn=args.command == "train")
    if args.command == "train" and finished_step(cfg) is not None:
        logging.getLogger(__name__).info("run already finished %d steps (%s); nothing to do", finished_step(cfg),
                                         Path(cfg.run.dir) / "checkpoints")
        return 0
    checkpoint = resolve_eval_checkpoint(args.checkpoint) if args.command == "eval" else None
    _quiet_cpu_warnings()
    from dapo_mcore import trainer

    try:
        if args.command == "train":
            return _requeue_exit(trainer.train_main(args.config, overrides), trainer.EXIT_REQUEUE)
        return trainer.eval_main(args.config, overrides, checkpoint, as_json=args.json)
    except (RuntimeError, ConnectionError) as exc:
        if collective_timed_out(exc):
            return _hung_peer_exit(args.config, overrides, args.command, trainer.EXIT_REQUEUE)
        if not peer_lost(exc):
            raise
        from dapo_mcore.config import load_config

        raise UserError(lost_peer_line(exc, Path(load_config(args.config, overrides).run.dir), args.command)) from exc


_TIMED_OUT = ("ms for recv operation to complete", "ms for send operation to complete",
              "Application timeout caused pair closure")
"""What gloo says when a collective got no answer within the process-group timeout (``Timed out waiting 600000ms
for recv operation to complete``), and, for any later collective of that group, ``Application timeout caused pair
closure``. (NCCL's watchdog aborts the process on a timeout instead: docs/cluster.md "A rank hangs".)"""


def collective_timed_out(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it arose from, is a collective that timed out waiting for a peer."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError) and any(s in str(seen) for s in _TIMED_OUT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _hung_peer_exit(config: str, overrides: list[str], command: str, requeue_code: int) -> int:
    """A collective timed out: one line naming the rank(s) that stopped answering (a roll call), then exit
    ``requeue_code`` (train: slurm/launch.sh requeues the job, which resumes from its latest complete checkpoint;
    the hung rank is killed by srun) or 2 (eval)."""
    import socket

    import torch.distributed as dist

    from dapo_mcore.actor import rollcall
    from dapo_mcore.actor.checkpoint import latest_complete
    from dapo_mcore.config import load_config

    cfg = load_config(config, overrides)
    minutes = cfg.parallel.timeout_minutes
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", dist.get_rank() if dist.is_initialized() else "?"))
    me = f"rank {rank} on {socket.gethostname()}"  # the job's rank (the async layout numbers each side apart)
    silent = rollcall.call()
    who = silent.describe() if silent is not None else "another rank stopped answering (hung?)"
    head = (f"{me}: a collective got no answer within parallel.timeout_minutes={minutes:g} ({minutes * 60:g} s): "
            f"{who}")
    if command != "train":
        print(f"dapo-mcore: {head}; this rank stops too", file=sys.stderr)
        return EXIT_USAGE
    latest = latest_complete(Path(cfg.run.dir) / "checkpoints")
    resume = (f"the requeued job resumes from {latest}, the latest complete checkpoint" if latest
              else "the requeued run starts over: it has no checkpoint yet")
    print(f"dapo-mcore: {head}; exiting {requeue_code} so that slurm/launch.sh requeues the job ({resume})",
          file=sys.stderr)
    return _requeue_exit(requeue_code, requeue_code)


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "NCCL communicator was aborted", "Socket Timeout", "DistNetworkError", "DistBackendError")
"""What gloo, NCCL and the TCP store say when another rank of the job died (a RuntimeError, no errno)."""


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank is gone (not a bug of this rank)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in _PEER_LOST)


def clip_words(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary, with "..." where it was cut (never mid-word)."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "..."


def lost_peer_line(exc: BaseException, run_dir: Path, command: str) -> str:
    """One line: another rank died, what this rank saw, and the checkpoint the same command resumes from."""
    from dapo_mcore.actor.checkpoint import latest_complete

    seen = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    seen = clip_words(seen.split("] ", 1)[-1], 160)  # gloo prefixes its source location
    if command != "train":
        return f"another rank of the job stopped ({seen}); this rank stops too. Check the other ranks' logs"
    latest = latest_complete(run_dir / "checkpoints")
    resume = (f"the run resumes from {latest} (its latest complete checkpoint, verified on resume)" if latest
              else "the run has no checkpoint yet and starts over")
    return (f"another rank of the job stopped ({seen}); this rank stops too. Check the other ranks' logs, then run "
            f"the same command: {resume}")


def _requeue_exit(code: int, requeue_code: int) -> int:
    """The run checkpointed and asks for a requeue: from here on, SIGTERM/SIGUSR1 are ignored (`_shield_exit`)."""
    if code == requeue_code:
        _shield_exit()
    return code


def _shield_exit() -> None:
    """Ignore SIGTERM/SIGUSR1 for the rest of this process: its exit code is decided.

    The first rank to exit (75 after a checkpoint, 2 after a refused config, which every rank refuses) makes srun
    (--kill-on-bad-exit) send SIGTERM to its peers, which may be shutting down the interpreter by then: Python puts
    the default handlers back for that, so the SIGTERM would kill the process (status 143) and slurm/launch.sh would
    see 143 instead of the code (no requeue for 75). SIG_IGN survives interpreter shutdown; a Python handler does not.
    """
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def entry() -> None:
    """The ``dapo-mcore`` console script and ``python -m dapo_mcore.cli``: `main`, then exit with its code."""
    try:
        code = main()
    except KeyboardInterrupt:  # before a command's own handling (imports, a lone process's start-up): one line
        from dapo_mcore.signals.startup import LINE

        _report_line(LINE)
        code = 130
    _shield_exit()
    if code == 130:
        _exit_interrupted()
    sys.exit(code)


def _exit_interrupted() -> None:
    """Exit 130 after a handled Ctrl-C, for sure. Under ``python -m`` CPython kills itself with SIGINT at exit (-2)
    when a KeyboardInterrupt once escaped code it ran through ``PyRun_*`` (C extensions do), even though Python
    code caught that KeyboardInterrupt later: the flag is never reset. Seen in ``convert`` interrupted at random
    moments (3 of 25 tries). The command's cleanup is done (partial output removed, the line printed): flush and
    leave with the code."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(130)


def _quiet_cpu_warnings() -> None:
    """Megatron's "Transformer Engine / Apex not installed" warnings are expected on CPU, where the local spec
    and torch optimizers are the intended path; on a GPU they stay, since there they may mean a missing install."""
    import torch

    if not torch.cuda.is_available():
        for pattern in (r"Transformer Engine and Apex are not installed.*", r"Apex is not installed.*",
                        r"full scope is deprecated.*",
                        r"When using async grad allreduce it is recommended to set the environment variable "
                        r"CUDA_DEVICE_MAX_CONNECTIONS.*"):  # a CUDA stream setting; no meaning on CPU
            warnings.filterwarnings("ignore", message=pattern)


def _user_errors() -> tuple[tuple[type[BaseException], str], ...]:
    """(exception type, message prefix) of the errors a user can fix, most specific first."""
    from dapo_mcore.data.datasets import DatasetFormatError
    from dapo_mcore.model.fp8 import MissingGPUExtra
    from dapo_mcore.model.qwen import HFConfigError
    from dapo_mcore.weights.checkpoint import CheckpointError
    from dapo_mcore.weights.errors import WeightsError
    from dapo_mcore.weights.layout import LayoutError
    from dapo_mcore.weights.registry import UnsupportedModelError

    return ((ConfigError, "configuration error: "), (DatasetFormatError, "dataset error: "),
            (CheckpointError, "checkpoint error: "), (LayoutError, "layout error: "),
            (HFConfigError, "model config error: "), (WeightsError, ""), (UnsupportedModelError, ""), (MissingGPUExtra, ""), (UserError, ""))


def _guard(fn: Callable[[], int], debug: bool = False) -> int:
    """Run a command; a user error becomes one line on stderr and exit code 2 (with the traceback if `debug`).

    Generic over commands: a subcommand reports a user error by raising one of `_user_errors` or an ``OSError``
    (whose errno picks the fix named in the message); anything else is a bug and keeps its traceback.
    """
    try:
        return fn()
    except BrokenPipeError:
        # the reader of our stdout went away (`dapo-mcore diagnose RUN | head -1`): not an error; silence the
        # flush at exit. A broken pipe anywhere else (a peer's socket) stays an error.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        raise
    except (ConnectionError, TimeoutError):
        raise  # lost peers and timeouts are OSErrors too, but not the user's file system
    except OSError as exc:
        error: BaseException = exc
        message = ("I/O error: " if exc.errno is not None else "") + describe_os_error(exc)
    except Exception as exc:
        # ConfigError and UserError first: classifying by _user_errors() imports torch (5 s) for a one-line refusal
        prefix = ("configuration error: " if isinstance(exc, ConfigError) else "" if isinstance(exc, UserError)
                  else next((p for kind, p in _user_errors() if isinstance(exc, kind)), None))
        if prefix is None:
            raise
        error, message = exc, f"{prefix}{exc}"
    if debug:
        traceback.print_exception(error)
    _report_line(f"dapo-mcore: {message}")
    return EXIT_USAGE


if __name__ == "__main__":
    entry()
