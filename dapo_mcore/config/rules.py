"""The cross-field rules of a run's config, one function per concern (layout, async split, experts, batches, rollout,
bypass, pipeline), each raising ConfigError with the fix. ``Config.validate`` / ``validate_layout`` call them; they
read the config tree and nothing else (no process group, no torch for a dense model)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from dapo_mcore.config.tree import ConfigError
from dapo_mcore.model.hf_config import is_moe

if TYPE_CHECKING:
    from dapo_mcore.config import Config


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _at_least(*checks: tuple[str, float, float]) -> None:
    """Refuse the first ``(key, value, minimum)`` whose value is below its minimum, naming that key alone."""
    for key, value, minimum in checks:
        if not value >= minimum:
            raise ConfigError(f"{key}={value!r} must be >= {minimum}.")


def validate_split(cfg: Config, world_size: int) -> None:
    """Async mode: the engines get ``engine_ranks`` ranks of their own, the trainer at least one model replica."""
    engines, p = cfg.rollout.pipeline.engine_ranks, cfg.parallel
    model_parallel = max(p.tensor_parallel, 1) * max(p.pipeline_parallel, 1)
    if engines < 1:
        raise ConfigError(f"rollout.pipeline.engine_ranks={engines} must be >= 1: the async mode runs the engines on "
                          f"ranks of their own; give them some of the {world_size} ranks (e.g. "
                          f"rollout.pipeline.engine_ranks={max(1, world_size // 2)}), or set rollout.pipeline.mode=sync.")
    if engines >= world_size:
        raise ConfigError(f"rollout.pipeline.engine_ranks={engines} leaves no trainer rank of the {world_size} launched: "
                          f"launch {engines + model_parallel} processes ({engines} engine ranks + {model_parallel} "
                          f"trainer ranks, a multiple of tensor_parallel x pipeline_parallel), lower "
                          "rollout.pipeline.engine_ranks, or set rollout.pipeline.mode=sync.")


def _launch_hint(cfg: Config, trainers: int, world_size: int, model_parallel: int) -> str:
    """What to launch when ``trainers`` ranks do not fit the model-parallel layout (sync: the world; async: the
    world minus the engine ranks)."""
    up = -(-trainers // model_parallel) * model_parallel
    if trainers == world_size:
        return f"launch a multiple of {model_parallel} processes"
    engines = world_size - trainers
    counts = sorted({c + engines for c in (up - model_parallel, up) if c > 0})
    return (f"launch {' or '.join(str(c) for c in counts)} processes ({engines} engine ranks + a multiple of "
            f"{model_parallel} trainer ranks), change rollout.pipeline.engine_ranks")


def validate_layout(cfg: Config, world_size: int, launched: int | None = None) -> None:
    """The model-parallel rules over the ``world_size`` ranks that train (``launched``: the job's ranks, more in
    async mode, where the engines have their own)."""
    shape = cfg.model.architecture(cfg.tiny_base.preset)
    heads, kv, layers = shape.num_heads, shape.num_kv_heads, shape.num_layers
    p = cfg.parallel
    for name, value in (("tensor_parallel", p.tensor_parallel), ("pipeline_parallel", p.pipeline_parallel)):
        if value < 1:
            raise ConfigError(f"parallel.{name}={value} must be >= 1.")
    if heads % p.tensor_parallel or kv % p.tensor_parallel:
        which = f"num_attention_heads={heads}" if heads % p.tensor_parallel else f"num_key_value_heads={kv}"
        both = ", ".join(str(d) for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0)
        raise ConfigError(f"parallel.tensor_parallel={p.tensor_parallel} does not divide {which}; use one that divides "
                          f"both {heads} heads and {kv} KV heads: {both}.")
    stages = p.pipeline_parallel * (p.virtual_pipeline or 1)
    if layers % stages:
        raise ConfigError(f"parallel.pipeline_parallel={p.pipeline_parallel} x virtual_pipeline={p.virtual_pipeline or 1} "
                          f"does not divide num_hidden_layers={layers}; use a pipeline_parallel among {_divisors(layers)}.")
    if p.virtual_pipeline is not None and p.pipeline_parallel < 2:
        raise ConfigError("parallel.virtual_pipeline needs parallel.pipeline_parallel >= 2; unset it or raise pipeline_parallel.")
    if p.sequence_parallel and p.tensor_parallel < 2:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel >= 2.")
    if p.sequence_parallel and cfg.model.layer_spec == "local" and cfg.model.hf_config(
            cfg.tiny_base.preset).get("model_type") != "qwen3_moe":
        raise ConfigError("parallel.sequence_parallel=true needs model.layer_spec=transformer_engine for a dense model "
                          "(the local spec runs it for MoE models only, where Megatron needs it with TP); set "
                          "parallel.sequence_parallel=false or model.layer_spec=transformer_engine.")
    _validate_experts(cfg, cfg.model.hf_config(cfg.tiny_base.preset), world_size)
    _validate_vllm_replay(cfg, world_size if launched is None else launched)
    if p.distributed_optimizer and p.backend == "gloo":
        raise ConfigError("parallel.distributed_optimizer=true needs NCCL (gloo has no reduce-scatter); with "
                          "parallel.backend=gloo set parallel.distributed_optimizer=false.")
    model_parallel = p.tensor_parallel * p.pipeline_parallel
    if world_size % model_parallel:
        launched = world_size if launched is None else launched
        who = (f"world size {world_size}" if launched == world_size else
               f"{world_size} trainer ranks ({launched} launched - rollout.pipeline.engine_ranks={launched - world_size})")
        raise ConfigError(f"{who} is not a multiple of tensor_parallel x pipeline_parallel = {model_parallel}; "
                          f"{_launch_hint(cfg, world_size, launched, model_parallel)} or change the layout.")
    if p.timeout_minutes <= 0:
        raise ConfigError("parallel.timeout_minutes must be > 0 (minutes; 10 by default, 30 in the 7B/32B configs).")


def _validate_experts(cfg: Config, hf: dict, world_size: int) -> None:
    """Expert parallelism and the MoE layout (model/moe.py, actor/parallel.py name the fix)."""
    if ("moe" not in str(hf.get("model_type", "")) and cfg.parallel.expert_parallel == 1
            and cfg.algo.router_replay != "rollout"):
        return  # a dense model without EP or replay: nothing to check, and the checks' modules import torch (3-5 s)
    from dapo_mcore.actor.parallel import expert_layout_error
    from dapo_mcore.model.moe_shape import MoEConfigError, MoEShape, check_expert_parallel

    p = cfg.parallel
    try:
        shape = MoEShape.from_hf(hf)
        check_expert_parallel(shape, p.expert_parallel)
    except MoEConfigError as exc:
        raise ConfigError(str(exc)) from None
    problem = expert_layout_error(world_size, p.tensor_parallel, p.pipeline_parallel, p.expert_parallel,
                                  p.expert_tensor_parallel if shape is not None else None)
    if problem:
        raise ConfigError(problem)
    if shape is not None and shape.moe_ffn_hidden_size % p.expert_tensor_parallel:
        raise ConfigError(f"parallel.expert_tensor_parallel={p.expert_tensor_parallel} does not divide "
                          f"moe_intermediate_size={shape.moe_ffn_hidden_size}; use 1 (every expert whole).")
    if cfg.algo.router_replay == "rollout":
        if shape is None:
            raise ConfigError("algo.router_replay=rollout needs an MoE model (model_type qwen3_moe); set "
                              "algo.router_replay=none for a dense model.")
        if cfg.rollout.schedule.partial:
            raise ConfigError("algo.router_replay=rollout with rollout.schedule.partial: a resumed partial response "
                              "carries no routes for its earlier tokens in this version; set rollout.schedule.partial="
                              "false or algo.router_replay=none.")
    if shape is not None and p.tensor_parallel > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.tensor_parallel={p.tensor_parallel} with an MoE model needs "
                          "parallel.sequence_parallel=true (Megatron requires it for MoE with TP).")


def expert_tensor_parallel(cfg: Config) -> int | None:
    """The expert-TP size Megatron is given: ``parallel.expert_tensor_parallel`` for an MoE model, None (Megatron's
    default, = TP, and nothing to split) for a dense one."""
    from dapo_mcore.model.moe_shape import MOE_MODEL_TYPES

    moe = cfg.model.hf_config(cfg.tiny_base.preset).get("model_type") in MOE_MODEL_TYPES
    return cfg.parallel.expert_tensor_parallel if moe else None


def vllm_engine_count(cfg: Config, launched: int) -> int:
    """How many vLLM engines run: the ranks running engines (all of them colocated, the engine ranks in async mode)
    over rollout.vllm.tensor_parallel."""
    engines = cfg.rollout.pipeline.engine_ranks if cfg.rollout.pipeline.mode == "async" else launched
    return max(1, engines // cfg.rollout.vllm.tensor_parallel)


def vllm_data_parallel(cfg: Config, launched: int) -> int:
    """vLLM's data-parallel size: every engine in one group (rollout.vllm.engines=data_parallel), or 1 for
    independent instances."""
    return 1 if cfg.rollout.vllm.engines == "instances" else vllm_engine_count(cfg, launched)


def _validate_vllm_replay(cfg: Config, launched: int) -> None:
    """Routed-expert capture needs vLLM's Model Runner V2, and vLLM data-parallel > 1 needs the V1 runner here
    (rollout/engines/vllm_engine.py ``pin_model_runner``; docs/rollout.md, "Routing replay with vLLM")."""
    if cfg.algo.router_replay != "rollout" or cfg.rollout.engine != "vllm":
        return
    dp = vllm_data_parallel(cfg, launched)
    if dp > 1:
        raise ConfigError(f"algo.router_replay=rollout with vLLM data-parallel {dp} (rollout.vllm.engines=data_parallel: "
                          f"{dp} engines of rollout.vllm.tensor_parallel={cfg.rollout.vllm.tensor_parallel} in one "
                          f"group): vLLM returns routed experts only from Model Runner V2, and a data-parallel group "
                          f"stays in lockstep only on the V1 runner; set rollout.vllm.engines=instances (each engine an "
                          f"independent vLLM instance, data-parallel 1), or algo.router_replay=none (algo.tis_cap "
                          f"bounds what routing mismatch is left).")


def validate_batches(cfg: Config, world_size: int) -> None:
    t = cfg.train
    dp = world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
    _at_least(("train.prompts_per_step", t.prompts_per_step, 1), ("train.mini_batch_prompts", t.mini_batch_prompts, 1),
              ("train.epochs", t.epochs, 1), ("train.steps", t.steps, 0))
    if not 0 <= t.seed < 2**31:
        raise ConfigError(f"train.seed={t.seed} must lie in 0 .. 2**31 - 1 = {2**31 - 1} (torch, Megatron's per-rank "
                          "seed offsets and the engines' seeds all take it); pick a smaller seed.")
    if t.prompts_per_step % t.mini_batch_prompts:
        raise ConfigError(f"train.mini_batch_prompts={t.mini_batch_prompts} does not divide train.prompts_per_step="
                          f"{t.prompts_per_step}; use one of {_divisors(t.prompts_per_step)}.")
    rollouts_per_mini = t.mini_batch_prompts * cfg.rollout.n
    if rollouts_per_mini % dp:
        raise ConfigError(f"a mini-batch holds {rollouts_per_mini} responses, which {dp} data-parallel ranks cannot share "
                          f"equally; make train.mini_batch_prompts x rollout.n a multiple of {dp}.")
    pp = cfg.parallel.pipeline_parallel
    if cfg.parallel.virtual_pipeline and rollouts_per_mini // dp < pp:
        raise ConfigError(f"parallel.virtual_pipeline={cfg.parallel.virtual_pipeline}: Megatron's interleaved schedule "
                          f"runs micro-batches in groups of pipeline_parallel={pp}, and a mini-batch gives each of the "
                          f"{dp} data-parallel ranks {rollouts_per_mini // dp} responses, too few for {pp} "
                          f"micro-batches; raise train.mini_batch_prompts x rollout.n to at least {pp * dp} or unset "
                          "parallel.virtual_pipeline.")
    o, c = cfg.optim, cfg.checkpoint
    _at_least(("train.micro_batch_tokens", t.micro_batch_tokens, 1), ("optim.warmup_steps", o.warmup_steps, 0),
              ("optim.grad_clip", o.grad_clip, 0), ("checkpoint.every", c.every, 0), ("checkpoint.keep_last", c.keep_last, 1))
    if not o.lr > 0:  # also refuses NaN
        raise ConfigError(f"optim.lr={o.lr!r} must be > 0 (e.g. optim.lr=1e-6, the DAPO paper's value).")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps!r} must be > 0: Adam divides by sqrt(v) + eps, and v is 0 for a "
                          "gradient that is 0 (e.g. optim.eps=1e-8).")
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas[{i}]={beta!r} must lie in [0, 1) (Adam: [0.9, 0.999]).")
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas={list(o.betas)} must hold two values (Adam: [0.9, 0.999]).")
    _at_least(("optim.weight_decay", o.weight_decay, 0), ("optim.skip_nonfinite_updates", o.skip_nonfinite_updates, 0))


def validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if r.n < 1:
        raise ConfigError(f"rollout.n={r.n}: need at least 1 response per prompt (DAPO uses 16).")
    if r.n < 2 and cfg.algo.dynamic_sampling:
        raise ConfigError("rollout.n=1 makes every group all-right or all-wrong, so dynamic sampling keeps nothing; "
                          "use rollout.n >= 2 or algo.dynamic_sampling=false.")
    if r.n < 2 and cfg.algo.advantage_estimator == "rloo":
        raise ConfigError(f"rollout.n={r.n}: algo.advantage_estimator=rloo compares each response with the other "
                          "responses to its prompt; use rollout.n >= 2 or algo.advantage_estimator=grpo.")
    _at_least(("rollout.gen_batch_prompts", r.gen_batch_prompts, 1), ("rollout.max_new_tokens", r.max_new_tokens, 1))
    if not cfg.algo.dynamic_sampling and r.gen_batch_prompts != cfg.train.prompts_per_step:
        what = "train on fewer groups" if r.gen_batch_prompts < cfg.train.prompts_per_step else "drop the surplus groups"
        raise ConfigError(
            f"algo.dynamic_sampling=false trains on exactly one generation batch, but rollout.gen_batch_prompts="
            f"{r.gen_batch_prompts} differs from train.prompts_per_step={cfg.train.prompts_per_step} (it would {what}); "
            f"set rollout.gen_batch_prompts={cfg.train.prompts_per_step}, or algo.dynamic_sampling=true.")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={r.top_p!r} must lie in (0, 1] (1.0 disables nucleus sampling).")
    if not r.temperature > 0:
        raise ConfigError(f"rollout.temperature={r.temperature!r} must be > 0 (1.0 samples the model's distribution).")
    vocab = int(cfg.model.hf_config(cfg.tiny_base.preset)["vocab_size"])
    outside = [t for t in r.stop_token_ids if not 0 <= t < vocab]
    if outside:
        raise ConfigError(f"rollout.stop_token_ids={list(r.stop_token_ids)}: {outside} lie outside the vocabulary "
                          f"[0, {vocab}); use token ids of the model's tokenizer.")
    try:
        r.schedule.validate(r.n, cfg.algo.dynamic_sampling)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if r.schedule.partial and not cfg.algo.correction.active:
        raise ConfigError("rollout.schedule.partial trains on tokens an older policy sampled; they need an off-policy "
                          "correction: set algo.tis_cap (e.g. 2.0) or algo.rollout_correction.preset (e.g. token_tis)")
    _validate_bypass(cfg)
    _validate_pipeline(cfg)
    validate_tools(cfg)
    if r.engine == "vllm" and not 0.0 < r.vllm.gpu_memory_utilization < 1.0:
        raise ConfigError("rollout.vllm.gpu_memory_utilization must lie in (0, 1).")
    if cfg.algo.overlong_shaping and cfg.algo.overlong_max_len > r.max_new_tokens:
        raise ConfigError(f"algo.overlong_max_len={cfg.algo.overlong_max_len} exceeds rollout.max_new_tokens="
                          f"{r.max_new_tokens}: responses can never be that long; set them equal (L_max).")
    _at_least(("eval.k", cfg.eval.k, 1), ("eval.every", cfg.eval.every, 0))
    if cfg.eval.max_prompts is not None:
        _at_least(("eval.max_prompts", cfg.eval.max_prompts, 1))
    if not cfg.eval.temperature > 0:
        raise ConfigError(f"eval.temperature={cfg.eval.temperature!r} must be > 0 (DAPO: 1.0).")
    if not 0.0 < cfg.eval.top_p <= 1.0:
        raise ConfigError(f"eval.top_p={cfg.eval.top_p!r} must lie in (0, 1] (DAPO: 0.7).")
    ps = cfg.run.profile_steps
    if ps and (len(ps) != 2 or ps[0] < 1 or ps[1] < ps[0]):
        raise ConfigError(f"run.profile_steps={ps} must be [first, last] with 1 <= first <= last (e.g. [3, 4]), or [].")


def trainer_world(cfg: Config, world_size: int) -> int:
    """Ranks that train: all of them, or those the async mode does not give to the engines."""
    return world_size - cfg.rollout.pipeline.engine_ranks if cfg.rollout.pipeline.mode == "async" else world_size


def ignored_async_keys(cfg: Config) -> list[str]:
    """``key=value`` of the async-only settings (``rollout.pipeline.*`` besides ``mode``) that differ from their
    defaults in a sync config: set, and ignored."""
    pipe = cfg.rollout.pipeline
    if pipe.mode == "async":
        return []
    default = type(pipe)()  # the tree's own class: this module reads the tree and never imports it
    return [f"rollout.pipeline.{f.name}={getattr(pipe, f.name)}" for f in fields(pipe)
            if f.name != "mode" and getattr(pipe, f.name) != getattr(default, f.name)]


def _validate_bypass(cfg: Config) -> None:
    """Bypass mode takes the engine's log-probs as pi_old: they must be the distribution the tokens were sampled from.
    Both engines report log_softmax(logits / T) over the full vocabulary (SamplingParams.logprobs="processed"), which
    is the sampling distribution only without top-k/top-p truncation."""
    r = cfg.rollout
    if not cfg.algo.correction.bypass:
        return
    if r.top_p != 1.0 or r.top_k != -1:
        raise ConfigError(f"algo.rollout_correction bypass needs the engine's log-probs to be the sampling "
                          f"distribution, but rollout.top_p={r.top_p}, rollout.top_k={r.top_k} truncate it (the engines "
                          f"report log_softmax(logits/T) over the full vocabulary); set rollout.top_p=1.0 and "
                          f"rollout.top_k=-1, or use a decoupled preset (e.g. token_tis)")
    hf = cfg.model.hf_config(cfg.tiny_base.preset)
    aux = float(hf.get("router_aux_loss_coef") or 0.0)
    if is_moe(hf) and aux > 0:
        # bypass divides the gradients by denominators known only after the forward: the router's aux-loss
        # gradient, added inside the forward, would be divided too
        raise ConfigError(f"algo.rollout_correction bypass with an MoE model whose router_aux_loss_coef={aux} > 0 "
                          f"is not supported (the aux loss would be rescaled with the policy loss); use a decoupled "
                          f"preset (e.g. token_tis) or set router_aux_loss_coef to 0 in the model's config.json")


def _validate_pipeline(cfg: Config) -> None:
    pipe, r = cfg.rollout.pipeline, cfg.rollout
    if pipe.mode != "async":
        if pipe.max_staleness > 1:
            raise ConfigError(f"rollout.pipeline.max_staleness={pipe.max_staleness} bounds how far the engines of "
                              f"rollout.pipeline.mode=async run ahead; the synchronous loop trains on its own fresh "
                              f"batch: set rollout.pipeline.mode=async, or max_staleness=1")
        return
    if not cfg.algo.correction.active:
        raise ConfigError("rollout.pipeline.mode=async trains on responses the previous policy sampled; it needs an "
                          "off-policy correction: set algo.tis_cap (e.g. 2.0) or algo.rollout_correction.preset "
                          "(token_tis, seq_mis, icepop, geo_rs, bypass_ppo_clip, ...; see docs/rollout.md)")
    _at_least(("rollout.pipeline.engine_ranks", pipe.engine_ranks, 1),
              ("rollout.pipeline.max_staleness", pipe.max_staleness, 1), ("rollout.pipeline.bucket_mb", pipe.bucket_mb, 1e-3))
    if r.schedule.partial and pipe.max_staleness < 2:
        raise ConfigError("rollout.schedule.partial in async mode continues prefixes sampled two policy versions "
                          "before the step that trains on them: set rollout.pipeline.max_staleness=2 (or turn "
                          "rollout.schedule.partial off)")
    lead = pipe.max_staleness - (1 if r.schedule.partial else 0)
    if cfg.algo.correction.bypass and lead > 1:
        raise ConfigError(f"algo.rollout_correction bypass takes the rollout log-probs as pi_old, so with "
                          f"rollout.pipeline.max_staleness={pipe.max_staleness} its PPO clip would be anchored to a "
                          f"policy {lead} versions older than the one training (the engines run {lead} batches "
                          f"ahead): use a decoupled preset (token_tis, seq_mis, icepop: pi_old is recomputed), or "
                          f"max_staleness={1 + (1 if r.schedule.partial else 0)}")
    if r.engine == "vllm" and pipe.engine_ranks % r.vllm.tensor_parallel:
        raise ConfigError(f"rollout.pipeline.engine_ranks={pipe.engine_ranks} is not a multiple of "
                          f"rollout.vllm.tensor_parallel={r.vllm.tensor_parallel}: each vLLM engine is one TP group.")
    _validate_staging(cfg, lead)


def staged_host_bytes(params: int, bytes_per_param: int, lead: int, ranks_on_node: int, engine_tp: int = 1) -> int:
    """Host memory one engine node holds for received versions (async, lead D): each of its ``ranks_on_node`` engine
    ranks keeps at most D - 1 versions (``rollout.async_channels.VersionReceiver``: the one being received and the
    one being loaded into the engine count), each only its engine's shard (``rollout.pipeline.host_shard``): 1/k of
    ``params`` weights of ``bytes_per_param`` each at vLLM tensor parallel k (the norms every rank keeps whole are
    under 0.01% of a model; with expert parallelism the experts are split over at least as many ranks as with
    tensor parallelism). The planner prices the same (``plan.planner.estimate_host``)."""
    return max(lead - 1, 0) * ranks_on_node * -(-params // engine_tp) * bytes_per_param


def _validate_staging(cfg: Config, lead: int) -> None:
    pipe = cfg.rollout.pipeline
    _at_least(("rollout.pipeline.engine_ranks_per_node", pipe.engine_ranks_per_node, 1))
    if lead <= 1:
        return
    from dapo_mcore.telemetry.flops import ModelShape

    params = ModelShape.from_hf(cfg.model.hf_config(cfg.tiny_base.preset)).num_params()
    width = 2 if cfg.model.params_dtype == "bfloat16" else 4
    ranks = min(pipe.engine_ranks, pipe.engine_ranks_per_node)
    tp = cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1
    need = staged_host_bytes(params, width, lead, ranks, tp)
    if need > pipe.node_host_memory_gib * 2**30:
        raise ConfigError(f"rollout.pipeline.max_staleness={pipe.max_staleness} stages {lead - 1} received "
                          f"version(s) of {need / (lead - 1) / ranks / 2**30:.1f} GiB (the engine's shard at vLLM "
                          f"tensor_parallel={tp}) on each of {ranks} engine ranks per node: {need / 2**30:.0f} GiB > "
                          f"rollout.pipeline.node_host_memory_gib={pipe.node_host_memory_gib:g}; lower max_staleness "
                          f"(or fewer engine_ranks_per_node)")


def validate_tools(cfg: Config) -> None:
    """``rollout.tools``: its own ranges, then the one combination multi-turn rollouts do not run under: routing
    replay (the routes of tool tokens would have to come from the next turn's prefill). Every engine and schedule
    runs: the transformers engine and vLLM, colocated and async, streaming and partial rollouts."""
    t, r = cfg.rollout.tools, cfg.rollout
    t.validate()
    if not t.enabled:
        return
    if cfg.algo.router_replay != "none":
        raise ConfigError(f"rollout.tools.enabled with algo.router_replay={cfg.algo.router_replay}: multi-turn tool "
                          "rollouts run without routing replay; set algo.router_replay=none or "
                          "rollout.tools.enabled=false")
    if t.max_output_tokens >= r.max_new_tokens:
        raise ConfigError(f"rollout.tools.max_output_tokens={t.max_output_tokens} leaves no room for the model in "
                          f"rollout.max_new_tokens={r.max_new_tokens}; lower it (ReTool: a few hundred of 16384)")
