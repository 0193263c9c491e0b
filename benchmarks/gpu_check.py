"""The prepared GPU check: one script that a machine with an H100/H200 runs once to record numbers.

Sections, in the order they run (the ones whose numbers nothing else can give first, so a late overrun costs least):

  env         device, versions, what was imported from where
  lora        the LoRA merge on the device (benchmarks/gpu_lora_merge.py): grads reach only the adapters, the
              shard-local merge equals a naive fp32 W + scale * B @ A, its time
  parity      log-probs of the Megatron actor (bf16, local spec) against Hugging Face on sequences the model itself
              sampled (a Qwen2.5-0.5B-shaped random model), with HF bf16 vs HF fp32 as the bf16 noise floor
  throughput  the actor's train step (``train_mini_batch``) and log-prob pass (``compute_logprobs``) for 0.5B- and
              1.5B-shaped models at 4k/8k/16k tokens per micro-batch: tokens/s, MFU against the bf16 matmul rate
              measured in the same process (8192^3 after warm-up, CUDA events), peak memory
  pytest      ``pytest -m gpu`` (the gpu-marked tests)
  tiny        the tiny DAPO job on the GPU, side by side with the same job on the CPU (CUDA hidden), same machine

Each section runs in its own process under a time limit taken from one overall budget, so a hang, a CUDA error or
an out-of-memory in one cannot take the others down; a failure is recorded as FAILED with its error, never hidden.
Full logs and ``gpu_check.json`` go to ``--out`` (``$OUT`` on the device machine); a short table is printed last.
``--smoke`` runs the same plumbing on the CPU with tiny shapes (tests/test_gpu_check_smoke.py).
The measurements themselves live in ``benchmarks/gpu_measure.py``; this file is the driver.

Run on the device machine through ``benchmarks/gpu_check.sh`` (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_measure import Plan, error_text, free_port, worker_main  # noqa: E402

log = logging.getLogger("gpu_check")

SECTIONS = ("env", "lora", "parity", "throughput", "pytest", "tiny")
WORKER_SECTIONS = ("parity", "throughput")


def gpu_plan() -> Plan:
    # 240 s in all, so that one run (with the wheel install, under 300 s) leaves time for a rerun within
    # a 15-minute GPU allowance: one benchmark model, two micro-batch budgets, 8 tiny steps.
    return Plan(
        smoke=False, parity_preset="qwen2.5-0.5b", parity_overrides={}, parity_prompts=8, parity_n=4,
        parity_prompt_len=64, parity_new_tokens=128,
        bench_models=(("qwen2.5-0.5b", "qwen2.5-0.5b", {}),),
        bench_budgets=(8192, 16384), bench_seq_len=1024, bench_minibatch_tokens=32768, bench_iters=2,
        matmul_n=8192, tiny_steps=8, tiny_overrides=(),
        pytest_paths=("tests/test_gpu_actor.py", "tests/test_gpu_tiny_run.py", "tests/test_gpu_paths.py"), budget_s=240.0,
        caps={"env": 30, "lora": 30, "parity": 60, "throughput": 75, "pytest": 60, "tiny": 70},
        floors={"env": 5, "lora": 10, "parity": 30, "throughput": 40, "pytest": 30, "tiny": 40})


def smoke_plan() -> Plan:
    tiny_wide = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
    return Plan(
        smoke=True, parity_preset="tiny", parity_overrides={}, parity_prompts=3, parity_n=2, parity_prompt_len=6,
        parity_new_tokens=8, bench_models=(("tiny", "tiny", {}), ("tiny-wide", "tiny", tiny_wide)),
        bench_budgets=(64, 128), bench_seq_len=32, bench_minibatch_tokens=256, bench_iters=1, matmul_n=256,
        tiny_steps=1, pytest_paths=("tests/test_gpu_actor.py", "tests/test_gpu_tiny_run.py", "tests/test_gpu_paths.py"), budget_s=300.0,
        tiny_overrides=("tiny_base.steps=4", "eval.at_start=false", "eval.k=1", "train.prompts_per_step=4",
                        "rollout.gen_batch_prompts=4", "rollout.n=4", "algo.dynamic_sampling=false"),
        caps={s: 120 for s in SECTIONS}, floors={s: 5 for s in SECTIONS})


# ---- driver sections (in the main process; heavy work in subprocesses) --------------------------------------
def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen) -> None:
    """End a child we started, and its own process group (it was started in a new session)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Any]:
    handle = open(log_path, "w")  # noqa: SIM115 -- closed by _finish
    handle.write("$ " + " ".join(cmd) + "\n")
    handle.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, handle


def _finish(proc: subprocess.Popen, handle, deadline: float) -> tuple[int | None, bool]:
    """Wait until ``deadline`` (monotonic); (exit code, timed out)."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        timed_out = False
    except subprocess.TimeoutExpired:
        _stop(proc)
        timed_out = True
    handle.close()
    return proc.returncode, timed_out


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:])[-400:]


def section_env(plan: Plan) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    for pkg in ("megatron-core", "transformers", "safetensors", "zarr", "numpy", "pytest", "transformer-engine",
                "vllm"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    if info["megatron-core"] is not None:
        import megatron.core

        info["megatron_path"] = str(Path(megatron.core.__file__).parent)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                    capability=f"{props.major}.{props.minor}", cuda_runtime=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    cache = cache_root() / "tiny_base"
    info["tiny_base_cache"] = sorted(p.name for p in cache.glob("*")) if cache.is_dir() else []
    problems = [f"{k} is not installed" for k in ("megatron-core", "transformers", "zarr") if info[k] is None]
    from dapo_mcore.model.fp8 import MissingGPUExtra
    from dapo_mcore.model.gpu_stack import check_gpu_stack

    try:  # the start-up gate every section meets again (dapo-mcore train, gpu_measure's workers)
        check_gpu_stack(transformer_engine=False, vllm=False)
    except MissingGPUExtra as exc:
        problems.append(str(exc))
    if not plan.smoke and not info["cuda_available"]:
        problems.append("CUDA is not available (run with --smoke on a CPU machine)")
    if problems:
        info.update(status="FAILED", error="; ".join(problems))
    return info


def section_worker(name: str, plan: Plan, out_dir: Path, workdir: Path, timeout: float) -> dict[str, Any]:
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
           "--workdir", str(workdir)] + (["--smoke"] if plan.smoke else [])
    proc, handle = _spawn(cmd, out_dir / f"{name}.log", _child_env())
    rc, timed_out = _finish(proc, handle, time.monotonic() + timeout)
    data = json.loads(result.read_text()) if result.is_file() else {}
    if timed_out:
        data.update(status="FAILED", error=f"timed out after {timeout:.0f} s (rows measured so far are kept)")
    elif rc != 0 or not data:
        data.update(status="FAILED", error=f"worker exit code {rc}: {_tail(out_dir / f'{name}.log')}")
    elif data.get("status") == "running":
        data.update(status="FAILED", error="worker ended without its final result")
    return data


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)")


def parse_pytest_counts(text: str) -> dict[str, int]:
    """Counts of pytest's closing line (``3 passed, 1 skipped, 700 deselected in 9.1s``)."""
    for line in reversed(text.strip().splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found:
            return {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in found}
    return {}


def section_pytest(plan: Plan, out_dir: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *plan.pytest_paths]
    log_path = out_dir / "pytest.log"
    proc, handle = _spawn(cmd, log_path, _child_env())
    rc, timed_out = _finish(proc, handle, time.monotonic() + timeout)
    counts = parse_pytest_counts(log_path.read_text(errors="replace"))
    out: dict[str, Any] = {"exit_code": rc, "counts": counts}
    if timed_out:
        out.update(status="FAILED", error=f"pytest timed out after {timeout:.0f} s")
    elif rc != 0:
        out.update(status="FAILED", error=f"pytest exit code {rc}: {_tail(log_path, 1)}")
    elif not plan.smoke and counts.get("passed", 0) == 0:
        out.update(status="FAILED", error="no gpu test passed (all skipped?): CUDA not seen by pytest")
    return out


def section_lora(plan: Plan, workdir: Path, timeout: float) -> dict[str, Any]:
    """benchmarks/gpu_lora_merge.py in its own process; its ``name: value`` lines go into gpu_check.log."""
    result, log_path = workdir / "lora.json", workdir / "lora_merge.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_lora_merge.py"), "--result", str(result)]
    proc, handle = _spawn(cmd + (["--smoke"] if plan.smoke else []), log_path, _child_env())
    rc, timed_out = _finish(proc, handle, time.monotonic() + timeout)
    print("\n".join(re.findall(r"(?m)^\w+: .*$", log_path.read_text(errors="replace"))), flush=True)
    data = json.loads(result.read_text()) if result.is_file() else {}
    if timed_out or rc != 0 or not data:
        data.update(status="FAILED", error=data.get("error") or f"{'timed out' if timed_out else f'exit code {rc}'}: "
                    f"{_tail(log_path)}")
    return data


def summarize_tiny_run(run_dir: Path, log_path: Path) -> dict[str, Any]:
    """Steps done, seconds per step and per phase, last accuracy / held-out score, backend, from a run's files."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    backend = re.findall(r"process group ready: rank \d+/\d+ \((\w+),", text)
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step" in r]
    out: dict[str, Any] = {"backend": backend[0] if backend else None, "steps_done": len(steps)}
    if steps:
        for key in ("time/step", "time/generate", "time/old_logprobs", "time/train", "time/eval"):
            out[key.replace("time/", "mean_s_")] = sum(r.get(key, 0.0) for r in steps) / len(steps)
        last = steps[-1]
        out.update(last_loss=last.get("train/loss"), last_acc=last.get("rollout/acc_mean"),
                   last_heldout_avg_at_k=next((r["eval/avg_at_k"] for r in reversed(rows) if "eval/avg_at_k" in r),
                                              None))
    return out


def _wait_all(runs: dict[str, dict[str, Any]], deadline: float) -> None:
    """Poll concurrent children until all end or the deadline passes, noting each one's end time (``t1``)."""
    while time.monotonic() < deadline:
        for r in runs.values():
            if "t1" not in r and r["proc"].poll() is not None:
                r["t1"] = time.monotonic()
        if all("t1" in r for r in runs.values()):
            return
        time.sleep(0.2)


def cache_root() -> Path:
    """Where the runtime caches the tiny base model (``$DAPO_MCORE_CACHE``, as dapo_mcore.run.runtime reads it)."""
    return Path(os.environ.get("DAPO_MCORE_CACHE", Path.home() / ".cache" / "dapo-mcore"))


def ensure_tiny_base(plan: Plan) -> dict[str, Any]:
    """Build the tiny base before the two runs start: both would otherwise pre-train it at once into the same
    temporary directory (the cache has no lock) and the build time would count as run time."""
    from dapo_mcore.config import load_config
    from dapo_mcore.data.base_model import ensure_base_model

    settings = load_config(str(REPO / "examples" / "tiny_cpu.yaml"), list(plan.tiny_overrides)).tiny_base
    path = cache_root() / "tiny_base" / f"{settings.task}-{settings.cache_key()}"
    hit = (path / "DONE").is_file()
    t0 = time.perf_counter()
    ensure_base_model(cache_root() / "tiny_base", settings)
    return {"tiny_base": str(path), "tiny_base_cache_hit": hit, "tiny_base_build_s": time.perf_counter() - t0}


def section_tiny(plan: Plan, out_dir: Path, workdir: Path, timeout: float) -> dict[str, Any]:
    """The tiny DAPO job on the device and, at the same time, on the CPU (CUDA hidden); cores split evenly."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    deadline = time.monotonic() + timeout
    base = ensure_tiny_base(plan)
    runs: dict[str, dict[str, Any]] = {}
    for name, extra in (("device", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        run_dir = workdir / f"tiny_{name}"
        cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", "examples/tiny_cpu.yaml",
               f"train.steps={plan.tiny_steps}", f"run.dir={run_dir}", "run.overwrite=true", *plan.tiny_overrides]
        env = _child_env(MASTER_PORT=str(free_port()), OMP_NUM_THREADS=threads, **extra)
        proc, handle = _spawn(cmd, out_dir / f"tiny_{name}.log", env)
        runs[name] = {"proc": proc, "handle": handle, "t0": time.monotonic(), "run_dir": run_dir}
    _wait_all(runs, deadline)
    out: dict[str, Any] = {"steps": plan.tiny_steps, "threads_each": int(threads), **base}
    errors = []
    for name, r in runs.items():
        rc, timed_out = _finish(r["proc"], r["handle"], deadline)
        info = {"exit_code": rc, "timed_out": timed_out, "wall_s": r.get("t1", time.monotonic()) - r["t0"],
                **summarize_tiny_run(r["run_dir"], out_dir / f"tiny_{name}.log")}
        out[name] = info
        if timed_out or rc != 0:
            errors.append(f"{name} run {'timed out' if timed_out else f'exit code {rc}'}: "
                          f"{_tail(out_dir / f'tiny_{name}.log', 1)}")
    if not plan.smoke and out["device"].get("backend") != "nccl":
        errors.append(f"device run used backend {out['device'].get('backend')!r}, not nccl")
    if not errors:
        out["cpu_over_device_wall"] = out["cpu"]["wall_s"] / out["device"]["wall_s"]
    else:
        out.update(status="FAILED", error="; ".join(errors))
    return out


# ---- report --------------------------------------------------------------------------------------------------
def headline(name: str, r: dict[str, Any]) -> str:
    """One line per section for the closing table."""
    if r.get("status") != "ok":
        return str(r.get("error", r.get("status")))[:160]
    if name == "env":
        where = r.get("device_name", "cpu")
        untested = [name for key, name in (("transformer-engine", "Transformer Engine"), ("vllm", "vLLM"))
                    if r.get(key) is None]
        return (f"{where}, torch {r['torch']}, megatron-core {r['megatron-core']}, transformers {r['transformers']}"
                + (f"; NOT TESTED (absent here): {', '.join(untested)}" if untested else ""))
    if name == "parity":
        s = r["stats"]
        return (f"megatron vs HF bf16: max {s['megatron_vs_hf_bf16']['max']:.3g} mean {s['megatron_vs_hf_bf16']['mean']:.3g}; "
                f"vs HF fp32 mean {s['megatron_vs_hf_fp32']['mean']:.3g} (HF bf16 floor {s['hf_bf16_vs_hf_fp32']['mean']:.3g})")
    if name == "throughput":
        ok = [row for row in r["rows"] if row["status"] == "ok"]
        best = max(ok, key=lambda row: row["train_mfu"])
        return (f"{r['matmul']['dtype']} matmul {r['matmul']['tflops']:.3g} TFLOP/s; best train MFU "
                f"{best['train_mfu']:.1%} ({best['model']} @ {best['budget']} tok)")
    if name == "lora":
        return (f"{r['layers']} layers (rank {r['rank']}, {r['dtype']}): max |merge - naive fp32| "
                f"{r['merge_vs_naive_fp32_max_abs_diff']:.2g}, merge {r['merge_ms']:.3g} ms, export {r['export_s']:.2g} s")
    if name == "pytest":
        return ", ".join(f"{n} {k}" for k, n in r["counts"].items())
    if name == "tiny":
        d, c = r["device"], r["cpu"]
        return (f"{r['steps']} steps: device {d['wall_s']:.0f} s ({d.get('mean_s_step', float('nan')):.2f} s/step) "
                f"vs cpu {c['wall_s']:.0f} s ({c.get('mean_s_step', float('nan')):.2f} s/step), cpu/device "
                f"x{r['cpu_over_device_wall']:.2f}")
    return ""


def throughput_lines(r: dict[str, Any]) -> list[str]:
    rows = r.get("rows") or []
    if not rows:
        return []
    lines = [f"{'model':<14} {'mb_tok':>6} {'mbs':>3} {'train tok/s':>11} {'MFU':>6} {'logp tok/s':>11} {'MFU':>6} "
             f"{'peak GiB':>8}"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['model']:<14} {row.get('budget', '-')!s:>6} {row['status']}: {row.get('error', '')[:80]}")
            continue
        mem = f"{row['peak_mem_gib']:.1f}" if row.get("peak_mem_gib") is not None else "-"
        lines.append(f"{row['model']:<14} {row['budget']:>6} {row['micro_batches']:>3} {row['train_tok_s']:>11.0f} "
                     f"{row['train_mfu']:>6.1%} {row['logp_tok_s']:>11.0f} {row['logp_mfu']:>6.1%} {mem:>8}")
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    sections = report["sections"]
    mode = " (SMOKE: CPU, tiny shapes; not GPU numbers)" if report["smoke"] else ""
    lines = ["", f"GPU check summary{mode}", f"{'section':<11} {'status':<7} {'sec':>6}  headline"]
    for name in SECTIONS:
        r = sections.get(name, {"status": "SKIPPED", "error": "not run"})
        lines.append(f"{name:<11} {r['status']:<7} {r.get('seconds', 0.0):>6.1f}  {headline(name, r)}")
    lines += throughput_lines(sections.get("throughput", {}))
    ok = sum(1 for n in SECTIONS if sections.get(n, {}).get("status") == "ok")
    lines.append(f"gpu_check_sections_ok: {ok}/{len(SECTIONS)}")
    return lines


# ---- main ----------------------------------------------------------------------------------------------------
def run_section(name: str, plan: Plan, out_dir: Path, workdir: Path, timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        if name == "env":
            data = section_env(plan)
        elif name in WORKER_SECTIONS:
            data = section_worker(name, plan, out_dir, workdir, timeout)
        elif name == "pytest":
            data = section_pytest(plan, out_dir, timeout)
        elif name == "lora":
            data = section_lora(plan, workdir, timeout)
        else:
            data = section_tiny(plan, out_dir, workdir, timeout)
    except Exception as exc:  # recorded as FAILED; the next section still runs
        log.exception("section %s failed", name)
        data = {"status": "FAILED", "error": error_text(exc)}
    data.setdefault("status", "ok")
    data["seconds"] = time.perf_counter() - t0
    return data


def run_all(plan: Plan, out_dir: Path, workdir: Path, selected: tuple[str, ...]) -> dict[str, Any]:
    """Every selected section within the budget; gpu_check.json rewritten after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + plan.budget_s
    report: dict[str, Any] = {"smoke": plan.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": plan.budget_s, "sections": {}}
    for i, name in enumerate(SECTIONS):
        if name not in selected:
            report["sections"][name] = {"status": "SKIPPED", "error": "not selected (--sections)"}
            continue
        reserve = sum(plan.floors[s] for s in SECTIONS[i + 1:] if s in selected)
        timeout = min(plan.caps[name], deadline - time.monotonic() - reserve)
        if timeout < plan.floors[name]:
            report["sections"][name] = {"status": "SKIPPED", "error": f"budget: {timeout:.0f} s left for it"}
            continue
        if name != "env" and not plan.smoke and not report["sections"].get("env", {}).get("cuda_available", True):
            report["sections"][name] = {"status": "SKIPPED", "error": "no CUDA device (see env)"}
            continue
        log.info("section %s (limit %.0f s)", name, timeout)
        result = run_section(name, plan, out_dir, workdir, timeout)
        report["sections"][name] = result
        log.info("section %s: %s in %.1f s %s", name, result["status"], result["seconds"],
                 "" if result["status"] == "ok" else f"-- {result.get('error')}")
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = plan.budget_s - (deadline - time.monotonic())
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check with tiny shapes")
    p.add_argument("--out", default=None, help="logs + gpu_check.json (default: $OUT, else ./gpu_check_out)")
    p.add_argument("--workdir", default=None, help="scratch space: run dirs, checkpoints (default: a temp dir)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list out of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None, help="overall wall-clock budget (default 240; smoke 300)")
    p.add_argument("--tiny-steps", type=int, default=None, help="train.steps of the tiny DAPO job (default 8)")
    p.add_argument("--worker", choices=WORKER_SECTIONS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import dataclasses
    import tempfile

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    plan = smoke_plan() if args.smoke else gpu_plan()
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    if args.tiny_steps is not None:
        plan = dataclasses.replace(plan, tiny_steps=args.tiny_steps)
    if args.worker:
        return worker_main(args.worker, plan, Path(args.result), Path(args.workdir))
    selected = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(selected) - set(SECTIONS))
    if unknown:
        print(f"gpu_check: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_")).resolve()
    report = run_all(plan, out_dir, workdir, selected)
    print("\n".join(summary_lines(report)), flush=True)
    return 0 if all(report["sections"][s]["status"] == "ok" for s in selected) else 1


if __name__ == "__main__":
    sys.exit(main())
