"""The Megatron actor on a tiny random model of each family with its own traits, single process vs TP=2 (2 gloo
processes), through the same workers as tests/test_actor_parity.py (tests/dist_scripts): logits and log-probs equal
Hugging Face's own model, and two DAPO updates give the same loss, grad norm and exported weights at TP=1 and TP=2.

- Qwen3 (``Qwen3ForCausalLM``): the q/k norms are replicated while each TP rank normalises only its own heads, so a
  missing or wrong reduction of their gradients over TP ranks would show in the grad norm and in the exported q/k norm
  weights.
- Llama 3.x (``LlamaForCausalLM``): its llama3 RoPE with a 16-token original context rescales all but the fastest
  frequency bands at every position; the embedding is tied, so it takes the output layer's gradient too."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_scripts import harness

pytestmark = pytest.mark.distributed

TOL = 1e-5

FAMILIES = {
    # preset -> (name in messages, weights the updates must move: what a wrong TP reduction would leave wrong)
    "tiny-qwen3": ("Qwen3", ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight")),
    "tiny-llama": ("Llama", ("model.embed_tokens.weight",)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request):
    preset = request.param
    name, moved = FAMILIES[preset]
    ws = Path(tempfile.mkdtemp(prefix=f"dapo_{preset}_actor_"))
    try:
        spec = harness._write_workspace(ws, preset=preset)
        script = str(harness.HERE / "actor_layouts.py")
        ref = harness._launch([script, str(ws), "ref", "1x1"])
        multi = harness._launch([script, str(ws), "multi", "2x1"], nproc=2)
        harness._wait(ref, f"{name} TP=1")
        harness._wait(multi, f"{name} TP=2")
        out = ws / "out"
        init = load_file(str(ws / "hf" / "model.safetensors"))
        yield {"spec": spec, "init": init, "moved": moved, "hf": torch.load(ws / "hf_reference.pt"),
               "ref": torch.load(out / "ref_rank0.pt", weights_only=False)["tp1_pp1_dp1"],
               "tp2": [torch.load(out / f"multi_rank{r}.pt", weights_only=False)["tp2_pp1_dp1"] for r in range(2)]}
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _all(runs):
    return [("tp1", runs["ref"]), ("tp2 rank0", runs["tp2"][0]), ("tp2 rank1", runs["tp2"][1])]


def test_logits_and_logprobs_equal_hf(runs):
    hf_logp = [lp for lp, _ in runs["hf"]["samples"]]
    for name, res in _all(runs):
        assert (res["logits"] - runs["hf"]["logits"]).abs().max() < 1e-4, name
        for got, want in zip(res["logp_rows"], hf_logp, strict=True):
            if got.numel():
                assert (got.double() - want).abs().max() <= TOL, name


def test_dapo_updates_match_across_tp(runs):
    ref = runs["ref"]
    for name, res in _all(runs)[1:]:
        for got, want in zip(res["metrics"], ref["metrics"], strict=True):
            assert got["update_ok"] == want["update_ok"] == 1.0
            for key in ("loss", "grad_norm", "ppo_kl"):
                assert abs(got[key] - want[key]) <= TOL, (name, key, got[key], want[key])
        for k, want in ref["weights"].items():
            assert (res["weights"][k] - want).abs().max() <= TOL, (name, k)
    for k in runs["moved"]:
        assert (ref["weights"][k] - runs["init"][k]).abs().max() > 1e-4, k  # the updates moved them
