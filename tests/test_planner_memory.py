"""Planner: the memory estimate against measured CPU peaks, layout checks and the CLI."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.planner import PlanInput, estimate_memory

# each test carries its own tier marker: a module-level unit mark would put the
# distributed/e2e tests below into the quick unit subset too (pytest adds it to every test of the module)


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages created by any op, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: set[int] = set()

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self._live.add(key)
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)  # storages keep their Python object alive

    def _free(self, key: int, size: int) -> None:
        self._live.discard(key)
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def measure_train_step_peak(cfg: dict, tokens: int) -> tuple[int, int]:
    """(peak live bytes of a steady-state fp32 AdamW step, bytes live right after forward) on CPU."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg, attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    ids = torch.randint(0, cfg["vocab_size"], (1, tokens))
    model(ids, labels=ids).loss.backward()  # step 1 creates the Adam states and grads
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the grad buffers, like Megatron's persistent grad buffer
    meter = LiveTensorBytes()
    for t in [*model.parameters(), *(p.grad for p in model.parameters())]:
        meter.track(t)
    for state in opt.state.values():
        for t in state.values():
            if t.dim():
                meter.track(t)
    static = meter.current
    with meter:
        loss = model(ids, labels=ids).loss
        after_forward = meter.current - static
        loss.backward()
        del loss
        opt.step()
    return meter.peak, after_forward


def cpu_plan(cfg: dict, tokens: int) -> PlanInput:
    return PlanInput(model=cfg, precision="fp32", distributed_optimizer=False, grad_reduce_in_fp32=False,
                     micro_batch_tokens=tokens, colocate_vllm=False, overhead_gib=0.0)


CPU_SHAPES = {
    "wide-vocab": (preset_config("tiny", hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                                 tie_word_embeddings=False, max_position_embeddings=4096), 512),
    "deep-long": (preset_config("tiny", hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                                tie_word_embeddings=True, max_position_embeddings=4096), 1024),
}


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CPU_SHAPES))
def test_estimate_within_25_percent_of_measured_cpu_peak(name):
    cfg, tokens = CPU_SHAPES[name]
    measured, after_forward = measure_train_step_peak(cfg, tokens)
    est = estimate_memory(cpu_plan(cfg, tokens))
    ratio = est.train_peak / measured
    print(f"{name}: measured peak {measured / 2**20:.1f} MiB, estimate {est.train_peak / 2**20:.1f} MiB "
          f"(ratio {ratio:.3f}); activations+logits after forward: measured {after_forward / 2**20:.1f} MiB, "
          f"estimated {(est.activations + est.logits) / 2**20:.1f} MiB")
    assert 0.75 <= ratio <= 1.25


@pytest.mark.unit
def test_engine_sleep_start_up_and_checkpoint_host_memory_are_priced():
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.plan.fit import LayoutDoesNotFit, check
    from dapo_mcore.plan.planner import GIB, PlanInput, estimate_host

    base = dict(model=preset_config("qwen2.5-32b"), tensor_parallel=8, pipeline_parallel=2, data_parallel=8,
                precision="fp8", recompute="selective")
    lvl2 = estimate_host(PlanInput(**base))
    lvl1 = estimate_host(PlanInput(**base, vllm_sleep_level=1, vllm_load_format="auto"))
    assert lvl2.sleep_copy_s == 0 and lvl2.engine_load_s == 0 and lvl2.sleep_host_bytes == 0
    weights = 2 * 32.76e9 / 4  # bf16 weights per GPU at vLLM TP=4
    assert lvl1.sleep_copy_s == pytest.approx(2 * weights / 20e9, rel=0.01)
    assert lvl1.engine_load_s == pytest.approx(128 * 2 * 32.76e9 / 10e9, rel=0.01)
    # 12 B/param of fp32 main weights + Adam moments per model shard (TP x PP = 16), 8 shards on a node.
    assert lvl2.checkpoint_host_bytes == pytest.approx(12 * 32.76e9 / 16 * 8, rel=0.01)
    assert 170 < lvl2.checkpoint_host_bytes / GIB < 200
    with pytest.raises(LayoutDoesNotFit, match="host_memory_gib=128"):
        check(PlanInput(**base, host_memory_gib=128))


# ---- the actor's training loss against the planner's logits term -------------------------------------------------
LOSS_TOKENS, LOSS_VOCAB, LOSS_PROMPT = 1024, 4096, 128


def measure_loss_peak(dtype: torch.dtype, temperature: float, local_vocab: int) -> int:
    """Peak live bytes of ``dapo_loss`` forward + backward on one micro-batch of random logits (the logits included)."""
    from dapo_mcore.actor.batch import build_micro_batch
    from dapo_mcore.actor.megatron_actor import dapo_loss
    from dapo_mcore.algo.config import AlgoConfig

    gen = torch.Generator().manual_seed(0)
    n = LOSS_TOKENS - LOSS_PROMPT
    mb = build_micro_batch([list(range(1, LOSS_PROMPT + 1))],
                           [torch.randint(0, LOSS_VOCAB, (n,), generator=gen).tolist()], layout="rows")
    mb.old_logp, mb.loss_mask, mb.adv = -torch.rand(1, n, generator=gen), torch.ones(1, n), torch.tensor([0.5])
    meter = LiveTensorBytes()
    with meter:
        logits = (torch.randn(1, LOSS_TOKENS, local_vocab, generator=gen) * 2).to(dtype).requires_grad_(True)
        loss, _ = dapo_loss(mb, logits, algo=AlgoConfig(), temperature=temperature, vocab_size=LOSS_VOCAB,
                            global_tokens=float(n), global_seqs=1.0, max_response_len=None, scale=1.0)
        loss.backward()
    return meter.peak  # logits, the loss's temporaries and the logits' gradient (consumed by the output layer)


def planned_logits(dtype: torch.dtype, tp: int) -> float:
    cfg = preset_config("tiny", vocab_size=LOSS_VOCAB, num_attention_heads=4, num_key_value_heads=2)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    return estimate_memory(PlanInput(model=cfg, tensor_parallel=tp, micro_batch_tokens=LOSS_TOKENS, precision=precision,
                                     distributed_optimizer=False, colocate_vllm=False)).logits


LOSS_CASES = [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.0), (torch.bfloat16, 0.7)]


def _small_entropy_chunks(monkeypatch) -> None:
    """At production sizes the entropy's chunks are a sliver of the logits; shrink them so they are here too."""
    from dapo_mcore.actor import sizes

    monkeypatch.setattr(sizes, "ENTROPY_CHUNK_BYTES", 1 << 18)


@pytest.mark.unit
@pytest.mark.parametrize(("dtype", "temperature"), LOSS_CASES)
def test_the_actor_loss_peak_is_the_planners_logits_term_at_tp1(monkeypatch, dtype, temperature):
    _small_entropy_chunks(monkeypatch)
    measured, planned = measure_loss_peak(dtype, temperature, LOSS_VOCAB), planned_logits(dtype, 1)
    print(f"TP=1 {dtype} T={temperature}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    # never above the plan (1% for the per-token vectors it leaves out); one count serves every dtype and T
    assert 0.6 * planned <= measured <= 1.01 * planned


def _loss_peak_worker(rank: int, world: int, port: int, queue) -> None:
    from dapo_mcore.actor import sizes
    from dapo_mcore.actor.parallel import LaunchEnv, init_distributed, init_model_parallel

    init_distributed(LaunchEnv(rank=rank, local_rank=rank, world_size=world, master_addr="127.0.0.1",
                               master_port=port, source="test"), "gloo")
    init_model_parallel(world, 1)
    sizes.ENTROPY_CHUNK_BYTES = 1 << 18
    peaks = [measure_loss_peak(dtype, t, LOSS_VOCAB // world) for dtype, t in LOSS_CASES]
    torch.distributed.destroy_process_group()
    queue.put((rank, peaks))


@pytest.mark.distributed
def test_the_actor_loss_peak_is_the_planners_logits_term_at_tp2(monkeypatch):
    from tests.gloo_workers import run_gloo_workers

    _small_entropy_chunks(monkeypatch)
    results = run_gloo_workers(_loss_peak_worker, 2)
    for i, (dtype, temperature) in enumerate(LOSS_CASES):
        planned = planned_logits(dtype, 2)
        for rank in (0, 1):
            measured = results[rank][i]
            print(f"TP=2 rank {rank} {dtype} T={temperature}: measured {measured / 2**20:.1f} MiB, "
                  f"planned {planned / 2**20:.1f} MiB")
            assert 0.6 * planned <= measured <= 1.01 * planned, (rank, dtype, temperature)
