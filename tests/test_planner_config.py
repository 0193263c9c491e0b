"""`dapo-mcore plan CONFIG [overrides] --nodes N`: the planner reads a project config and names config keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_mcore.cli import main as cli_main
from dapo_mcore.commands.plan import main, plan_input_from_config
from dapo_mcore.config import ConfigError, load_config
from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.fit import check
from dapo_mcore.plan.planner import GIB, estimate_memory

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CFG_32B = str(ROOT / "examples" / "qwen2.5-32b-fp8.yaml")
CFG_7B = str(ROOT / "examples" / "qwen2.5-7b.yaml")
PRESET_32B = ["model.hf_path=null", "model.preset=qwen2.5-32b"]


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out[: out.rindex("}") + 1])


def test_32b_recipe_fits_h100_with_the_documented_estimate(capsys):
    rc, est = plan_json(capsys, CFG_32B, *PRESET_32B, "--nodes", "16")
    assert rc == 0
    mem = est["memory_gib"]
    # docs/cluster.md, "Qwen2.5-32B, paper recipe": train peak 62.8, rollout peak 60.9 GiB, activations 40.9.
    assert mem["train_peak"] == pytest.approx(62.8, abs=0.05)
    assert mem["rollout_peak"] == pytest.approx(60.9, abs=0.05)
    assert mem["activations"] == pytest.approx(40.9, abs=0.05)
    assert mem["vllm_kv_tokens"] >= 16 * (2048 + 20480)
    # A generation batch is 1536 prompts x 16 (dynamic sampling draws 3x the 512-prompt train batch).
    assert est["flops"]["generation"] == pytest.approx(3 * est["flops"]["old_logprobs"])


def test_config_fields_reach_the_plan():
    cfg = load_config(CFG_32B, PRESET_32B)
    p = plan_input_from_config(cfg, 128)
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.virtual_pipeline) == (8, 2, 8, 1)
    assert (p.precision, p.recompute, p.distributed_optimizer, p.colocate_vllm) == ("fp8", "selective", True, True)
    assert (p.vllm_tensor_parallel, p.vllm_gpu_memory_utilization, p.offload_train_state_in_rollout) == (4, 0.5, False)
    assert (p.micro_batch_tokens, p.max_prompt_len, p.max_response_len) == (22528, 2048, 20480)
    assert (p.rollout_prompts, p.responses_per_prompt, p.mini_batch_prompts, p.gen_batch_prompts) == (512, 16, 32, 1536)
    assert p.model == preset_config("qwen2.5-32b")
    tiny = plan_input_from_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml")), 2)
    assert (tiny.precision, tiny.colocate_vllm, tiny.model["hidden_size"]) == ("fp32", False, 64)


def test_model_shape_from_hf_path_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen2.5-32b")))
    rc, from_dir = plan_json(capsys, CFG_32B, f"model.hf_path={tmp_path}", "--nodes", "16")
    _, from_preset = plan_json(capsys, CFG_32B, *PRESET_32B, "--nodes", "16")
    assert rc == 0 and from_dir == from_preset


def test_7b_recipe_fits_on_its_4_nodes(capsys):
    rc, est = plan_json(capsys, CFG_7B, "model.hf_path=null", "model.preset=qwen2.5-7b", "--nodes", "4")
    assert rc == 0
    assert est["memory_gib"]["train_peak"] == pytest.approx(49.8, abs=0.05)
    assert est["memory_gib"]["rollout_peak"] == pytest.approx(56.3, abs=0.05)


def test_bad_layout_override_is_refused_naming_config_keys(capsys):
    rc = main([CFG_32B, *PRESET_32B, "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
               "parallel.sequence_parallel=false", "--nodes", "16"])
    out = capsys.readouterr().out
    assert rc == 1 and "does not fit" in out and "training phase needs" in out and "rollout phase needs" in out
    # Suggestions are spelled as the overrides the user would type, and the smallest fitting layouts are named.
    assert "parallel.tensor_parallel=2" in out and "model.recompute=full" in out
    layouts = next(line for line in out.splitlines() if "layouts that fit" in line)
    assert "parallel.tensor_parallel=8 parallel.pipeline_parallel=2 (DP=8)" in layouts
    assert "parallel.tensor_parallel=8 parallel.pipeline_parallel=4 (DP=4)" in layouts
    rollout = next(line for line in out.splitlines() if "rollout phase needs" in line)
    assert "parallel.offload_for_rollout=true" in rollout and "parallel.distributed_optimizer=true" not in rollout


def test_rollout_offload_frees_grads_and_optimizer_only():
    base = plan_input_from_config(load_config(CFG_32B, PRESET_32B), 128)
    off = plan_input_from_config(load_config(CFG_32B, [*PRESET_32B, "parallel.offload_for_rollout=true"]), 128)
    a, b = estimate_memory(base), estimate_memory(off)
    assert a.rollout_peak - b.rollout_peak == pytest.approx(a.grads + a.optimizer)
    assert a.train_peak == b.train_peak


def test_each_suggested_layout_really_fits():
    cfg = load_config(CFG_32B, [*PRESET_32B, "parallel.tensor_parallel=2", "parallel.pipeline_parallel=1"])
    plan = plan_input_from_config(cfg, 128)
    from dapo_mcore.plan.fit import fitting_layouts

    layouts = fitting_layouts(plan)
    assert layouts and all(estimate_memory(c).peak <= 80 * GIB for c in layouts)
    assert all(c.tensor_parallel * c.pipeline_parallel * c.data_parallel == 128 for c in layouts)
    assert all(c.tensor_parallel <= 8 for c in layouts)  # TP stays inside a node
    check(layouts[0])


def test_config_rules_refuse_before_planning():
    with pytest.raises(ConfigError, match="multiple of 16"):
        main([CFG_32B, *PRESET_32B, "--nodes", "1", "--gpus-per-node", "12"])
    with pytest.raises(ConfigError, match="parallel.tensor_parallel=16 does not divide"):
        main([CFG_32B, *PRESET_32B, "parallel.tensor_parallel=16", "--nodes", "16"])


def test_command_line_mixups_are_usage_errors(capsys):
    for argv in ([CFG_32B, *PRESET_32B, "--nodes", "16", "--tensor-parallel", "4"],  # layout flag with CONFIG
                 [CFG_32B, *PRESET_32B],                                             # no job size
                 [CFG_32B, "--model", "qwen2.5-32b", "--nodes", "16"],                # two model sources
                 ["--tensor-parallel", "8"]):                                        # neither CONFIG nor model
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
    assert "parallel.tensor_parallel" in capsys.readouterr().err


def test_cli_turns_config_errors_into_exit_2(capsys):
    assert cli_main(["plan", CFG_32B, *PRESET_32B, "--nodes", "1"]) == 2
    assert "configuration error" in capsys.readouterr().err


def test_plan_warns_when_a_layout_fits_with_little_headroom(capsys):
    """A layout that fits with under 10% free says more than 'fits': the 30B-A3B recipe without recompute at
    expert-TP 4 (= TP), 77.7 of 80 GiB (the MoE dispatcher all-gathers the routed tokens over it)."""
    model = ["model.hf_path=null", "model.preset=qwen2.5-32b"]
    moe = [str(ROOT / "examples" / "qwen3-30b-a3b.yaml"), "model.hf_path=null", "model.preset=qwen3-30b-a3b",
           "model.recompute=none", "parallel.expert_tensor_parallel=4", "--nodes", "16"]
    assert main(moe) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "fits" and out[-2].startswith("warning: fits with only 2.3 GiB free of 80 GiB")
    assert "< the 10% margin" in out[-2]
    assert main([CFG_32B, *model, "--nodes", "16"]) == 0  # the recipe's PP=2: ~19 GiB free, no warning
    out = capsys.readouterr().out
    assert "warning" not in out
    # the requeues come from the step model's time of the recipe's own schedule (the --rank-variants row), not the
    # MFU line's one batch of max-length responses: 600 steps in 12 h jobs that checkpoint in their last hour
    minutes = float(out.split("step time by the step model: ")[1].split(" min")[0])
    per_job = int(11 * 60 // minutes)  # (to the printed 0.01 min)
    jobs = -(-600 // per_job)
    assert f"= {jobs} jobs of 12 h ({per_job} steps each), {jobs - 1} requeues" in out
    assert main([*moe, "--margin", "0.02"]) == 0
    assert "warning" not in capsys.readouterr().out


SMALL_32B = [*PRESET_32B, "train.prompts_per_step=16", "rollout.gen_batch_prompts=32", "train.mini_batch_prompts=16",
             "algo.max_gen_batches=4"]
"""The 32B recipe with a small batch: the step model simulates it in about a second."""


def test_the_plain_step_time_is_the_rank_variants_row_of_this_config():
    """One step model: the plain report's step time (which sizes the requeues) is --rank-variants' "this config" row,
    the same function at the same settings (before: the MFU estimate, 26.4 min, beside the row's 10.1)."""
    from dapo_mcore.commands.plan import model_step
    from dapo_mcore.plan.disagg import TransferRates, own_split
    from dapo_mcore.plan.step_model import SimSettings, colocated_input, rank_variants, variants_of

    for extra in ([], ["rollout.schedule.preset=paper"]):
        cfg = load_config(CFG_32B, [*SMALL_32B, *extra])
        plan = plan_input_from_config(cfg, 128)
        variant, seconds = model_step(cfg, plan, 1)
        assert variant == variants_of(cfg)[0]
        p = colocated_input(cfg, plan)
        rows = rank_variants(cfg, p, TransferRates(), SimSettings(steps=1), own_split(cfg, p, TransferRates()))
        assert [t for v, s, t in rows if v == variant and s is None] == [seconds]


def test_plan_prints_one_step_time_for_the_config(capsys):
    """The CLI: plain ``plan``'s step-model line, its requeue line, and ``--rank-variants``' marked row (priced once
    there, and printed as the plain line too) agree (a plain path that drifted to another model or other settings
    would print another number)."""
    assert main([CFG_32B, *SMALL_32B, "--nodes", "16"]) == 0
    out = capsys.readouterr().out
    plain = out.split("step time by the step model: ")[1].split(" min")[0]
    assert f"x ~{float(plain):.0f} min (the step model, sync_partial_done)" in out
    assert main([CFG_32B, *SMALL_32B, "--nodes", "16", "--rank-variants"]) == 0
    ranked = capsys.readouterr().out
    row = next(ln for ln in ranked.splitlines() if ln.endswith("<- this config"))
    assert row.split()[1] == "sync_partial_done"
    assert row.split()[3] == plain == ranked.split("step time by the step model: ")[1].split(" min")[0]


def test_plan_ranks_the_variants_without_importing_torch():
    """``plan --rank-variants`` is pure Python (the step model, the MoE shape facts, the entropy chunk size): torch's
    import alone is ~2 CPU-s of its ~6."""
    import subprocess
    import sys

    code = ("import sys\nfrom dapo_mcore.cli import main\n"
            "rc = main(['plan', 'examples/qwen2.5-32b-fp8.yaml', '--nodes', '16', '--rank-variants', '--rank-steps', '1'])\n"
            "print('torch' in sys.modules, rc)\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip().splitlines()[-1] == "False 0", (done.stdout + done.stderr)[-3000:]
