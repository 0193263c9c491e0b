"""NCCL on CPU (``dapo_mcore.collectives.strict``): on in every process of the suite, it refuses a CPU tensor on
a group that is NCCL on a GPU, with NCCL's error, and the MoE metrics' reductions pass it with one host sync."""

from __future__ import annotations

import os

import pytest
from gloo_workers import run_gloo_workers

pytestmark = pytest.mark.distributed


def _probe(module: str, code: str, **names) -> str:
    """Run ``code`` as if written in ``module`` (the check reads the caller's module); 'ok' or the error."""
    import torch
    import torch.distributed as dist

    from dapo_mcore.collectives.strict import StrictDeviceError

    try:
        exec(code, {"__name__": module, "dist": dist, "torch": torch, **names})
    except StrictDeviceError as e:
        return str(e)
    return "ok"


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import dapo_mcore  # noqa: F401  (installs the check when the variable is set, as in every process)
    from dapo_mcore.collectives.device import collective_device
    from dapo_mcore.collectives.strict import installed
    from dapo_mcore.model.moe import RouterReplay, RouterStats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {"env": os.environ.get("DAPO_MCORE_STRICT_DEVICE"), "installed": installed()}
    device = collective_device()
    out["cpu_default"] = _probe("dapo_mcore.probe", "dist.all_reduce(torch.ones(2))")
    out["moved"] = _probe("dapo_mcore.probe", "dist.all_reduce(d.to(torch.ones(2)))", d=device)
    out["megatron"] = _probe("megatron.core.probe", "dist.all_reduce(torch.ones(2))")
    out["model_group"] = _probe("dapo_mcore.probe", "dist.all_reduce(torch.ones(2), group=g)",
                                g=dist.new_group(list(range(world))))
    out["gloo_group"] = _probe("dapo_mcore.probe", "dist.all_reduce(torch.ones(2), group=g)",
                               g=dist.new_group(list(range(world)), backend="gloo"))
    # the modules once exempt: each is checked like every other module of ours
    out["once_exempt"] = {m: _probe(m, "dist.all_reduce(torch.ones(2))") for m in ONCE_EXEMPT}
    out["view"] = _probe("dapo_mcore.probe", "dist.all_reduce(d.empty(6, torch.float32).view(2, 3)[1:])", d=device)
    out["result"] = _probe("dapo_mcore.probe", "dist.all_reduce(d.to(torch.ones(2)) * 2)", d=device)
    out["correction"] = _correction(rank)
    out["p2pop"] = type(dist.P2POp(dist.isend, torch.zeros(1), (rank + 1) % world)).__name__  # Megatron's pipeline
    out.update(_point_to_point(rank, world, device))
    replay = RouterReplay([], (), replay=False)
    replay.differ, replay.counted = float(rank), 10.0
    syncs = device.syncs
    out["mismatch"] = replay.mismatch()
    stats = RouterStats([], num_layers=1, num_experts=2)
    stats.counts += torch.tensor([[1.0 + rank, 3.0]], dtype=torch.float64)
    stats.calls += 1
    out["metrics"] = stats.metrics(tensor_parallel=1)
    out["syncs"] = device.syncs - syncs
    dist.destroy_process_group()
    queue.put((rank, out))


_EXCHANGE = """
peer = (me + 1) % world
sent = make(torch.full((3,), float(me)))
got = make(torch.zeros(3))
ops = [dist.P2POp(dist.isend, sent, peer, group=g), dist.P2POp(dist.irecv, got, peer, group=g)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
assert host(got).tolist() == [float(peer)] * 3
"""

_PAIR = """
a = dist.{first}(torch.ones(1), (me + 1) % world)
b = dist.{second}(torch.ones(1), (me + 1) % world)
a.wait()
b.wait()
"""


def _point_to_point(rank: int, world: int, device) -> dict[str, str]:
    """The route exchange's ops (``batch_isend_irecv`` of ``P2POp``s) and plain isend/irecv, from a module of ours and
    from Megatron's; a refusal comes before anything is posted, on both ranks alike, so nothing is left waiting."""
    import torch

    cpu = {"make": lambda t: t, "host": lambda t: t, "me": rank, "world": world, "g": None}
    moved = {**cpu, "make": device.to, "host": device.host}
    return {
        "batch_cpu": _probe("dapo_mcore.probe", _EXCHANGE, **cpu),
        "batch_moved": _probe("dapo_mcore.probe", _EXCHANGE, **moved),
        "batch_megatron": _probe("megatron.core.probe", _EXCHANGE, **cpu),
        # each pairs with the peer's, so the old check (which let them through) returns instead of leaving one posted
        "isend_cpu": _probe("dapo_mcore.probe", _PAIR.format(first="isend", second="irecv"), **cpu),
        "irecv_cpu": _probe("dapo_mcore.probe", _PAIR.format(first="irecv", second="isend"), **cpu),
        "isend_gloo_group": _probe("dapo_mcore.probe", _EXCHANGE, **{
            **cpu, "g": torch.distributed.new_group(list(range(world)), backend="gloo")}),
    }


ONCE_EXEMPT = ("dapo_mcore.weights.export", "conversion.verify", "dapo_mcore.algo.rollout_correction")


def _correction(rank: int) -> tuple[float, float]:
    """Batch-normalized token TIS over both ranks (the all-reduce in algo.rollout_correction); the weight mean."""
    import torch
    import torch.distributed as dist

    from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig, correction

    cfg = RolloutCorrectionConfig(is_level="token", is_batch_normalize=True)
    log_ratio = torch.log(torch.tensor([[1.0 + rank, 2.0 + rank]]))  # weights 1, 2 on rank 0; 2, 3 on rank 1
    w, _, _ = correction(log_ratio, torch.ones(1, 2), cfg, group=dist.group.WORLD)
    return w[0, 0].item(), w[0, 1].item()


@pytest.fixture(scope="module")
def ranks():
    assert os.environ.get("DAPO_MCORE_STRICT_DEVICE") == "1", "tests/conftest.py turns NCCL-on-CPU on for the suite"
    return run_gloo_workers(_worker, 2)


def test_the_check_is_active_in_spawned_ranks(ranks):
    for out in ranks.values():
        assert out["env"] == "1" and out["installed"] is True


def test_a_cpu_tensor_on_a_group_that_is_nccl_on_a_gpu_is_refused_with_nccls_error(ranks):
    for out in ranks.values():
        assert out["cpu_default"].startswith("No backend type associated with device type cpu")
        assert "dapo_mcore.probe" in out["cpu_default"]
        assert out["model_group"].startswith("No backend type associated with device type cpu")


def test_what_the_check_lets_through(ranks):
    """Tensors moved through the collective device; Megatron's own calls; groups that are gloo on a GPU too."""
    for out in ranks.values():
        assert out["moved"] == out["megatron"] == out["gloo_group"] == "ok"
        assert out["p2pop"] == "P2POp"  # P2POp checks isend's identity: the check must not wrap it


def test_point_to_point_ops_of_ours_are_checked_and_megatrons_pass(ranks):
    """The route exchange's ``batch_isend_irecv`` of CPU tensors, and plain ``isend``/``irecv``, were let through (only
    send/recv were wrapped); Megatron's pipeline ops (and ours on a gloo-on-purpose group) still run and deliver."""
    for out in ranks.values():
        for key in ("batch_cpu", "isend_cpu", "irecv_cpu"):
            assert out[key].startswith("No backend type associated with device type cpu"), (key, out[key])
            assert "dapo_mcore.probe" in out[key]
        assert "batch_isend_irecv (isend)" in out["batch_cpu"] and "p2p_op_list[0].tensor" in out["batch_cpu"]
        assert out["batch_moved"] == out["batch_megatron"] == out["isend_gloo_group"] == "ok"


def test_the_once_exempt_modules_are_checked(ranks):
    """weights.export, conversion.verify and algo.rollout_correction were exempt (their CPU tensors passed)."""
    for out in ranks.values():
        for module, said in out["once_exempt"].items():
            assert said.startswith("No backend type associated with device type cpu") and module in said, module


def test_a_view_of_a_device_tensor_passes_and_a_new_result_does_not(ranks):
    for out in ranks.values():
        assert out["view"] == "ok"
        assert out["result"].startswith("No backend type associated with device type cpu")


def test_rollout_correction_all_reduces_on_the_collective_device(ranks):
    """Its all-reduce once took the CPU sums as they were (the module was exempt). The mean of 1, 2, 2, 3 is 2."""
    assert ranks[0]["correction"] == pytest.approx((0.5, 1.0))
    assert ranks[1]["correction"] == pytest.approx((1.0, 1.5))


def test_moe_metrics_reduce_on_the_collective_device_with_one_host_sync_each(ranks):
    """The old code all-reduced CPU tensors on the default group: refused here, as NCCL refuses them on a GPU."""
    for out in ranks.values():
        assert out["mismatch"] == pytest.approx(1 / 20)  # (0 + 1) of (10 + 10)
        # counts summed over both ranks: [[1 + 2, 3 + 3]] -> max / mean = 6 / 4.5
        assert out["metrics"]["moe/load_max_over_mean"] == pytest.approx(6 / 4.5)
        assert out["metrics"]["moe/tokens_per_expert_mean"] == pytest.approx(4.5)
        assert out["syncs"] == 2
