"""Which policy objective (algo.objective) on the chain task: held-out avg@4 and clip fractions at a fixed step count.

Each run is ``examples/tiny_cpu_chain.yaml`` (synchronous, one process) trained through the project's entry point for
``--steps`` steps, evaluated at the start (the base) and at the end (avg@4 on the held-out set). Variants:
  dapo      the example as it is (ppo_clip, clip 0.2 / 0.28, token-mean)
  gspo      algo.objective=gspo with the gspo preset's clip 3e-4 / 4e-4 and seq-mean-token-mean
  cispo     algo.objective=cispo with the cispo preset's bounds (no lower bound, upper 1 + 4) and token-mean
  gspo-moe  gspo on a tiny Qwen3-MoE (conversion/synthetic_moe.py's TINY_MOE_BASE, 4 experts top-2) pre-trained on
            the chain corpus with the example's tiny_base settings (model.hf_path)
  dapo-moe  the example on the same MoE base (the MoE's baseline)
Per variant and seed: held-out avg@4 at the end, and the means over the steps of train/clipfrac, clipfrac_low,
clipfrac_high (for gspo the fraction of tokens whose *sequence* was clipped). Runs go one at a time.

    OMP_NUM_THREADS=1 python benchmarks/objectives_study.py --steps 6 --seeds 1 2

Last line: ``gspo_minus_dapo_avg_at_4: X`` (seed means). ``--smoke`` (CI, seconds): dapo and gspo, one seed, one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu_chain.yaml"
VARIANTS: dict[str, tuple[str, ...]] = {
    "dapo": (),
    "gspo": ("algo.objective=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"),
    "cispo": ("algo.objective=cispo", "algo.clip_low=1.0", "algo.clip_high=4.0", "algo.loss_agg=token-mean"),
}
VARIANTS["gspo-moe"] = VARIANTS["gspo"]
VARIANTS["dapo-moe"] = ()
CLIP_KEYS = ("train/clipfrac", "train/clipfrac_low", "train/clipfrac_high")


def moe_base(out: Path) -> Path:
    """A tiny Qwen3-MoE pre-trained on the chain corpus with the example's tiny_base settings (built once)."""
    base = out / "moe-base"
    if (base / "config.json").exists():
        return base
    sys.path.insert(0, str(ROOT))
    from conversion.synthetic_moe import save_tiny_moe_base
    from dapo_mcore.config import load_config

    return save_tiny_moe_base(base, settings=load_config(CONFIG).tiny_base)


def run(variant: str, seed: int, steps: int, out: Path) -> dict[str, float]:
    run_dir = out / f"{variant}-s{seed}"
    model = ["model.tiny_base=false", f"model.hf_path={moe_base(out)}"] if variant.endswith("-moe") else []
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}", "run.overwrite=true",
           f"train.steps={steps}", f"eval.every={steps}", f"train.seed={seed}", "checkpoint.every=0",
           *model, *VARIANTS[variant]]
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return {"failed": float(proc.returncode), "wall_s": time.perf_counter() - t0}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r.get("step"), r["eval/avg_at_k"]) for r in rows if "eval/avg_at_k" in r]
    res = {"base_avg_at_4": float(evals[0][1]) if len(evals) > 1 else float("nan"),
           "avg_at_4": float(evals[-1][1]) if evals else float("nan"), "wall_s": time.perf_counter() - t0}
    for key in CLIP_KEYS:
        values = [float(r[key]) for r in rows if key in r]
        res[key.split("/")[1]] = statistics.fmean(values) if values else float("nan")
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=["dapo", "gspo", "cispo"], choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long CI run: dapo and gspo, one seed, 1 step each")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.variants = 1, [1], ["dapo", "gspo"]
    out = args.out or Path(tempfile.mkdtemp(prefix="dapo_objectives_study_"))
    results: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:
        for variant in args.variants:
            res = run(variant, seed, args.steps, out)
            results.setdefault(variant, []).append(res)
            print(f"{variant} seed {seed}: {json.dumps({k: round(v, 5) for k, v in res.items()})} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"| variant | base avg@4 | held-out avg@4 after {args.steps} steps (seeds "
          f"{' / '.join(map(str, args.seeds))}) | mean | clipfrac | clipfrac_low | clipfrac_high | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    means: dict[str, float] = {}
    for variant, runs in results.items():
        ok = [r for r in runs if "failed" not in r]
        if not ok:
            print(f"| {variant} | failed | | | | | | |")
            continue

        def m(key: str, ok: list[dict[str, float]] = ok) -> float:
            return statistics.fmean(r[key] for r in ok)

        means[variant] = m("avg_at_4")
        seeds = " / ".join(f"{r['avg_at_4']:.3f}" for r in ok)
        print(f"| {variant} | {m('base_avg_at_4'):.3f} | {seeds} | {means[variant]:.3f} | {m('clipfrac'):.2e} | "
              f"{m('clipfrac_low'):.2e} | {m('clipfrac_high'):.2e} | {m('wall_s'):.0f} |")
    if "gspo" in means and "dapo" in means:
        print(f"gspo_minus_dapo_avg_at_4: {means['gspo'] - means['dapo']:.4f}")
    failed = sorted({v for v, runs in results.items() for r in runs if "failed" in r})
    if failed:  # a study with a failed run is a failed study, whatever the others gave
        print(f"objectives_study: runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
