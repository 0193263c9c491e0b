"""LoRA with experts targeted on a tiny Qwen3-MoE at TP=2 (sequence parallel) x EP=2 x expert-TP=2 equals the same
run at TP=1 x EP=1 (loss, grad norm, every adapter gradient, the merged weights), every merged weight is the base plus
``scale * B @ A`` of its own adapter computed here on whole matrices (so each expert's delta is right where its
weight is split over expert-TP ranks), and the expert-TP=2 checkpoint resumes at TP=1 x EP=1 to the same merged model.

One 4-rank launch (tests/dist_scripts/lora_expert_tp.py). The model's router load-balancing loss is off: it is
computed per micro-batch, and the two layouts split the batch over 2 and 4 data-parallel ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist_scripts.moe_workspace import REPO, free_port, write_moe_workspace

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "dist_scripts" / "lora_expert_tp.py"
SCALE = 8.0 / 4  # alpha / rank of the script
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ws = tmp_path_factory.mktemp("lora_etp")
    _, _, hf_state = write_moe_workspace(ws, router_aux_loss_coef=0.0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), str(SCRIPT), str(ws)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return hf_state, [torch.load(ws / f"lora_etp_rank{r}.pt", weights_only=False) for r in range(4)]


def naive_merge(hf: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + scale * B @ A on whole matrices, for every weight with an adapter; the rest as the base."""
    out = {}
    for name, w in hf.items():
        key = f"base_model.model.{name[:-len('.weight')]}"
        if f"{key}.lora_A.weight" in adapters:
            out[name] = w + SCALE * adapters[f"{key}.lora_B.weight"] @ adapters[f"{key}.lora_A.weight"]
        else:
            out[name] = w
    return out


def _d(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_experts_are_adapted_on_every_rank(ranks):
    hf, outs = ranks
    experts = [n for n in hf if ".mlp.experts." in n and n.endswith(("gate_proj.weight", "down_proj.weight"))]
    for out in outs:
        names = out["tp2_ep2_etp2"]["start"]
        assert all(f"base_model.model.{n[:-7]}.lora_A.weight" in names for n in experts), "an expert has no adapter"
        for rank, params in out["expert_adapters"].items():  # this rank's local experts' fc1 and fc2
            assert sum(".linear_fc1.lora." in p for p in params) >= 2, (rank, params)
            assert sum(".linear_fc2.lora." in p for p in params) >= 2, (rank, params)
    targeted = {n for n in hf if any(f".{p}." in n for p in PROJ)}
    assert targeted == {n for n in hf if f"base_model.model.{n[:-7]}.lora_A.weight" in names}


def test_same_loss_gradients_and_adapters_at_both_layouts(ranks):
    _, outs = ranks
    for out in outs:
        two, one = out["tp2_ep2_etp2"], out["tp1_ep1"]
        for key in ("loss", "grad_norm"):
            assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-7), key
        assert two["metrics"]["grad_norm"] > 0
        assert set(one["grads"]) == set(two["grads"]) == set(two["start"])
        expert_grads = [n for n in two["grads"] if ".mlp.experts." in n]
        assert max(float(two["grads"][n].abs().max()) for n in expert_grads) > 1e-6  # the experts learn
        for name, g in two["grads"].items():
            assert _d(one["grads"][name], g) < 1e-5 * max(1.0, float(g.abs().max())), name
        for name, t in two["adapters"].items():
            assert _d(one["adapters"][name], t) < 1e-5, name


def test_merged_weights_are_base_plus_scaled_b_a_at_both_layouts(ranks):
    hf, outs = ranks
    for out in outs:
        for layout in ("tp2_ep2_etp2", "tp1_ep1"):
            res = out[layout]
            for merged, adapters in ((res["start_merged"], res["start"]), (res["merged"], res["adapters"])):
                want = naive_merge(hf, adapters)
                assert set(merged) == set(want)
                for name, w in want.items():
                    assert _d(merged[name], w) < 1e-5, (layout, name)
            moved = max(_d(res["start_merged"][n], hf[n]) for n in hf if ".mlp.experts." in n)
            assert moved > 1e-2  # every expert delta is non-zero, so a wrong one shows
        for name, w in out["tp2_ep2_etp2"]["merged"].items():
            assert _d(out["tp1_ep1"]["merged"][name], w) < 1e-5, name


def test_expert_tp2_checkpoint_resumes_at_tp1_ep1_to_the_same_merged_model(ranks):
    _, outs = ranks
    for out in outs:
        saved, resumed = out["tp2_ep2_etp2"], out["resumed"]
        for name, t in saved["adapters"].items():
            assert torch.equal(resumed["adapters"][name], t), name
        for name, w in saved["merged"].items():
            assert _d(resumed["merged"][name], w) < 1e-6, name
