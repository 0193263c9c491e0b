"""The vLLM engine of an MoE model runs its experts on a kernel that keeps the checkpoint's ``[gate; up]`` layout.

vLLM picks its unquantized MoE kernel itself; recent releases put FlashInfer CUTLASS ahead of Triton on CUDA with
no environment variable set, and CUTLASS swaps each expert's ``w13`` halves after loading, so an in-place weight
sync (plain ``load_weights`` on a GPU) then feeds the kernel ``up`` as ``gate``. Tested through the engine's own
build path (``VLLMEngine._real_backend``) against a stand-in ``vllm`` whose model runs a faithful copy of vLLM's
selection (``fused_moe/oracle/unquantized.py``: ``select_unquantized_moe_backend``, ``_get_priority_backends``,
``map_unquantized_backend``, ``convert_to_unquantized_kernel_format``; read in vLLM's source, not run on a GPU).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from enum import Enum

import pytest
import torch

from conversion.synthetic_moe import tiny_moe_config
from dapo_mcore.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineOptions
from dapo_mcore.rollout.engines.weight_sync import hf_param_shapes
from dapo_mcore.rollout.protocol import EngineError

pytestmark = pytest.mark.unit

HF = tiny_moe_config()  # 4 layers (layer 0 dense), 4 experts of width 16
INTER, EXPERTS, SPARSE = HF["moe_intermediate_size"], HF["num_experts"], (1, 2, 3)


class UnquantizedMoeBackend(Enum):  # vLLM's enum (names and values)
    FLASHINFER_TRTLLM = "FlashInfer TRTLLM"
    FLASHINFER_CUTLASS = "FlashInfer CUTLASS"
    TRITON = "TRITON"
    BATCHED_TRITON = "BATCHED_TRITON"
    CPU = "CPU"


def select_unquantized_moe_backend(device: str, capability: int, moe_backend: str, trtllm_ok: bool,
                                   cutlass_ok: bool) -> UnquantizedMoeBackend:
    """vLLM's selection for a bf16 MoE layer: an explicit ``moe_backend`` (not "auto") is mapped and used; "auto"
    takes the platform's priority list, FlashInfer behind Triton on Hopper (SM90), the first supported kernel."""
    b = UnquantizedMoeBackend
    if device == "cpu":
        return b.CPU
    if moe_backend != "auto":
        return {"triton": b.TRITON, "batched_triton": b.BATCHED_TRITON, "flashinfer_trtllm": b.FLASHINFER_TRTLLM,
                "flashinfer_cutlass": b.FLASHINFER_CUTLASS}[moe_backend]
    order = [b.FLASHINFER_TRTLLM, b.FLASHINFER_CUTLASS, b.TRITON, b.BATCHED_TRITON]
    if capability == 90:
        order = [b.TRITON, b.BATCHED_TRITON, b.FLASHINFER_TRTLLM, b.FLASHINFER_CUTLASS]
    supported = {b.FLASHINFER_TRTLLM: trtllm_ok, b.FLASHINFER_CUTLASS: cutlass_ok, b.TRITON: True,
                 b.BATCHED_TRITON: True}
    return next(k for k in order if supported[k])


class Experts(torch.nn.Module):
    """One MoE layer: fused ``w13`` [experts, 2 x inter, hidden] as vLLM's FusedMoE holds it."""

    def __init__(self, backend: UnquantizedMoeBackend):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HF["hidden_size"]), requires_grad=False)
        self.quant_method = types.SimpleNamespace(unquantized_backend=backend)

    def process_weights_after_loading(self) -> None:  # convert_to_unquantized_kernel_format
        if self.quant_method.unquantized_backend is UnquantizedMoeBackend.FLASHINFER_CUTLASS:
            w = self.w13_weight.data
            self.w13_weight.data = torch.cat([w[:, INTER:], w[:, :INTER]], dim=1)  # swap_w13_to_w31: [up; gate]

    def kernel_gate(self, expert: int) -> torch.Tensor:
        """The rows the kernel multiplies as the gate projection: CUTLASS expects [w3; w1], the others [w1; w3]."""
        w = self.w13_weight[expert]
        swapped = self.quant_method.unquantized_backend is UnquantizedMoeBackend.FLASHINFER_CUTLASS
        return w[INTER:] if swapped else w[:INTER]


class Model(torch.nn.Module):
    def __init__(self, backend: UnquantizedMoeBackend):
        super().__init__()
        self.experts = torch.nn.ModuleDict({str(i): Experts(backend) for i in SPARSE})

    def load_weights(self, weights):  # the expert weight loader: gate rows first, up rows second (checkpoint order)
        for name, t in weights:
            parts = name.split(".")
            if "experts" in parts and parts[-2] in ("gate_proj", "up_proj"):
                layer, expert = self.experts[parts[2]], int(parts[parts.index("experts") + 1])
                lo = 0 if parts[-2] == "gate_proj" else INTER
                layer.w13_weight.data[expert, lo:lo + INTER] = t


def install_vllm(monkeypatch, *, device: str = "cuda", capability: int = 100, has_moe_backend: bool = True,
                 cutlass_ok: bool = True) -> list:
    built: list = []

    @dataclasses.dataclass
    class EngineArgs:
        model: str = ""
        if has_moe_backend:
            moe_backend: str = "auto"

    class LLM:
        def __init__(self, **kwargs):
            args = EngineArgs(**{k: v for k, v in kwargs.items() if k in {f.name for f in dataclasses.fields(EngineArgs)}})
            backend = select_unquantized_moe_backend(device, capability, getattr(args, "moe_backend", "auto"),
                                                     trtllm_ok=INTER % 128 == 0, cutlass_ok=cutlass_ok)
            model = Model(backend)
            for layer in model.experts.values():
                layer.process_weights_after_loading()  # after vLLM's (dummy) load
            built.append((kwargs, model))
            runner = types.SimpleNamespace(model=model)
            worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))
            self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

        def reset_prefix_cache(self):
            return True

    platform = types.SimpleNamespace(device_type=device, is_cpu=lambda: device == "cpu",
                                     is_sleep_mode_available=lambda: device == "cuda")
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(EngineArgs=EngineArgs))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0", LLM=LLM))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return built


TRANSFORMERS_5 = {**{k: v for k, v in HF.items() if k != "num_experts"}, "num_local_experts": EXPERTS}
"""The same model as transformers 5 saves its config: the expert count spelled ``num_local_experts``."""


def _engine(hf=HF) -> VLLMEngine:
    return VLLMEngine(VLLMEngineOptions(model_path="/m", external_launcher=False, load_format="dummy"), hf,
                      world_size=1)


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in hf_param_shapes(HF).items()}


@pytest.mark.parametrize("capability", [100, 90])
def test_the_engine_pins_triton_and_a_synced_expert_is_read_as_written(monkeypatch, capability):
    """On Blackwell (SM100) vLLM's own choice is FlashInfer CUTLASS: after a sync its kernel read each expert's up
    projection as the gate (the old engine passed no moe_backend). Pinned, the kernel reads what was synced."""
    built = install_vllm(monkeypatch, capability=capability)
    engine = _engine()
    kwargs, model = built[-1]
    assert kwargs["moe_backend"] == "triton"
    assert {layer.quant_method.unquantized_backend for layer in model.experts.values()} == {
        UnquantizedMoeBackend.TRITON}
    weights = _checkpoint()
    engine.update_weights([list(weights.items())])
    for layer in SPARSE:
        for expert in range(EXPERTS):
            gate = weights[f"model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"]
            assert torch.equal(model.experts[str(layer)].kernel_gate(expert), gate)


@pytest.mark.parametrize("hf", [HF, TRANSFORMERS_5], ids=["num_experts", "num_local_experts"])
def test_a_vllm_without_the_setting_that_chooses_cutlass_is_refused_after_the_build(monkeypatch, hf):
    built = install_vllm(monkeypatch, has_moe_backend=False)
    with pytest.raises(EngineError) as err:
        _engine(hf)
    assert "moe_backend" not in built[-1][0]  # this vLLM has no such setting: nothing was passed
    text = str(err.value)
    assert "\n" not in text and "FLASHINFER_CUTLASS kernel backend" in text and "swapped" in text
    # the same vLLM where FlashInfer is absent falls back to Triton, which keeps the layout: accepted
    install_vllm(monkeypatch, has_moe_backend=False, cutlass_ok=False)
    _engine()


def test_cpu_pins_nothing_and_accepts_the_cpu_backend(monkeypatch):
    """vLLM's CPU platform has only its CPU kernel (Triton does not run there), and the CPU sync re-processes every
    layer after loading (layer-wise reload): nothing pinned, nothing refused."""
    built = install_vllm(monkeypatch, device="cpu")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", types.SimpleNamespace())
    _engine()
    assert "moe_backend" not in built[-1][0]


def test_the_pin_needs_vllms_setting_and_a_check_that_found_nothing_refuses():
    from dapo_mcore.rollout.engines.vllm_env import GPU_TRAITS
    from dapo_mcore.rollout.engines.vllm_moe import check_moe_backends, moe_backend_pin

    assert moe_backend_pin(GPU_TRAITS, {"moe_backend"}) == {"moe_backend": "triton"}
    assert moe_backend_pin(GPU_TRAITS, {"model"}) == {}
    with pytest.raises(EngineError, match="found no MoE layer"):
        check_moe_backends({}, GPU_TRAITS)


def test_a_cpu_sync_drops_only_the_cpu_moe_kernels():
    """vLLM 0.32.0's reload packs the CPU experts' weights only where the method has no kernel yet (the real engine
    is checked in tests/test_vllm_moe_sync.py); a GPU backend's kernel (Triton: no re-layout) is left as built."""
    from dapo_mcore.rollout.engines.vllm_moe import unbuild_cpu_moe_kernels

    backend = Enum("UnquantizedMoeBackend", ["CPU", "TRITON"])
    layers = torch.nn.ModuleDict({n: torch.nn.Module() for n in ("experts_cpu", "experts_triton", "mlp", "experts_unbuilt")})
    layers["experts_cpu"].quant_method = types.SimpleNamespace(unquantized_backend=backend.CPU, moe_kernel=object())
    layers["experts_triton"].quant_method = types.SimpleNamespace(unquantized_backend=backend.TRITON, moe_kernel=object())
    layers["mlp"].quant_method = types.SimpleNamespace()
    layers["experts_unbuilt"].quant_method = types.SimpleNamespace(unquantized_backend=backend.CPU, moe_kernel=None)
    assert unbuild_cpu_moe_kernels(layers) == 1
    assert layers["experts_cpu"].quant_method.moe_kernel is None
    assert layers["experts_triton"].quant_method.moe_kernel is not None
