"""The engine ranks' start-up in async mode (``rollout.pipeline.mode=async``; the trainer ranks use ``runtime``).

An engine rank builds what the rollout side needs and nothing of the trainer's: the tokenizer, the stop set, the
engine (its weights come from the trainer's first publish), the data, the prompt sampler and scheduler, the
verifier, and the synchronous rollout side over the engine ranks' own process group. Then ``EngineLoop`` runs until
the trainer says stop.
"""

from __future__ import annotations

import logging
from typing import Any

from dapo_mcore.actor.parallel import LaunchEnv
from dapo_mcore.config import Config

log = logging.getLogger(__name__)

__all__ = ["run_engine_ranks"]


def _build_engine(cfg: Config, launch: LaunchEnv, role: Any, *args: Any) -> Any:
    """The engine over the engine side's process group; vLLM reads that group's ranks, not the job's
    (``vllm_engine.launcher_ranks``)."""
    from dapo_mcore.run import runtime

    if cfg.rollout.engine != "vllm":
        return runtime._build_engine(cfg, *args)
    from dapo_mcore.rollout.engines.vllm_engine import launcher_ranks

    with launcher_ranks(role.rank, role.size, launch.local_rank):
        return runtime._build_engine(cfg, *args)


def run_engine_ranks(cfg: Config, launch: LaunchEnv, bridge: Any) -> int:
    from dapo_mcore.data.sources import filter_by_length, load_prompt_records, prompt_encoder
    from dapo_mcore.data.tokenizer import load_tokenizer
    from dapo_mcore.rollout.pipeline.async_engines import EngineLoop
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups
    from dapo_mcore.run import runtime
    from dapo_mcore.telemetry.timers import PhaseTimer
    from dapo_mcore.weights.hf_checkpoint import read_hf_config

    role = bridge.role
    train_records = load_prompt_records(cfg.data, "train")
    eval_records = load_prompt_records(cfg.data, "eval")
    refusal = bridge.start()
    if refusal is not None:  # the trainer printed it; nothing started, nothing to resume
        log.info("engine rank %d: the trainer refused to start (%s)", role.rank, refusal)
        return 2
    bridge.barrier()  # the trainer's rank 0 has built (or found) the tiny base model
    hf_dir = runtime.resolve_base_model(cfg, launch)
    hf_config = cfg.model.hf_config(cfg.tiny_base.preset) if hf_dir is None else read_hf_config(hf_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or hf_dir)
    stops = runtime.run_stop_tokens(cfg, hf_dir, hf_config, tokenizer)
    train_records = runtime._drop_long(train_records, tokenizer, cfg, "train", filter_by_length)
    eval_records = runtime.eval_subset(runtime._drop_long(eval_records, tokenizer, cfg, "eval", filter_by_length), cfg)
    engine = _build_engine(cfg, launch, role, hf_dir, hf_config, tokenizer, stops)
    if cfg.rollout.tools.enabled:  # multi-turn tool rollouts: the tool pool runs on the engine ranks' CPUs
        from dapo_mcore.run.tool_engine import tool_engine

        engine = tool_engine(cfg, engine, tokenizer)
    closers: list = [engine.close]
    try:
        score = runtime.make_scorer(cfg.reward, closers)
        scheduler = runtime._build_scheduler(cfg, runtime._build_sampler(cfg, train_records))
        engine_tp = cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1
        groups = EngineGroups(role.size // engine_tp, role.rank // engine_tp, role.rank % engine_tp == 0,
                              routes_to=0 if cfg.algo.router_replay == "rollout" else None)  # rank 0 sends batches
        timer = PhaseTimer()
        rollouts = ColocatedRollouts(cfg, engine=engine, scheduler=scheduler, tokenizer=tokenizer, score=score,
                                     encode_prompt=prompt_encoder(tokenizer, cfg.data), timer=timer, groups=groups,
                                     streams=runtime._engine_streams(cfg, groups.count, engine))
        log.info("engine rank %d/%d ready (%d engine groups)", role.rank, role.size, groups.count)
        return EngineLoop(cfg, rollouts, engine, bridge, eval_records, timer).run()
    finally:
        for close in reversed(closers):
            close()
