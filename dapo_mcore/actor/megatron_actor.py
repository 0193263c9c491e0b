"""The Megatron actor: this rank's policy model, its optimizer, log-probs, and the DAPO update.

Every rank holds the full rollout batch (the trainer gathers it). The actor splits it over data-parallel ranks,
forms micro-batches by a token budget, and runs Megatron's ``get_forward_backward_func`` (pipeline schedules
included). The DAPO loss is a *contribution* normalized by mini-batch totals (``algo.loss``); Megatron divides a
returned loss by the number of micro-batches and averages gradients over data-parallel ranks, so the loss handed
to Megatron is multiplied by both to make the gradient exactly the sum of contributions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.actor.batch import MicroBatch, build_micro_batch, sequence_pad_multiple, to_device
from dapo_mcore.actor.logprobs import token_entropy, token_logprobs
from dapo_mcore.actor.nonfinite import NonFiniteGuard, grads_finite
from dapo_mcore.algo.loss import loss_denominators, masked_entropy_contrib, policy_loss
from dapo_mcore.algo.rollout_correction import CorrectionStats
from dapo_mcore.data.packing import pack_micro_batches

log = logging.getLogger(__name__)


@dataclass
class ActorSettings:
    """What the actor needs from the run config (kept flat so tests can build one directly)."""

    hf_config: dict[str, Any]
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False
    expert_parallel: int = 1  # MoE models: experts split over this many ranks inside data parallel
    expert_tensor_parallel: int | None = None  # MoE models: each expert split this many ways (None: = TP)
    router_replay: bool = False  # MoE models: replay the engine's routes (algo.router_replay=rollout; model/moe.py)
    layer_spec: str = "local"
    attention: str = "auto"  # core attention of the local spec: auto (= sdpa) | sdpa | megatron_local
    params_dtype: torch.dtype = torch.float32
    make_vocab_size_divisible_by: int = 128
    vocab_padding: str = "megatron"  # model.vocab_padding (the trainer passes it; see model/vocab.py)
    recompute: str = "none"
    fp8: Any = None
    distributed_optimizer: bool = False
    offload_for_rollout: bool = False
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    skip_nonfinite_updates: int = 0  # non-finite updates skipped in a row before the run stops (actor.nonfinite)
    micro_batch_tokens: int = 16384
    temperature: float = 1.0
    layout: str = "auto"
    pad_id: int = 0
    algo: Any = None  # AlgoConfig
    max_response_len: int | None = None
    lora: Any = None  # model.lora (LoRAConfig): adapters on the linear layers, base frozen; None or rank 0 = off
    seed: int = 0  # the run's seed: the adapters' initial A is drawn from it (model/lora/adapter.py)

    @property
    def seq_pad_multiple(self) -> int:
        """Micro-batch sequence lengths are padded to this (sequence parallel and FP8 alignment; see batch.py)."""
        recipe = self.fp8.recipe if self.fp8 is not None and self.fp8.enabled else None
        return sequence_pad_multiple(self.tensor_parallel, self.sequence_parallel, recipe)


@dataclass
class TrainSample:
    """One response to train on: token ids plus the per-token quantities of the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None   # [len(response_ids)]
    loss_mask: torch.Tensor | None = None       # [len(response_ids)]; default all ones
    tis_weights: torch.Tensor | None = None     # [len(response_ids)]
    extra: dict[str, Any] = field(default_factory=dict)


def _merge_metric(key: str, a: float | None, b: float) -> float:
    """Micro-batch / DP-rank merge of a metric contribution: sums, except the bypass statistics' min and max."""
    if a is None:
        return b
    if key == "bypass/w_min":
        return min(a, b)
    if key == "bypass/w_max":
        return max(a, b)
    return a + b


def _pad_stack(values: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.float()
    return out


def dapo_loss(mb: MicroBatch, logits: torch.Tensor, *, algo: Any, temperature: float, vocab_size: int,
              global_tokens: float, global_seqs: float, max_response_len: int | None,
              scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of one micro-batch from its (vocab-parallel) logits, as Megatron's schedule calls it.

    Returns the DAPO loss contribution times ``scale`` (Megatron divides by the micro-batch count and averages over
    DP: see the module docstring) and the metrics. Beside the logits it holds what the log-prob's backward needs;
    the entropy metric is computed without a graph, chunk by chunk (``token_entropy``), so it adds no
    [tokens, V/TP] fp32 copies to the training peak (``tests/test_planner_memory.py`` compares with the planner).
    """
    logp = mb.gather_responses(token_logprobs(logits, mb.targets, temperature, vocab_size))
    weights, keep, loss_mask, extra = mb.tis, None, mb.loss_mask, {}
    if algo.correction.bypass:
        weights, keep, extra = bypass_correction(logp, mb, algo.correction)
        loss_mask = loss_mask * keep if keep is not None else loss_mask
    loss, metrics = policy_loss(
        logp, mb.old_logp, mb.adv, mb.loss_mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip_c=algo.dual_clip_c, agg=algo.loss_agg, global_tokens=global_tokens,
        global_seqs=global_seqs, max_response_len=max_response_len, tis_weights=weights, keep=keep,
        objective=algo.objective)
    ent = mb.gather_responses(token_entropy(logits, temperature, vocab_size))
    metrics["entropy"] = masked_entropy_contrib(ent, loss_mask, global_tokens)
    metrics.update(extra)
    metrics["loss"] = loss.detach()
    return loss * scale, {k: v.detach().float().cpu() for k, v in metrics.items()}


def bypass_correction(logp: torch.Tensor, mb: MicroBatch, cfg: Any
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Bypass mode: weights and rejection of pi_theta (detached) against pi_rollout (``mb.old_logp``), batch
    normalization deferred (the actor scales the gradients by the global mean afterwards, see ``_bypass_scale``).
    Returns the loss's weights and keep mask (None where the correction has none) and additive ``bypass/*`` sums."""
    from dapo_mcore.algo.rollout_correction import correction_stats

    w, keep, stats = correction_stats(logp.detach() - mb.old_logp, mb.loss_mask, cfg, weight_mean=1.0)
    kept_tokens, kept_seqs = loss_denominators(mb.loss_mask * keep)
    extra = {f"bypass/{k}": torch.tensor(v, dtype=torch.float64)
             for k, v in zip(BYPASS_STATS, stats.as_vector(), strict=True)}
    extra["bypass/kept_tokens"] = torch.tensor(float(kept_tokens), dtype=torch.float64)
    extra["bypass/kept_seqs"] = torch.tensor(float(kept_seqs), dtype=torch.float64)
    return (w if cfg.is_level is not None else None), (keep if cfg.rs else None), extra


BYPASS_STATS = tuple(f.name for f in fields(CorrectionStats))
_LOSS_KEYS = ("loss", "pg_loss")  # divided by the aggregation's denominator; every other metric by kept tokens


class MegatronActor:
    """Builds and trains this rank's model chunks. Parallel state must be initialized first."""

    def __init__(self, settings: ActorSettings):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from dapo_mcore.model.qwen import QwenShape, build_gpt_model, transformer_config

        self.s = settings
        self.shape = QwenShape.from_hf(settings.hf_config)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        tconfig = transformer_config(
            settings.hf_config, tensor_parallel=settings.tensor_parallel, pipeline_parallel=settings.pipeline_parallel,
            virtual_pipeline=settings.virtual_pipeline, sequence_parallel=settings.sequence_parallel,
            params_dtype=settings.params_dtype, recompute=settings.recompute, fp8=settings.fp8,
            expert_parallel=settings.expert_parallel, routing_replay=settings.router_replay,
            expert_tensor_parallel=settings.expert_tensor_parallel, layer_spec_kind=settings.layer_spec)
        # Micro-batches of different shapes cross the pipeline with a shape handshake before each transfer; under
        # Megatron's interleaved schedule (virtual stages) that handshake deadlocks (seen at PP=2: the two stages
        # post different numbers of transfers where warm-up meets the steady state, and the shape and data messages
        # to the one neighbour fall out of step), so there every micro-batch is padded to one shape (`_shape_of`).
        tconfig.variable_seq_lengths = settings.pipeline_parallel > 1 and not settings.virtual_pipeline
        if settings.virtual_pipeline:
            # Batched p2p posts [send_prev, send_next] to a neighbour that receives [recv_prev, recv_next]: at PP=2
            # both neighbours are the one other stage, and gloo pairs messages in posting order, so gradients and
            # activations of one shape swapped places (a silently wrong update, measured: tests/test_actor_vpp.py).
            # Megatron's unbatched path orders even and odd stages to match (Megatron-LM's VPP default too).
            tconfig.batch_p2p_comm = False
            # The interleaved schedule then posts the next transfer before this chunk's compute and waits for it
            # after (Megatron's overlap_p2p_comm: interleaved schedules only, and never with batch_p2p_comm).
            tconfig.overlap_p2p_comm = True
        self.tconfig = tconfig
        chunks = build_gpt_model(settings.hf_config, tconfig, spec=settings.layer_spec,
                                 make_vocab_size_divisible_by=settings.make_vocab_size_divisible_by,
                                 attention=settings.attention, vocab_padding=settings.vocab_padding)
        for chunk in chunks:
            # Megatron's torch norms ignore params_dtype (fp32 weights in a bf16 model): cast like its Float16Module
            # does, so every parameter has one dtype (PP weight broadcasts allocate by dtype; fused rms_norm needs it).
            chunk.to(device=self.device, dtype=settings.params_dtype)
        self.lora = settings.lora if settings.lora is not None and settings.lora.enabled else None
        if self.lora is not None:  # before DDP and the optimizer: they then see the adapters alone
            from dapo_mcore.model.lora.attach import attach_lora

            attach_lora(chunks, self.lora, sequence_parallel=settings.sequence_parallel, seed=settings.seed,
                        inputs_require_grad=settings.recompute != "none")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=settings.distributed_optimizer)
        self.model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        opt_config = OptimizerConfig(
            optimizer="adam", lr=settings.lr, min_lr=0.0, weight_decay=settings.weight_decay,
            adam_beta1=settings.betas[0], adam_beta2=settings.betas[1], adam_eps=settings.eps,
            clip_grad=settings.grad_clip, bf16=settings.params_dtype == torch.bfloat16,
            params_dtype=settings.params_dtype, use_distributed_optimizer=settings.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        if settings.layout == "auto":
            self.layout = "thd" if settings.layer_spec == "transformer_engine" else "rows"
        else:
            self.layout = settings.layout
        self.pad_multiple = settings.seq_pad_multiple
        self.nonfinite = NonFiniteGuard(settings.skip_nonfinite_updates, settings.lr, settings.grad_clip)
        self.router_stats = None  # MoE: tokens per expert and aux loss of each update (model/moe.py)
        self.replay = None  # MoE: routing replay / routing-mismatch count (model/moe.py)
        self.routing_mismatch: float | None = None  # of the last old-log-prob pass (moe/routing_mismatch_frac)
        self.route_bytes_received = 0  # routing replay: route bytes this rank fetched from others (route_exchange)
        if tconfig.num_moe_experts:
            from dapo_mcore.model.moe import MoEShape, RouterReplay, RouterStats

            self.router_stats = RouterStats(chunks, tconfig.num_layers, tconfig.num_moe_experts)
            moe = MoEShape.from_hf(settings.hf_config)
            self.replay = RouterReplay(chunks, moe.moe_layers, settings.router_replay, settings.sequence_parallel)
            self.top_k = moe.topk
        self._routes_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.base_source: str | None = None  # where the weights were loaded from (load_hf / load_megatron)
        self._base_identity: dict | None = None

    # ---- weights -------------------------------------------------------------------------------------------
    @property
    def chunks(self) -> list[torch.nn.Module]:
        """The bare GPTModel chunks (unwrapped from DDP)."""
        return [m.module for m in self.model]

    def load_hf(self, hf_dir: str) -> None:
        """Load a Hugging Face checkpoint into the live model (this rank's slices only, streamed)."""
        from dapo_mcore.weights.live import load_hf_into_model

        self.base_source, self._base_identity = hf_dir, None  # LoRA: the base's identity (actor.lora_state)
        load_hf_into_model(self.chunks, hf_dir, layer_spec=self.s.layer_spec,
                           make_vocab_size_divisible_by=self.s.make_vocab_size_divisible_by,
                           vocab_padding=self.s.vocab_padding)
        self.refresh_main_params()

    def load_megatron(self, directory: str) -> None:
        """Load a Megatron checkpoint: this project's (``dapo-mcore convert`` output, any layout: resharded to this
        one) or a megatron-core dist checkpoint (Megatron-LM's or Megatron-Bridge's save dir, any layout)."""
        from pathlib import Path

        from dapo_mcore.weights import dist_checkpoint
        from dapo_mcore.weights.live import load_megatron_checkpoint_into_model

        self.base_source, self._base_identity = directory, None
        if dist_checkpoint.is_dist_checkpoint(directory):
            dist_checkpoint.load_into_model(self.chunks, directory)
            self.refresh_main_params()
            return
        load_megatron_checkpoint_into_model(self.chunks, Path(directory), reshard=True, cast=True,
                                            make_vocab_size_divisible_by=self.s.make_vocab_size_divisible_by,
                                            vocab_padding=self.s.vocab_padding)
        self.refresh_main_params()

    def refresh_main_params(self) -> None:
        """Megatron's mixed-precision optimizers keep fp32 main copies of bf16 (and FP8) weights, taken when the
        optimizer was built: weights loaded afterwards must reach them too, or the first update writes the random
        initial weights back into the model (plus the update). fp32 models train their weights directly."""
        self.optimizer.reload_model_params()

    def offload(self) -> None:
        """Grad buffers and optimizer state to CPU while the rollout engine needs the memory (if configured)."""
        if not self.s.offload_for_rollout:
            return
        self._require_offload_api()
        for m in self.model:
            m.offload_grad_buffers()
        self.optimizer.offload_to_cpu()

    def reload(self) -> None:
        """Back from CPU before training (if configured); grads come back zeroed."""
        if not self.s.offload_for_rollout:
            return
        for m in self.model:
            m.restore_grad_buffers()
        self.optimizer.restore_from_cpu()

    def _require_offload_api(self) -> None:
        if not (hasattr(self.model[0], "offload_grad_buffers") and hasattr(self.optimizer, "offload_to_cpu")):
            import megatron.core

            raise RuntimeError(f"parallel.offload_for_rollout=true needs Megatron-Core's RL offload hooks "
                               f"(DDP.offload_grad_buffers, optimizer.offload_to_cpu; megatron-core >= 0.16); found "
                               f"megatron-core {megatron.core.__version__}. Upgrade it or set the option to false.")

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- micro-batching ------------------------------------------------------------------------------------
    def _my_micro_batches(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        """Indices of this DP rank's micro-batches (token budget, balanced over DP ranks; with virtual pipeline stages
        a multiple of the pipeline's size, which Megatron's interleaved schedule needs)."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        multiple = self.s.pipeline_parallel if len(self.model) > 1 else 1
        per_rank = pack_micro_batches(lengths, self.s.micro_batch_tokens, self.dp_size, multiple)
        return per_rank[self.dp_rank]

    def _fetch_routes(self, samples: Sequence[TrainSample], groups: list[list[int]]) -> None:
        """Routing replay on several ranks: the routes of this rank's samples, from the rank that holds them
        (``actor.route_exchange``; a collective over the trainer ranks)."""
        if not self.s.router_replay or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        from dapo_mcore.actor.route_exchange import RoutesMissing, exchange_routes
        from dapo_mcore.collectives.device import collective_device

        try:
            self.route_bytes_received += exchange_routes(samples, [i for g in groups for i in g], collective_device())
        except RoutesMissing as exc:
            raise RuntimeError(str(exc)) from None

    def _shape_of(self, samples: Sequence[TrainSample], groups: list[list[int]]) -> tuple[int, int]:
        """(rows, length) every micro-batch is padded to: the largest of ``groups`` with virtual pipeline stages
        (their schedule needs one shape, see __init__), else (0, 0): each its own. Every rank of a pipeline has
        the same groups, so the same shape."""
        if len(self.model) == 1 or not groups:
            return 0, 0
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        if self.layout == "rows":
            return max(map(len, groups)), max(lengths[i] for g in groups for i in g)
        return 1, max(sum(lengths[i] for i in g) for g in groups)

    def _make_mb(self, samples: Sequence[TrainSample], indices: list[int], with_loss_inputs: bool,
                 shape: tuple[int, int] = (0, 0)) -> MicroBatch:
        chosen = [samples[i] for i in indices]
        mb = build_micro_batch([s.prompt_ids for s in chosen], [s.response_ids for s in chosen],
                               layout=self.layout, pad_id=self.s.pad_id, pad_to_multiple=self.pad_multiple,
                               min_rows=shape[0], min_len=shape[1])
        if with_loss_inputs:
            width = mb.resp_mask.shape[1]
            mb.old_logp = _pad_stack([s.old_logprobs for s in chosen], width)
            masks = [s.loss_mask if s.loss_mask is not None else torch.ones(len(s.response_ids)) for s in chosen]
            mb.loss_mask = _pad_stack(masks, width) * mb.resp_mask
            mb.adv = torch.tensor([s.advantage for s in chosen], dtype=torch.float32)
            mb.tis = (_pad_stack([s.tis_weights for s in chosen], width)
                      if chosen[0].tis_weights is not None else None)
        mb.indices = indices
        mb = to_device(mb, self.device)
        routes = [s.extra.get("routed_experts") for s in chosen]
        if self.s.router_replay and any(r is None for r in routes):
            raise RuntimeError("algo.router_replay=rollout but a rollout carries no routed experts (an engine or path "
                               "that does not record them); set algo.router_replay=none.")
        if self.replay is not None and routes and all(r is not None for r in routes):
            from dapo_mcore.actor.route_exchange import align_routes

            self._routes_of[id(mb)] = align_routes(routes, int(mb.tokens.shape[1]), self.layout != "rows", self.top_k,
                                                   rows=int(mb.tokens.shape[0]))
        return mb

    def _run(self, mbs: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.replay is not None:
                self.replay.begin(*self._routes_of.get(id(mb), (None, None)))
            output = model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
            return output, partial(loss_fn, mb)

        vpp = len(self.model)
        iterator = [iter(mbs) for _ in range(vpp)] if vpp > 1 else iter(mbs)
        seq_len = max(int(mb.tokens.shape[1]) for mb in mbs)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterator,
                model=self.model if vpp > 1 else self.model[0], num_microbatches=len(mbs),
                seq_length=seq_len, micro_batch_size=int(mbs[0].tokens.shape[0]), forward_only=forward_only)
        finally:
            if self.replay is not None:
                self.replay.end()
            self._routes_of.clear()

    # ---- log-probs -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample], with_entropy: bool = False
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-token log-probs (and entropy) of every sample's response, on every rank."""
        for m in self.model:
            m.eval()
        groups = self._my_micro_batches(samples)
        self._fetch_routes(samples, groups)
        shape = self._shape_of(samples, groups)
        mbs = [self._make_mb(samples, idx, with_loss_inputs=False, shape=shape) for idx in groups]
        vocab, temp = self.shape.vocab_size, self.s.temperature
        if self.replay is not None:
            self.replay.reset()

        def loss_fn(mb, logits):
            logp = mb.gather_responses(token_logprobs(logits, mb.targets, temp, vocab))
            out = {"logp": logp.cpu()}
            if with_entropy:
                out["entropy"] = mb.gather_responses(token_entropy(logits, temp, vocab)).cpu()
            return torch.zeros((), device=logits.device), out

        results = self._run(mbs, loss_fn, forward_only=True)
        local: dict[int, torch.Tensor] = {}
        if self.is_last_stage:
            for mb, res in zip(mbs, results, strict=True):
                for row, i in enumerate(mb.indices):
                    n = len(samples[i].response_ids)
                    parts = [res["logp"][row, :n]] + ([res["entropy"][row, :n]] if with_entropy else [])
                    local[i] = torch.cat(parts)
        widths = [len(s.response_ids) * (2 if with_entropy else 1) for s in samples]
        gathered = self._share_results(local, widths)
        if self.replay is not None:  # the old-log-prob pass: experts used vs the engine's (a collective)
            self.routing_mismatch = self.replay.mismatch()
        logps = [gathered[i][: len(s.response_ids)] for i, s in enumerate(samples)]
        ents = [gathered[i][len(s.response_ids):] for i, s in enumerate(samples)] if with_entropy else None
        return logps, ents

    def _share_results(self, local: dict[int, torch.Tensor], widths: list[int]) -> list[torch.Tensor]:
        """Every rank gets every sample's values (``widths[i]`` floats each) from the rank that computed them:
        TP rank 0 of the last PP stage of each DP rank sends, as two flat tensors (no pickling)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [local[i] for i in range(len(widths))]
        from megatron.core import parallel_state as ps

        from dapo_mcore.collectives.packed import all_gather_packed

        sender = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        mine = sorted(local) if sender else []
        ints = torch.tensor(mine, dtype=torch.int64)
        floats = torch.cat([local[i] for i in mine]) if mine else torch.zeros(0)
        out: list[torch.Tensor | None] = [None] * len(widths)
        for idx, vals in all_gather_packed(ints, floats):
            offset = 0
            for i in idx.tolist():
                out[i] = vals[offset:offset + widths[i]]
                offset += widths[i]
        assert all(o is not None for o in out), "every sample is computed by exactly one sender"
        return out  # type: ignore[return-value]

    # ---- the DAPO update -----------------------------------------------------------------------------------
    def train_mini_batch(self, samples: Sequence[TrainSample], lr: float) -> dict[str, float]:
        """One optimizer update on one mini-batch (all of it on every rank; each DP rank trains its share)."""
        for m in self.model:
            m.train()
        algo = self.s.algo
        masks = [s.loss_mask if s.loss_mask is not None else torch.ones(len(s.response_ids)) for s in samples]
        global_tokens = float(sum(float(m.sum()) for m in masks))
        global_seqs = float(sum(1 for m in masks if float(m.sum()) > 0))
        if global_tokens == 0:
            log.warning("mini-batch has no trainable tokens (all masked); update skipped")
            return {"skipped": 1.0}
        self.set_lr(lr)
        groups = self._my_micro_batches(samples)
        self._fetch_routes(samples, groups)
        shape = self._shape_of(samples, groups)
        mbs = [self._make_mb(samples, idx, with_loss_inputs=True, shape=shape) for idx in groups]
        bypass = algo.correction.bypass
        if bypass:  # rejection needs pi_theta: denominators are known after the forward (see _bypass_scale)
            global_tokens = global_seqs = 1.0
        loss_fn = partial(dapo_loss, algo=algo, temperature=self.s.temperature, vocab_size=self.shape.vocab_size,
                          global_tokens=global_tokens, global_seqs=global_seqs,
                          max_response_len=self.s.max_response_len, scale=float(len(mbs) * self.dp_size))
        if self.router_stats is not None:
            self.router_stats.reset()
        results = self._run(mbs, loss_fn, forward_only=False)
        sums: dict[str, float] = {}
        for res in results:
            for k, v in res.items():
                sums[k] = _merge_metric(k, sums.get(k), float(v))
        reduced = self._sum_over_dp_last_stage(sums)
        if bypass:
            reduced = self._bypass_scale(reduced)
        if self.router_stats is not None:
            from dapo_mcore.model.moe import routing_copies

            reduced.update(self.router_stats.metrics(routing_copies(self.s.tensor_parallel,
                                                                    self.s.sequence_parallel)))
        # Every rank knows the summed loss and whether any rank's gradients are non-finite: all take one branch.
        skip = self.nonfinite.check(reduced.get("loss", 0.0), grads_finite(self.chunks), lr)
        skip = skip or bool(reduced.pop("bypass_all_rejected", 0.0))  # bypass: every token rejected
        ok, grad_norm = False, None
        before = [p.detach().clone() for p in self._adapters()] if self.lora is not None and not skip else None
        if not skip:
            ok, grad_norm, _ = self.optimizer.step()
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if skip:  # a bypass update whose tokens were all rejected still reports what the correction saw
            return {"skipped": 1.0, **{k: v for k, v in reduced.items() if k.startswith("rollout_corr/")}}
        reduced["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        reduced["update_ok"] = 1.0 if ok else 0.0
        if before is not None:
            reduced.update(self._adapter_norms(before))
        return reduced

    def _adapters(self) -> list[torch.nn.Parameter]:
        """LoRA: the trainable parameters (the adapters), in a fixed order."""
        return [p for c in self.chunks for p in c.parameters() if p.requires_grad]

    def _adapter_norms(self, before: list[torch.Tensor]) -> dict[str, float]:
        """LoRA: the L2 norms of this update of the adapters and of the adapters, over the whole model (a collective
        over the model-parallel group; a TP-replicated factor counted once; with expert parallelism the experts of
        this rank's share)."""
        from megatron.core import parallel_state as ps

        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed where the adapters are: one copy
        first = ps.get_tensor_model_parallel_rank() == 0
        for p, old in zip(self._adapters(), before, strict=True):
            if getattr(p, "tensor_model_parallel", False) or first:
                sums[0] += (p.detach().double() - old.double()).pow(2).sum()
                sums[1] += p.detach().double().pow(2).sum()
        sums = sums.cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            from dapo_mcore.collectives.device import collective_device

            group = ps.get_model_parallel_group()
            device = collective_device(group)
            moved = device.to(sums)
            dist.all_reduce(moved, group=group)
            sums = device.host(moved)
        return {"lora/update_norm": float(sums[0].sqrt()), "lora/adapter_norm": float(sums[1].sqrt())}

    def _sum_over_dp_last_stage(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric contributions summed over DP ranks (last PP stage holds them), known on every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return sums
        from megatron.core import parallel_state as ps

        everything: list[Any] = [None] * dist.get_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        dist.all_gather_object(everything, (self.is_last_stage and tp_rank == 0, sums))
        out: dict[str, float] = {}
        for is_src, part in everything:
            if is_src:
                for k, v in part.items():
                    out[k] = _merge_metric(k, out.get(k), v)
        return out

    def _bypass_scale(self, reduced: dict[str, float]) -> dict[str, float]:
        """Bypass mode: the micro-batches returned unnormalized sums (rejection depends on pi_theta, known only after
        the forward). Divide the gradients (all-reduced over DP already) and the metrics by the global denominators,
        and by the batch-normalization mean; the ``rollout_corr/*`` metrics from the summed statistics."""
        corr = self.s.algo.correction
        stats = CorrectionStats(**{k: reduced.pop(f"bypass/{k}") for k in BYPASS_STATS})
        tokens, seqs = reduced.pop("bypass/kept_tokens"), reduced.pop("bypass/kept_seqs")
        out = {k: v for k, v in reduced.items()}
        out.update(stats.metrics())
        out["rollout_corr/bypass"] = 1.0
        if tokens == 0:  # every token rejected: nothing to train on (train_mini_batch skips the step)
            out["bypass_all_rejected"] = 1.0
            return out
        mean_w = (stats.norm_sum / stats.norm_count if corr.is_batch_normalize and corr.is_level is not None
                  and stats.norm_count > 0 and stats.norm_sum > 0 else 1.0)
        agg = tokens if self.s.algo.loss_agg == "token-mean" else seqs
        for m in self.model:
            m.scale_gradients(1.0 / (agg * mean_w))
        for k in list(reduced):
            out[k] = reduced[k] / (agg * mean_w) if k in _LOSS_KEYS else reduced[k] / tokens
        return out

    # ---- weight export -------------------------------------------------------------------------------------
    def export_hf_weights(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets, on every rank (a collective: every rank must iterate)."""
        from dapo_mcore.weights.export import iter_hf_weights

        return iter_hf_weights(self.chunks, self.s.hf_config, layer_spec=self.s.layer_spec, bucket_bytes=bucket_bytes)
