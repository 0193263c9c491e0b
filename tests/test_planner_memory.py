"""Planner: the memory estimate against measured CPU peaks, layout checks and the CLI."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dapo_mcore.model.presets import preset_config
from dapo_mcore.planner import PlanInput, estimate_memory

pytestmark = pytest.mark.unit


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
    from dapo_mcore.planner import GIB, LayoutDoesNotFit, PlanInput, check, estimate_host

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
