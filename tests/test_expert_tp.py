"""Expert tensor parallelism below TP: Qwen3-MoE at TP=2 (sequence parallel) x EP=2 on 4 gloo ranks with
expert-TP 1 trains as expert-TP 2 (= TP, Megatron's default) does, exports the same HF weights, writes the rank files
its processes hold, and its checkpoint resumes at expert-TP 2. The unit tests check the rank-file layout and the
config's one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist_scripts.moe_workspace import REPO, free_port, write_moe_workspace

SCRIPT = REPO / "tests" / "dist_scripts" / "expert_tp.py"


@pytest.mark.distributed
def test_expert_tp1_at_tp2_ep2_trains_exports_and_resumes_as_expert_tp2(tmp_path):
    spec, ref, hf_state = write_moe_workspace(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), str(SCRIPT), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = [torch.load(tmp_path / f"out_rank{r}.pt", weights_only=False) for r in range(4)]
    for out in outs:
        two, one = out["etp2"], out["etp1"]
        for logp, want in zip(one["logp"], ref, strict=True):  # the same model as HF's, whole experts per rank
            assert torch.allclose(logp.double(), want, atol=1e-5)
        for a, b in zip(one["logp"], two["logp"], strict=True):
            assert torch.allclose(a, b, atol=1e-6)
        for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):  # same loss and grad norm, fp32 round-off
            for key in ("loss", "grad_norm"):
                assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), (key, m1, m2)
        assert one["metrics"][0]["grad_norm"] > 0
        assert set(one["weights"]) == set(hf_state)
        moved = max(float((one["weights"][k] - hf_state[k]).abs().max()) for k in one["weights"])
        assert moved > 1e-4  # the updates changed the weights, so the comparisons below can fail
        for name, t in one["weights"].items():
            assert torch.allclose(t, two["weights"][name], atol=1e-5), name
        # the rank files its processes hold: TP rank t with EP rank (t // 1) % 2, i.e. (0, 0) and (1, 1)
        assert two["files"] == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_01_000_000",
                                "mp_rank_01_000_001"]
        assert one["files"] == one["optim_files"] == ["mp_rank_00_000_000", "mp_rank_01_000_001"]
        # the expert-TP 1 checkpoint read at expert-TP 2: the same weights bit for bit, the same next update
        again = out["resharded"]
        for name, t in one["weights"].items():
            assert torch.equal(again["weights"][name], t), name
        for key in ("loss", "grad_norm"):
            assert again["update3"][key] == pytest.approx(one["update3"][key], rel=1e-5, abs=1e-7)
        for name, t in one["weights3"].items():
            assert torch.allclose(again["weights3"][name], t, atol=1e-5), name


@pytest.mark.unit
@pytest.mark.parametrize(("tp", "etp", "ep", "pairs"), [
    (2, 2, 2, [(0, 0), (0, 1), (1, 0), (1, 1)]),   # expert-TP = TP: every (TP, EP) pair, as before
    (2, 1, 2, [(0, 0), (1, 1)]),
    (4, 1, 2, [(0, 0), (1, 1), (2, 0), (3, 1)]),
    (4, 1, 8, [(0, 0), (0, 4), (1, 1), (1, 5), (2, 2), (2, 6), (3, 3), (3, 7)]),
    (4, 2, 2, [(0, 0), (1, 0), (2, 1), (3, 1)]),
])
def test_rank_files_are_the_pairs_megatron_places(tp, etp, ep, pairs):
    """The rank files are the (TP rank, EP rank) pairs of Megatron's grids (dense: tp-dp, experts: etp-ep-edp) over
    a pipeline stage of tp x ep x 2 processes, counted naively; every dense TP shard and expert shard is in one."""
    from dapo_mcore.weights.layout import ParallelLayout

    layout = ParallelLayout(tp=tp, ep=ep, etp=etp)
    naive = sorted({(q % tp, (q // etp) % ep) for q in range(tp * ep * 2)})
    assert layout.rank_files() == naive == pairs
    assert {t for t, _ in pairs} == set(range(tp))
    assert {(e, t % etp) for t, e in pairs} == {(e, s) for e in range(ep) for s in range(etp)}
    for t, e in pairs:
        assert (t, layout.file_with_tp(t)) in pairs and (layout.file_with_expert_shard(e, t % etp), e) in pairs


@pytest.mark.unit
@pytest.mark.parametrize(("overrides", "says"), [
    (["parallel.expert_tensor_parallel=3"], "must divide parallel.tensor_parallel=2"),
    (["parallel.expert_parallel=4", "parallel.expert_tensor_parallel=2"],
     "expert_parallel=4 x expert_tensor_parallel=2 must divide the 4 ranks of a pipeline stage"),
    (["parallel.expert_tensor_parallel=0"], "must divide parallel.tensor_parallel=2"),
])
def test_expert_tp_refusals_are_one_line(overrides, says):
    from dapo_mcore.config import ConfigError, load_config

    cfg = load_config("examples/tiny_cpu.yaml", ["model.tiny_base=false", "model.preset=qwen3-30b-a3b",
                                                  "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                                                  "parallel.expert_parallel=2", *overrides])
    with pytest.raises(ConfigError, match=says) as err:
        cfg.validate_layout(4)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_expert_tp1_at_tp2_ep2_passes_where_megatron_places_it():
    from dapo_mcore.config import load_config
    from dapo_mcore.config.rules import expert_tensor_parallel

    cfg = load_config("examples/tiny_cpu.yaml", ["model.tiny_base=false", "model.preset=qwen3-30b-a3b",
                                                  "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                                                  "parallel.expert_parallel=2"])
    cfg.validate_layout(4)  # EP=2 x ETP=1 inside a 4-rank stage; before, EP had to divide DP=2 with ETP = TP
    assert expert_tensor_parallel(cfg) == 1
    dense = load_config("examples/tiny_cpu.yaml", [])
    assert expert_tensor_parallel(dense) is None
