"""Per-call cost of the tool-code sandbox: a bubblewrap box vs the unboxed backend vs a bare subprocess.

The same small script (``print(sum(range(1000)))``) runs ``--calls`` times through each, interleaved round by round
so that load on a shared machine falls on all three alike; each is the median wall time of a call. Then
``--threads`` callers share one bubblewrap Sandbox (calls/s against one caller), and a caller holding
``--ballast-mb`` of memory calls with its limits set by prlimit and by a preexec function. Last line:
``sandbox_over_bare: X`` (median bubblewrap call / median bare subprocess call).
``--smoke``: 3 calls each, 2 threads, 64 MB of ballast (the same paths, seconds; run in CI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from dapo_mcore.tools.box import box_env
from dapo_mcore.tools.sandbox import Sandbox

CODE = "print(sum(range(1000)))"


def bare(python: str) -> float:
    """The floor: the interpreter as a plain subprocess, no limits, no box."""
    start = time.perf_counter()
    out = subprocess.run([python, "-I", "-B", "-c", CODE], env=box_env("/"), stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, check=True).stdout
    assert out == "499500\n", out
    return time.perf_counter() - start


def through(sandbox: Sandbox) -> float:
    start = time.perf_counter()
    r = sandbox.run(CODE)
    assert (r.kind, r.stdout) == ("ok", "499500\n"), r
    return time.perf_counter() - start


def ballast_section(boxed: Sandbox, args: argparse.Namespace) -> None:
    """The launcher's cost against the caller's memory: limits set by prlimit (vfork) vs a preexec function (fork,
    which copies the page tables of a caller holding gigabytes: a trainer)."""
    preexec = Sandbox(timeout_s=30, memory_mb=1024, python=args.python)
    preexec._set_launcher(boxed.unprivileged, use_prlimit=False)
    if not boxed._prefix:
        print("no prlimit here: both columns below use a preexec function")
    rows = []
    for mb in (0, args.ballast_mb):
        ballast = bytearray(mb * 2**20)
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1  # touched: resident, with page tables a fork must copy
        calls = max(args.calls // 2, 5)
        pair = [statistics.median(through(s) for _ in range(calls)) for s in (boxed, preexec)]
        rows.append(pair)
        print(f"caller holding {mb:5d} MiB: prlimit {pair[0] * 1000:7.1f} ms, preexec {pair[1] * 1000:7.1f} ms per call")
        del ballast
    print(f"preexec_over_prlimit_with_ballast: {rows[1][1] / rows[1][0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--python", default="python3", help="the tool interpreter")
    parser.add_argument("--ballast-mb", type=int, default=1024,
                        help="also time calls from a caller holding this much memory (0: skip)")
    parser.add_argument("--smoke", action="store_true",
                        help="3 calls each, 2 threads, 64 MB of ballast (a seconds-long check, run in CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.threads, args.ballast_mb = 3, 2, 64
    boxed = Sandbox(timeout_s=30, memory_mb=1024, python=args.python)
    unboxed = Sandbox(timeout_s=30, memory_mb=1024, python=args.python, backend="none")
    python = boxed.interpreter.path
    print(f"interpreter {python}; {args.calls} calls each, interleaved; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    for warm in (lambda: bare(python), lambda: through(unboxed), lambda: through(boxed)):
        warm()
    times: dict[str, list[float]] = {"bare": [], "none": [], "bwrap": []}
    for _ in range(args.calls):
        times["bare"].append(bare(python))
        times["none"].append(through(unboxed))
        times["bwrap"].append(through(boxed))
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, label in [("bare", "bare subprocess"), ("none", "Sandbox(backend='none')"),
                        ("bwrap", "Sandbox(backend='bwrap')")]:
        print(f"{label:26s} median {med[name] * 1000:7.1f} ms  (p90 "
              f"{statistics.quantiles(times[name], n=10)[-1] * 1000:7.1f} ms)  x{med[name] / med['bare']:.2f} of bare")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(lambda _: through(boxed), range(args.calls)))
    parallel = args.calls / (time.perf_counter() - start)
    print(f"bwrap, {args.threads} threads on one Sandbox: {parallel:.1f} calls/s "
          f"(one caller: {1 / med['bwrap']:.1f} calls/s; x{parallel * med['bwrap']:.2f})")
    print(f"none_over_bare: {med['none'] / med['bare']:.2f}")
    if args.ballast_mb:
        ballast_section(boxed, args)
    print(f"sandbox_over_bare: {med['bwrap'] / med['bare']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
