"""Hostile tool code in the sandbox while this process runs a GPU job: each attack contained, the GPU job unharmed.

A thread multiplies matrices on the GPU (bf16, synchronised each step, ``--device cpu`` where there is none) while
the main thread sends the sandbox an endless loop, a memory bomb, an output flood, children that try to outlive the
call, kills of its parent and of every process, a connection to a port this process listens on, a read of the
secret in this process's environment, a look for the GPU's device files, and 8 calls at once from threads. Each must
come back contained, and the GPU loop must keep stepping during the calls and end with finite numbers.
``benchmarks/gpu_check.sh`` runs it after the GPU check. Last line: ``sandbox_beside_gpu: ok`` (or ``FAILED``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dapo_mcore.tools import Sandbox

GUARD = ("import os, signal\nif os.getpid() != 1:\n    raise SystemExit('not in a pid namespace: no attack')\n"
         "print('attacking', flush=True)\n")


class MatmulLoop(threading.Thread):
    """The GPU job: products of two square matrices (2048 on a GPU, 256 on a CPU) until told to stop; steps counted."""

    def __init__(self, device: str):
        super().__init__(daemon=True)
        self.device, self.steps, self.stop, self.finite = device, 0, threading.Event(), True

    def run(self) -> None:
        dtype, n = (torch.bfloat16, 2048) if self.device == "cuda" else (torch.float32, 256)
        a = torch.randn(n, n, device=self.device, dtype=dtype)
        b = torch.randn(n, n, device=self.device, dtype=dtype) / n ** 0.5
        while not self.stop.is_set():
            a = torch.tanh(a @ b)
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.steps += 1
        self.finite = bool(torch.isfinite(a).all())


def leftovers(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # exited while we looked
    return found


def attacks(port: int, secret: str, marker: str) -> list[tuple[str, str, object]]:
    """(name, code, check(result) -> bool)."""
    spawn = (f"import os\nfor i in range(10):\n    if os.fork() == 0:\n        os.setsid()\n"
             f"        os.execv('/bin/sleep', ['{marker}', '60'])\nprint('spawned')")
    return [
        ("endless loop", "while True:\n    pass", lambda r: r.kind == "timeout" and r.exit_code is None),
        ("memory bomb", "x = bytearray(64 * 1024 ** 3)", lambda r: r.stderr.strip().endswith("MemoryError")),
        ("output flood", "while True:\n    print('x' * 4096)", lambda r: r.kind == "truncated"),
        ("children left behind", spawn, lambda r: r.stdout == "spawned\n"),
        ("kill the parent", GUARD + "os.kill(os.getppid(), signal.SIGKILL)", lambda r: "attacking" in r.stdout),
        ("kill every process", GUARD + "os.kill(-1, signal.SIGKILL)", lambda r: "attacking" in r.stdout),
        ("connect to the host", f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 1)\n"
                                "    print('reached')\nexcept OSError:\n    print('failed')",
         lambda r: r.stdout == "failed\n"),
        ("read the trainer's secret", "import os\nhits = [p for p in os.listdir('/proc') if p.isdigit() and "
                                      f"{secret!r}.encode() in open(f'/proc/{{p}}/environ', 'rb').read()]\n"
                                      f"print(hits or {secret!r} in str(os.environ))",
         lambda r: r.stdout == "False\n"),
        ("find the GPU", "import glob\nprint(glob.glob('/dev/nvidia*') + glob.glob('/dev/dri/*'))",
         lambda r: r.stdout == "[]\n"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bwrap", default="bwrap", help="the bubblewrap binary")
    args = parser.parse_args(argv)
    secret = f"sk-beside-gpu-{uuid.uuid4().hex}"
    os.environ["SECRET_API_KEY"] = secret  # what a trainer's environment may hold
    box = Sandbox(timeout_s=3, memory_mb=512, max_output_bytes=64 * 1024, bwrap=args.bwrap)
    loop = MatmulLoop(args.device)
    loop.start()
    time.sleep(1.0)
    failed = []
    marker = f"beside-gpu-{uuid.uuid4().hex}"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.2)
        for name, code, check in attacks(listener.getsockname()[1], secret, marker):
            before = loop.steps
            r = box.run(code)
            ok = bool(check(r)) and box.run("print(1)").stdout == "1\n"
            print(f"{name:26s} {r.kind:9s} {r.seconds:5.2f} s  GPU steps meanwhile {loop.steps - before:5d}  "
                  f"{'contained' if ok else 'NOT CONTAINED: ' + repr((r.stdout[-200:], r.stderr[-200:]))}")
            if not ok:
                failed.append(name)
        try:
            listener.accept()
            failed.append("the host listener saw a connection")
        except TimeoutError:
            pass  # no connection: what must happen
    time.sleep(0.5)
    if leftovers(marker):
        failed.append(f"{len(leftovers(marker))} processes outlived their call")
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: box.run(f"print({i})").stdout, range(8)))
    if outs != [f"{i}\n" for i in range(8)]:
        failed.append(f"parallel calls mixed up: {outs}")
    print(f"8 parallel calls: {'each its own output' if outs == [f'{i}' + chr(10) for i in range(8)] else outs}")
    steps = loop.steps
    time.sleep(0.5)
    loop.stop.set()
    loop.join(timeout=30)
    if loop.steps <= steps or not loop.finite:
        failed.append(f"the GPU loop stalled or went non-finite (steps {steps} -> {loop.steps}, finite {loop.finite})")
    print(f"GPU job ({args.device}): {loop.steps} matmul steps, finite: {loop.finite}")
    for f in failed:
        print(f"FAILED: {f}")
    print(f"sandbox_beside_gpu: {'ok' if not failed else 'FAILED'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
