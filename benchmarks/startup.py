"""Start-up cost of one rank: the CPU seconds a fresh process spends importing the training stack (dapo-mcore's
trainer with the transformers engine, the Megatron actor and GPT model), with Megatron-Core's import as dapo-mcore
loads it (``dapo_mcore/model/megatron_import.py``: TorchDynamo/Inductor and W&B left out) against the plain import
(``DAPO_MCORE_PLAIN_MEGATRON_IMPORT=1``), alternating, in fresh processes side by side.

Every rank of a run pays this once (a 2-process test run, each trainer and engine rank of a job, each rehearsal
launch), so on a CPU machine it is much of a short run's cost. The figure is the children's user+system CPU time
(``resource.getrusage``), steadier than wall time on a shared machine; wall is printed too.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--smoke]

Last line: ``startup_cpu_fast_over_plain: R`` (median CPU s with the fast import / median with the plain one).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

CHILD = ("import dapo_mcore.trainer, dapo_mcore.actor.megatron_actor\n"
         "from megatron.core.models.gpt import GPTModel\n"
         "import sys; assert 'dapo_mcore.rollout.engines.hf_engine' in sys.modules\n")


def _one(plain: bool) -> tuple[float, float]:
    env = dict(os.environ, DAPO_MCORE_PLAIN_MEGATRON_IMPORT="1" if plain else "0", PYTHONWARNINGS="ignore")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes of each kind (alternating)")
    ap.add_argument("--smoke", action="store_true", help="one process of each kind (CI: the script still runs)")
    args = ap.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats
    runs: dict[str, list[tuple[float, float]]] = {"fast": [], "plain": []}
    for _ in range(repeats):
        runs["plain"].append(_one(True))
        runs["fast"].append(_one(False))
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in runs.items()}
    for k in ("plain", "fast"):
        print(f"{k:5s}: {med[k][0]:.2f} CPU s, {med[k][1]:.2f} s wall (median of {repeats})")
    print(f"startup_cpu_saved_s: {med['plain'][0] - med['fast'][0]:.2f}")
    print(f"startup_cpu_fast_over_plain: {med['fast'][0] / med['plain'][0]:.3f}")


if __name__ == "__main__":
    main()
