"""``dapo-mcore rehearse RECIPE [key=value ...] [--nproc-per-node N]``: a recipe at its own shape on a CPU.

A cluster recipe fails on first use for reasons no GPU is needed to see: a layout the code cannot split, a collective
on a tensor NCCL refuses, a switch that crashes with more than one process, a resume that does not. A rehearsal keeps
the recipe's model family and every switch (tensor/pipeline/virtual/expert/data parallel, sequence parallel, the
async split and its engine ranks, routing replay, rollout correction, streaming and partial rollouts) and shrinks the
rest: the model to a few layers and widths of the same family (heads, layers and experts kept divisible), every
parallel dimension above 1 to 2, the batch to a few prompts, the data to the synthetic task, the closing evaluation
to ``EVAL_PROMPTS`` held-out prompts (``eval.max_prompts``; the whole held-out split, 1,000-1,600 prompts, cost the
tool-use recipe two minutes of sandboxed calls, what it rehearses is the evaluation path). It runs two steps, kills
one rank at the start of the third (``kill -9``), resumes and finishes it, with NCCL-on-CPU on
(``DAPO_MCORE_STRICT_DEVICE=1``: a collective of ours on a CPU tensor fails as it would on a GPU), and ends in one line
saying what was rehearsed and what a CPU cannot rehearse. `shrink` is the mapping (pure); `main` runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_mcore.errors import UserError
from dapo_mcore.model.hf_config import expert_count, is_moe

__all__ = ["Rehearsal", "main", "shrink", "shrunk_model"]

MAX_WORLD = 8
"""The most gloo processes a rehearsal starts by default (a 2-core machine runs 8 tiny ranks, slowly)."""
STEPS = 3
"""Two steps, a kill at the start of the third, a resume that finishes it."""
EVAL_PROMPTS = 8
"""Held-out prompts of the evaluation that closes the rehearsal (the last step's)."""


def _two(n: int | None) -> int:
    return 2 if n and n > 1 else 1


def shrunk_model(hf: dict[str, Any], pp: int, vpp: int | None, tools: bool = False) -> dict[str, Any]:
    """``hf``'s family at a tiny shape on the tiny tokenizer's vocabulary: 4 heads of 32 (KV 2 under grouped-query
    attention, else 4: both split by TP 2), layers a multiple of the pipeline's stages, 4 experts (2 per EP rank),
    top-k at most 2; the family's switches (tied embeddings, QKV bias, top-k normalisation, dense layers) kept.
    ``tools``: the tool task's vocabulary (the tiny one plus the tool-call markers, 48 rows)."""
    from dapo_mcore.model.hf_config import FAMILIES, supported_text

    family = hf.get("model_type")
    if family not in FAMILIES:  # the one family table train, config, plan and verify read
        raise UserError(f"rehearse: model_type={family!r} is not one this trainer runs; dapo-mcore trains "
                        f"{supported_text()}.")
    stages = pp * (vpp or 1)
    gqa = hf.get("num_key_value_heads", hf["num_attention_heads"]) < hf["num_attention_heads"]
    out: dict[str, Any] = dict(
        model_type=family, hidden_size=128, intermediate_size=128, num_hidden_layers=max(2, stages),
        num_attention_heads=4, num_key_value_heads=2 if gqa else 4, head_dim=32, vocab_size=48 if tools else 32,
        max_position_embeddings=128, rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=10000.0,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    if family in ("qwen3", "llama"):
        out["attention_bias"] = bool(hf.get("attention_bias", False))
    if family == "llama":  # its RoPE variant kept (llama3 scaling: all four values, as the family is released)
        from dapo_mcore.model.hf_config import rope_parameters

        rope = rope_parameters(hf)
        if rope.get("rope_type") == "llama3":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["mlp_bias"] = False
    if family == "qwen3_moe":
        dense_first = bool(hf.get("mlp_only_layers"))
        out.update(num_experts=4, num_experts_per_tok=min(2, int(hf["num_experts_per_tok"])),
                   moe_intermediate_size=32, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   decoder_sparse_step=1, mlp_only_layers=[0] if dense_first else [],
                   router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), attention_bias=False)
        if dense_first and out["num_hidden_layers"] < 2 * stages:
            out["num_hidden_layers"] = 2 * stages  # a dense layer and a sparse one on the stages
    return out


@dataclass
class Rehearsal:
    """What a rehearsal runs: the shrunk model, the overrides on top of the recipe's, the processes, and what it
    keeps and leaves out (for the closing line)."""

    hf: dict[str, Any] | None
    """The shrunk model's config.json; None for a recipe on the embedded tiny base (already CPU-sized: kept)."""
    overrides: list[str]
    world: int
    kept: list[str] = field(default_factory=list)
    not_rehearsed: list[str] = field(default_factory=list)
    tools: bool = False
    """The recipe uses a tool (rollout.tools): the shrunk model is pre-trained on the tiny tool task."""


def _layout(cfg: Any, moe: bool, tiny: bool, nproc: int | None) -> tuple[int, int, int | None, int, int, int]:
    """(TP, PP, VPP, EP, DP, engine ranks) of the rehearsal: each recipe dimension > 1 at 2; DP 2 for a cluster
    recipe (1 if that would pass MAX_WORLD processes), 1 for a CPU recipe, or what ``nproc`` leaves."""
    p, r = cfg.parallel, cfg.rollout
    tp, pp, ep = _two(p.tensor_parallel), _two(p.pipeline_parallel), _two(p.expert_parallel)
    if moe and tp > 1:  # MoE with TP needs sequence parallelism: 4 ranks more for TP=2 x DP=2 (the tests run it)
        tp = 1
    vpp = 2 if p.virtual_pipeline and p.virtual_pipeline > 1 else None
    engines = _two(r.pipeline.engine_ranks) if r.pipeline.mode == "async" else 0
    model_parallel = tp * pp
    if nproc is not None:
        dp, rest = divmod(nproc - engines, model_parallel)
        if rest or dp < 1 or dp % ep:
            raise UserError(f"rehearse --nproc-per-node {nproc}: the rehearsal's layout needs (TP {tp} x PP {pp} x DP, "
                            f"DP a multiple of EP {ep}) + {engines} engine ranks; use "
                            f"{model_parallel * max(ep, 1) + engines} or {2 * model_parallel * max(ep, 1) + engines}.")
    elif tiny:
        dp = 1  # a CPU recipe on the embedded tiny base: one process is its shape
    else:
        dp = 2  # a cluster recipe runs data parallel: rehearse it, unless the world would not fit
        if model_parallel * dp + engines > MAX_WORLD:
            dp = max(ep, 1)
    return tp, pp, vpp, ep, dp, engines


def shrink(cfg: Any, hf: dict[str, Any], *, vllm_installed: bool, nproc: int | None = None) -> Rehearsal:
    """The rehearsal of the resolved recipe ``cfg`` (a Config) whose model is ``hf`` (its config.json)."""
    p, r, a = cfg.parallel, cfg.rollout, cfg.algo
    tiny = bool(cfg.model.tiny_base and not cfg.model.hf_path)
    moe = is_moe(hf)
    tp, pp, vpp, ep, dp, engines = _layout(cfg, moe, tiny, nproc)
    world = tp * pp * dp + engines
    sp = False  # the local layer spec (the only one on a CPU) has no sequence parallelism: TE's has
    kept = [f"TP={tp}", f"PP={pp}"] + ([f"VPP={vpp}"] if vpp else []) + ([f"EP={ep}"] if ep > 1 else [])
    kept += [f"DP={dp}"] + (["SP"] if sp else [])
    if engines:
        kept.append(f"async with {engines} engine ranks")
    not_rehearsed = ["FP8" if cfg.model.fp8.enabled else None, "TE kernels" if cfg.model.layer_spec ==
                     "transformer_engine" else None, "NCCL itself (simulated on gloo)"]
    if p.distributed_optimizer:
        not_rehearsed.append("the distributed optimizer (NCCL only)")
    engine = r.engine
    if engine == "vllm" and not vllm_installed:
        engine = "hf"
        not_rehearsed.append("vLLM (not installed: the transformers engine generates instead)")
    elif engine == "vllm" and r.vllm.tensor_parallel > 1:
        kept.append("vLLM TP=2")
    if engine == "vllm" and r.vllm.engines == "instances":
        kept.append("vLLM engines as independent instances")
    if a.router_replay != "none":
        kept.append(f"router_replay={a.router_replay}")
    if a.tis_cap is not None or a.rollout_correction.active:
        kept.append("rollout correction")
    sched = r.schedule
    kept += [name for name, on in (("streaming", sched.streaming), ("partial", sched.partial),
                                   ("completion order", sched.order == "completion")) if on]
    if p.tensor_parallel > 1 and moe:
        not_rehearsed.append("TP with MoE (with sequence parallelism; TP=2 x EP=2 at expert-TP 1 and 2 runs in the "
                             "project's CPU tests, not here)")
    if moe and p.expert_tensor_parallel != 1:
        not_rehearsed.append(f"expert-TP {p.expert_tensor_parallel} (TP is 1 here)")
    if p.sequence_parallel:
        not_rehearsed.append("sequence parallel (TP is 1 here)" if moe else "sequence parallel (TE layers only)")
    if not str(cfg.data.train).startswith("task:"):
        not_rehearsed.append(f"the data ({cfg.data.train}: the synthetic task instead)")
    prompts = 2 * dp
    tools = bool(r.tools.enabled)
    if tools:
        kept.append(f"tool use ({r.tools.tool}, sandbox {r.tools.sandbox})")
        if r.tools.python:
            not_rehearsed.append(f"the tool interpreter (rollout.tools.python={r.tools.python}: the system python3 "
                                 "instead)")
    task = "mul2tool" if tools else "max4"
    lengths = (["rollout.max_new_tokens=32", "algo.overlong_max_len=32", "algo.overlong_cache_len=4",
                "rollout.tools.max_output_tokens=8", "rollout.tools.pool_size=1"] if tools else
               ["rollout.max_new_tokens=6", "algo.overlong_max_len=6", "algo.overlong_cache_len=2"])
    model = [] if tiny else ["model.tiny_base=false", "model.preset=null", "model.mcore_path=null",
                             "model.params_dtype=float32", "model.make_vocab_size_divisible_by=16",
                             f"data.train=task:{task}", f"data.eval=task:{task}", "data.max_prompt_len=32",
                             "reward.name=math_dapo", "rollout.n=4", "algo.max_gen_batches=20", *lengths]
    # (a CPU recipe keeps its lengths and group size: its task may need them, e.g. a worked chain of 40 tokens)
    overrides = [
        *model, "model.layer_spec=local", "model.fp8.enabled=false",
        f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}",
        f"parallel.virtual_pipeline={vpp if vpp else 'null'}", f"parallel.expert_parallel={ep}",
        *([f"parallel.expert_tensor_parallel={min(p.expert_tensor_parallel, tp)}"] if moe else []),
        f"parallel.sequence_parallel={str(sp).lower()}", "parallel.distributed_optimizer=false",
        "parallel.backend=gloo", "parallel.timeout_minutes=5", "parallel.offload_for_rollout=false",
        f"rollout.engine={engine}", f"rollout.gen_batch_prompts={prompts}",
        f"train.prompts_per_step={prompts}", f"train.mini_batch_prompts={dp}", "train.micro_batch_tokens=512",
        "train.epochs=1", "optim.warmup_steps=0", f"train.steps={STEPS}",
        "eval.every=0", "eval.at_start=false", "eval.k=2", f"eval.max_prompts={EVAL_PROMPTS}", "eval.max_new_tokens=null",
        "checkpoint.every=1", "checkpoint.keep_last=2", "run.resume=auto", "telemetry.wandb.project=null"]
    if engines:
        overrides += [f"rollout.pipeline.engine_ranks={engines}", "rollout.pipeline.bucket_mb=1"]
    if tools and r.tools.python:
        overrides.append("rollout.tools.python=")  # the site's tool environment is not on this machine
    if engine == "vllm":
        overrides += [f"rollout.vllm.tensor_parallel={_two(r.vllm.tensor_parallel)}", "rollout.vllm.enforce_eager=true"]
    if cfg.reward.workers > 1:
        overrides.append("reward.workers=1")  # the pool, with one process: four would crowd a 2-core machine
    if sched.streaming:
        overrides.append(f"rollout.schedule.stream_chunk_prompts={dp}")
    return Rehearsal(None if tiny else shrunk_model(hf, pp, vpp, tools), overrides, world, kept,
                     [n for n in not_rehearsed if n], tools)


def recipe_model(cfg: Any) -> tuple[dict[str, Any], str]:
    """The recipe's model config.json and where it came from: ``model.hf_path`` if it is on this machine, the preset,
    the tiny base, or the preset the path's last component names (a login node without /models: `infer_preset`,
    as ``config`` and ``plan`` do)."""
    from dapo_mcore.commands.config import infer_preset
    from dapo_mcore.model.presets import PRESET_NAMES, preset_config

    m = cfg.model
    if m.hf_path and (Path(m.hf_path) / "config.json").is_file():
        return json.loads((Path(m.hf_path) / "config.json").read_text()), m.hf_path
    if m.preset:
        return preset_config(m.preset), f"preset {m.preset}"
    if m.tiny_base and not m.hf_path:
        return {**preset_config(cfg.tiny_base.preset), "model_type": "qwen2"}, "the tiny base"
    inferred, _ = infer_preset(cfg)
    if inferred.model.preset is None:
        raise UserError(f"rehearse: model.hf_path={m.hf_path!r} is not on this machine and names no preset; give "
                        f"model.hf_path=DIR (a directory with its config.json) or model.preset=NAME with one of "
                        f"{', '.join(PRESET_NAMES)}.")
    name = inferred.model.preset
    return preset_config(name), f"preset {name} (named by {m.hf_path}, which is not on this machine)"


def _base(hf: dict[str, Any], cache: Path, tools: bool = False) -> Path:
    """The shrunk model pre-trained briefly on the synthetic task (cached by its config), with the tiny tokenizer;
    ``tools``: on the tool task (its calls in ReTool's format), with the tool task's tokenizer."""
    import torch
    import transformers

    from dapo_mcore.data.base_model import pretrain
    from dapo_mcore.data.tiny_base_settings import TinyBaseSettings
    from dapo_mcore.data.tokenizer import build_tiny_tokenizer

    key = hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest()[:12]
    out = cache / "rehearse" / f"{hf['model_type']}-{key}"
    if (out / "config.json").is_file():
        return out
    cfg = dict(hf)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokenizer = build_tiny_tokenizer(tools=tools)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pretrain(model, tokenizer, TinyBaseSettings(task="mul2tool", steps=150) if tools else TinyBaseSettings(steps=150))
    finally:
        torch.set_num_threads(threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".making-"))  # whole or absent: renamed into place
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if not out.exists():
        os.replace(tmp, out)
    return out


def _train(recipe: str, overrides: list[str], world: int, log: Path, fault: str | None) -> int:
    env = dict(os.environ, DAPO_MCORE_STRICT_DEVICE="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    env.pop("DAPO_MCORE_FAULT", None)
    if fault:
        env["DAPO_MCORE_FAULT"] = fault
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", recipe, *overrides, "--nproc-per-node", str(world)]
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    picked = [ln for ln in lines if ("Error" in ln and "EOFError" not in ln) or ln.startswith("dapo-mcore:")]
    return (picked or lines or ["no output"])[-1][:400]


def validate_as_written(cfg: Any) -> None:
    """The recipe's own rules, before it is shrunk (a layout it cannot run must not rehearse as one it can): every
    check ``config`` makes, at the smallest job the recipe's layout allows (DP 1 .. 64; the first refusal names the
    problem when none fits). ConfigError (exit 2) otherwise. The model is the preset its path names where the path is
    not on this machine."""
    from dapo_mcore.commands.config import infer_preset
    from dapo_mcore.config import ConfigError

    cfg, _ = infer_preset(cfg)
    cfg.model.validate()
    p, pipe = cfg.parallel, cfg.rollout.pipeline
    model_parallel = max(p.tensor_parallel, 1) * max(p.pipeline_parallel, 1)
    engines = pipe.engine_ranks if pipe.mode == "async" else 0
    first: ConfigError | None = None
    for dp in range(1, 65):
        try:
            cfg.validate(model_parallel * dp + max(engines, 0), check_files=False)
            return
        except ConfigError as err:
            first = first or err
    raise first


def rehearse(recipe: str, user_overrides: list[str], nproc: int | None, run_dir: Path | None) -> int:
    from dapo_mcore.config import load_config

    start = time.monotonic()
    cfg = load_config(recipe, user_overrides)
    validate_as_written(cfg)
    hf, source = recipe_model(cfg)
    try:
        import vllm  # noqa: F401

        vllm_installed = True
    except ImportError:
        vllm_installed = False
    plan = shrink(cfg, hf, vllm_installed=vllm_installed, nproc=nproc)
    cache = Path(os.environ.get("DAPO_MCORE_CACHE") or Path.home() / ".cache" / "dapo-mcore")
    base = [f"model.hf_path={_base(plan.hf, cache, plan.tools)}"] if plan.hf else []
    run = run_dir or Path(tempfile.mkdtemp(prefix="dapo-mcore-rehearse-")) / "run"
    log = run.parent / f"{run.name}.log"
    run.parent.mkdir(parents=True, exist_ok=True)
    overrides = [*user_overrides, *plan.overrides, *base, f"run.dir={run}"]
    killed_rank = 1 if plan.world > 1 else 0
    before = log.stat().st_size if log.is_file() else 0  # a --run-dir used before: its log is appended to
    first = _train(recipe, overrides, plan.world, log, fault=f"step:{STEPS}@{killed_rank}")
    done = sorted(p.name for p in (run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
    if f"step_{STEPS - 1:06d}" not in done:
        return _verdict(f"rehearse {recipe}: FAILED before the kill (exit {first}, checkpoints {done or 'none'}): "
                        f"{_last_error(log)} (log: {log})", 1)
    killed = launcher_dead_rank(_read_from(log, before)) or str(killed_rank)
    second = _train(recipe, overrides, plan.world, log, fault=None)
    text = log.read_text(errors="replace")
    finished = (run / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    if second != 0 or not finished or f"step_{STEPS - 1:06d} (step {STEPS - 1})" not in text:
        return _verdict(f"rehearse {recipe}: FAILED at the resume (exit {second}): {_last_error(log)} (log: {log})", 1)
    hf = plan.hf or hf
    return _verdict(passed_line(recipe, time.monotonic() - start, hf, plan, killed, first, source), 0)


DEAD_RANK = re.compile(r"^dapo-mcore: rank (\S+) died of ", re.M)
"""The launcher's line for a rank that died (``launcher.dead_rank_line``)."""


def launcher_dead_rank(text: str) -> str | None:
    """The rank the launcher named as dead in ``text`` (the last such line), or None where it named none (or could
    not tell: "rank ?")."""
    hits = [h for h in DEAD_RANK.findall(text) if h != "?"]
    return hits[-1] if hits else None


def _read_from(log: Path, offset: int) -> str:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def passed_line(recipe: str, seconds: float, hf: dict[str, Any], plan: Rehearsal, killed: str, first_exit: int,
                source: str) -> str:
    """The closing line of a rehearsal that passed; ``killed``: the rank the launcher named as dead."""
    family = hf["model_type"] + (f" ({expert_count(hf)} experts, top-{hf['num_experts_per_tok']})"
                                 if is_moe(hf) else "")
    return (f"rehearsed {recipe} on CPU in {seconds:.0f} s: {family}, {hf['num_hidden_layers']} layers, "
            f"{', '.join(plan.kept)} on {plan.world} gloo ranks with NCCL-on-CPU; {STEPS - 1} steps, rank {killed} "
            f"killed (-9) at step {STEPS} (exit {first_exit}), resumed and finished; model from {source}; "
            f"not rehearsed: {', '.join(plan.not_rehearsed)}.")


def _verdict(line: str, code: int) -> int:
    """The verdict, the rehearsal's last line of output: whatever this process wrote to stderr (warnings, logs) is
    out before it."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    print(line, flush=True)
    return code


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dapo-mcore rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="the recipe's YAML, e.g. examples/qwen3-30b-a3b.yaml")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    ap.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                    help=f"processes (default: the recipe's layout with each dimension > 1 at 2, at most {MAX_WORLD})")
    ap.add_argument("--run-dir", type=Path, default=None, help="where the rehearsal's run goes (default: a temp dir)")
    args = ap.parse_args(argv)
    return rehearse(args.recipe, args.overrides, args.nproc_per_node, args.run_dir)
