"""What moving the policy's weights into the engines costs per step: the assumed rates and the seconds they give,
shared by the disaggregated split (``disagg``) and the step model (``step_model``)."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_mcore.plan.planner import PlanInput
from dapo_mcore.telemetry.flops import ModelShape


@dataclass(frozen=True)
class TransferRates:
    """Assumed rates of moving the policy's bf16 weights into the engines, GB/s per GPU."""

    export_gbs: float = 40.0
    """Trainer-side export of full HF tensors (TP gather over NVLink, PP stages over InfiniBand), per rank. The
    export measured 0.55-0.63 of a plain transfer of the same bytes on CPU (benchmarks/weight_sync.py)."""
    network_gbs: float = 25.0
    """Trainer -> engine broadcast over InfiniBand per receiving GPU: half of a 400 Gb/s NDR port (50 GB/s)."""

    def __post_init__(self) -> None:
        if min(self.export_gbs, self.network_gbs) <= 0:
            raise ValueError("weight transfer rates must be > 0 GB/s (e.g. --weight-export-gbs 40 --weight-network-gbs 25)")


def weight_sync_seconds(p: PlanInput, rates: TransferRates, disaggregated: bool) -> float:
    """Seconds per step to put the updated bf16 weights into the engines (colocated: no network hop)."""
    model_bytes = 2.0 * ModelShape.from_hf(p.model).num_params()
    seconds = model_bytes / (rates.export_gbs * 1e9)
    if disaggregated:
        seconds += model_bytes / p.vllm_tensor_parallel / (rates.network_gbs * 1e9)
    return seconds
