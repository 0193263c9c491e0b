"""LoRA on the Megatron actor, against Hugging Face peft and across layouts (one 2-process launch).

The same tiny Qwen2 and the same adapter (a peft adapter directory: q/k/v share one A, gate/up share one A, as
Megatron's fused layers do) at DP=2, TP=2, PP=2 and TP=2 with full activation recomputation
(tests/dist_scripts/lora_layouts.py) give:
* the logits of peft's own model (``PeftModel.from_pretrained``) with that adapter;
* the same loss, grad norm, adapter gradients, updated adapters and merged weights at every layout;
* merged weights (what the weight sync sends, merged shard-locally) equal to a naive ``W + alpha/r * B @ A`` on the
  whole matrices;
* a base that is frozen for real: unchanged, no gradient buffers, no optimizer state (the optimizer holds exactly
  the adapters).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.dist_scripts import harness

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
LAYERS = 4  # PP=2 x VPP=2: one layer per model chunk
# with 2 processes: DP=2, TP=2, PP=2, TP=2 with full recomputation, PP=2 with 2 virtual stages (interleaved)
LAYOUTS = "1x1,2x1,1x2,2x1f,1x2v2"
NAMES = ["tp1_pp1_dp2", "tp2_pp1_dp1", "tp1_pp2_dp1", "tp2_pp1_dp1_recompute", "tp1_pp2_vpp2_dp1"]
RESUMED = NAMES[:3] + NAMES[4:]
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}


def random_adapter(hf_model, seed: int) -> dict[str, torch.Tensor]:
    """peft-named adapter tensors for every projection; the projections of one fused Megatron layer share A."""
    gen = torch.Generator().manual_seed(seed)
    out, shared = {}, {}
    for name, mod in hf_model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            continue
        layer = name.rsplit(".", 2)[0]
        key = (layer, FUSED.get(leaf, leaf))
        if key not in shared:
            shared[key] = torch.randn(RANK, mod.in_features, generator=gen) * 0.3
        out[f"base_model.model.{name}.lora_A.weight"] = shared[key]
        out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(mod.out_features, RANK, generator=gen) * 0.3
    return out


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]).save_pretrained(directory)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs():
    import transformers
    from peft import PeftModel

    ws = Path(tempfile.mkdtemp(prefix="dapo_lora_"))
    try:
        spec = harness._write_workspace(ws, num_hidden_layers=LAYERS)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ws / "hf", dtype=torch.float32).eval()
        adapter = random_adapter(hf, seed=17)
        write_adapter(ws / "adapter", adapter)
        from conversion.synthetic import save_tiny_hf_model

        save_tiny_hf_model(ws / "hf_other", seed=4, vocab_size=spec["vocab_size"], num_hidden_layers=LAYERS)  # another base, same shapes
        peft_model = PeftModel.from_pretrained(hf, ws / "adapter").eval()
        with torch.no_grad():
            peft_logits = peft_model(torch.tensor(spec["ids"])).logits.float()
        proc = harness._launch([str(harness.HERE / "lora_layouts.py"), str(ws), LAYOUTS], nproc=2)
        harness._wait(proc, "LoRA layouts")
        out = [torch.load(ws / "out" / f"lora_rank{r}.pt", weights_only=False) for r in range(2)]
        yield {"spec": spec, "peft_logits": peft_logits, "adapter": adapter, "out": out, "ws": ws}
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _each(runs, names=NAMES):
    for rank in range(2):
        assert sorted(runs["out"][rank]) == sorted(NAMES)
        for name in names:
            yield name, rank, runs["out"][rank][name]


def test_logits_equal_peft_with_the_same_adapter(runs):
    want = runs["peft_logits"]
    for name, rank, res in _each(runs):
        assert (res["logits"] - want).abs().max().item() < 1e-4, (name, rank)


def test_the_adapter_changes_the_logits(runs):
    """Guard: the adapter is not a no-op (a model without it would fail the comparison above)."""
    ws = runs["ws"]
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ws / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf(torch.tensor(runs["spec"]["ids"])).logits.float()
    assert (plain - runs["peft_logits"]).abs().max().item() > 0.1


def test_every_layout_gives_the_same_update(runs):
    ref = runs["out"][0][NAMES[0]]
    for name, rank, res in _each(runs):
        for key in ("loss", "grad_norm"):
            assert abs(res["metrics"][key] - ref["metrics"][key]) < 1e-5, (name, rank, key)
        assert res["metrics"]["update_ok"] == 1.0
        assert res["frozen"]["chunks"] == (2 if "_vpp2" in name else 1), (name, rank)  # VPP: two model chunks
        for what in ("grads", "adapters", "merged"):
            assert sorted(res[what]) == sorted(ref[what]), (name, what)
            diff = max((res[what][k] - ref[what][k]).abs().max().item() for k in ref[what])
            assert diff < 1e-5, (name, rank, what, diff)


def test_the_logged_adapter_norms_equal_the_adapters_change(runs):
    """``lora/update_norm`` and ``lora/adapter_norm`` (the report's adapter panel, diagnose's rule) against the
    adapters before and after the update, each fused layer's shared A counted once."""
    shared = ("k_proj.lora_A", "v_proj.lora_A", "up_proj.lora_A")  # the same tensor as q_proj's / gate_proj's A
    for name, rank, res in _each(runs):
        keep = [k for k in res["adapters"] if not any(s in k for s in shared)]
        upd = sum((res["adapters"][k] - runs["adapter"][k]).double().pow(2).sum() for k in keep).sqrt().item()
        par = sum(res["adapters"][k].double().pow(2).sum() for k in keep).sqrt().item()
        assert abs(res["metrics"]["lora/update_norm"] - upd) < 1e-5 * max(upd, 1), (name, rank)
        assert abs(res["metrics"]["lora/adapter_norm"] - par) < 1e-5 * par, (name, rank)
        assert upd > 0


def test_gradients_reach_every_adapter_and_the_update_moves_them(runs):
    ref = runs["out"][0][NAMES[0]]
    assert len(ref["grads"]) == len(runs["adapter"]) == LAYERS * 7 * 2  # layers x 7 projections x (A, B)
    for k, g in ref["grads"].items():
        assert g.abs().max() > 0, k
        assert (ref["adapters"][k] - runs["adapter"][k]).abs().max() > 1e-6, k


def test_merged_weights_equal_a_naive_full_matrix_merge(runs):
    from safetensors.torch import load_file

    base = load_file(str(runs["ws"] / "hf" / "model.safetensors"))
    for name, rank, res in _each(runs):
        for hf_name, w in base.items():
            module = hf_name[: -len(".weight")]
            a = res["adapters"].get(f"base_model.model.{module}.lora_A.weight")
            want = w if a is None else w + ALPHA / RANK * res["adapters"][f"base_model.model.{module}.lora_B.weight"] @ a
            assert (res["merged"][hf_name] - want).abs().max().item() < 1e-5, (name, rank, hf_name)


def test_the_planner_counts_the_adapters_each_rank_holds(runs):
    """plan/lora.py's adapter parameters per GPU equal the trainable parameters each rank really holds."""
    import json as _json

    from dapo_mcore.plan.lora import adapter_params_per_gpu
    from dapo_mcore.telemetry.flops import ModelShape

    hf = _json.loads((runs["ws"] / "hf" / "config.json").read_text())
    shape = ModelShape.from_hf(hf)
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for name, rank, res in _each(runs):
        tp, pp = (1, 1) if name.startswith("tp1_pp1") else ((2, 1) if name.startswith("tp2") else (1, 2))
        want = adapter_params_per_gpu(shape, RANK, targets, tensor_parallel=tp, pipeline_parallel=pp)
        assert res["frozen"]["trainable_here"] == want, (name, rank)


def test_after_a_weight_sync_the_engine_holds_base_plus_the_naive_delta(runs):
    from safetensors.torch import load_file

    base = load_file(str(runs["ws"] / "hf" / "model.safetensors"))
    for name, rank, res in _each(runs):
        moved = 0
        for hf_name, w in base.items():
            module = hf_name[: -len(".weight")]
            a = res["adapters"].get(f"base_model.model.{module}.lora_A.weight")
            want = w if a is None else w + ALPHA / RANK * res["adapters"][f"base_model.model.{module}.lora_B.weight"] @ a
            assert (res["engine"][hf_name] - want).abs().max().item() < 1e-5, (name, rank, hf_name)
            moved += int(a is not None and (res["engine"][hf_name] - w).abs().max().item() > 1e-3)
        assert moved == LAYERS * 7, (name, rank, moved)  # every adapted projection really changed in the engine


def test_the_base_is_frozen_for_real(runs):
    for name, rank, res in _each(runs):
        f = res["frozen"]
        assert f["base_requires_grad"] == 0 and f["base_main_grad"] == 0, (name, rank, f)
        assert f["optimizer_is_adapters"] and f["optimizer_params"] == f["adapters"] > 0, (name, rank, f)
        assert f["unadapted_equal_hf"], (name, rank)


def test_resume_at_another_layout_continues_exactly(runs):
    """Every layout resumes the DP=2 run's checkpoint (taken after the first update): the adapters and Adam's
    moments are the saved ones, and the second update is the uninterrupted run's."""
    first = runs["out"][0][NAMES[0]]
    for name, rank, res in _each(runs, RESUMED):
        for got, want in ((res["resumed_adapters"], first["adapters"]), (res["resumed_moments"], first["moments"])):
            assert sorted(got) == sorted(want)
            assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6, (name, rank)
        for key in ("loss", "grad_norm"):
            # relative: the uninterrupted run updates from its own first update (equal to the DP=2 run's to ~1e-6)
            want = res["update2"][key]
            assert abs(res["resumed_update2"][key] - want) < 1e-5 * max(1.0, abs(want)), (name, rank, key)
    assert max(v.abs().max().item() for v in first["moments"].values()) > 0  # the moments are not all zero


def test_a_weights_only_resume_takes_the_adapters_and_starts_adam_fresh(runs):
    first = runs["out"][0][NAMES[0]]
    for name, rank, res in _each(runs, RESUMED):
        got = res["weights_only_adapters"]
        assert max((got[k] - first["adapters"][k]).abs().max().item() for k in got) < 1e-6, (name, rank)
        assert all(v.abs().max().item() == 0 for v in res["weights_only_moments"].values()), (name, rank)


def test_every_tp_shard_of_every_adapter_is_in_the_checkpoint(runs):
    """The TP=2 run's checkpoint holds each adapter whole (both ranks' shards of B, of row layers' A); the VPP run's
    holds every model chunk's adapters (each stage holds two chunks)."""
    from safetensors.torch import load_file

    for name in ("tp2_pp1_dp1", "tp1_pp2_vpp2_dp1"):
        res = runs["out"][0][name]
        files = sorted((runs["ws"] / "ckpt" / name / "step_000001" / "lora" / "adapter").glob("*.safetensors"))
        saved = {k: v for f in files for k, v in load_file(str(f)).items()}
        assert sorted(saved) == sorted(res["adapters"]) and len(saved) == LAYERS * 7 * 2, name
        for k, v in saved.items():
            assert torch.equal(v, res["adapters"][k]), (name, k)
            assert v.shape == runs["adapter"][k].shape, (name, k)


def test_a_flipped_byte_in_an_adapter_file_is_found_on_resume(runs):
    """The adapters' files are checked against the checkpoint's checksum table like every file of it: a flipped
    byte raises DamagedFileError (which makes a resume fall back to the older checkpoint) on every rank."""
    for name, rank, res in _each(runs, RESUMED):
        msg = res["damaged_adapter"]
        assert msg is not None, (name, rank, "a damaged adapter file was loaded")
        assert "lora/" in msg, (name, rank, msg)


def test_a_resume_on_another_base_is_refused_in_one_line(runs):
    for name, _rank, res in _each(runs, RESUMED):
        msg = res["other_base"]
        assert msg is not None and "hf_other" in msg and "base" in msg and "\n" not in msg, (name, msg)


def _tp2_checkpoint(runs) -> Path:
    return runs["ws"] / "ckpt" / "tp2_pp1_dp1" / "step_000001"


def test_merged_export_differs_from_the_base_only_in_targeted_projections_by_rank_r(runs, tmp_path):
    from safetensors.torch import load_file

    from conversion.mcore_to_hf import main

    assert main(["--mcore", str(_tp2_checkpoint(runs)), "--out", str(tmp_path / "merged"), "--no-progress"]) == 0
    merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    base = load_file(str(runs["ws"] / "hf" / "model.safetensors"))
    assert sorted(merged) == sorted(base)
    want = runs["out"][0]["tp2_pp1_dp1"]["merged"]  # what the weight sync sent after the same update
    changed = []
    for name, w in base.items():
        assert (merged[name] - want[name]).abs().max().item() < 1e-6, name
        delta = (merged[name] - w).double()
        if delta.abs().max() > 0:
            changed.append(name.split(".")[-2])
            # fp32 storage rounds W + delta (~1e-7 relative): singular values below 1e-4 of the largest are that
            assert 0 < torch.linalg.matrix_rank(delta, rtol=1e-4).item() <= RANK, name
    assert sorted(set(changed)) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert len(changed) == LAYERS * 7  # every projection of every layer; embeddings and norms untouched


def test_adapter_only_export_loads_in_peft_and_gives_the_merged_logits(runs, tmp_path):
    import transformers
    from peft import PeftModel

    from conversion.mcore_to_hf import main

    ckpt = str(_tp2_checkpoint(runs))
    assert main(["--mcore", ckpt, "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert main(["--mcore", ckpt, "--out", str(tmp_path / "merged"), "--no-progress"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
    ids = torch.tensor(runs["spec"]["ids"])
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["ws"] / "hf", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = peft_model(ids).logits, merged(ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(runs["ws"] / "hf", dtype=torch.float32)(ids).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (plain - want).abs().max().item() > 0.1  # guard: the adapter matters


def test_adapter_only_without_adapters_is_refused_in_one_line(runs, tmp_path, capsys):
    from conversion.mcore_to_hf import main

    assert main(["--mcore", str(runs["ws"] / "hf"), "--out", str(tmp_path / "a"), "--adapter-only"]) != 0
    err = capsys.readouterr().err.strip()
    assert "holds no LoRA adapters" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "a").exists()
