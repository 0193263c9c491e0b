"""``dapo-mcore rehearse``: the shrink mapping of every shipped recipe (unit), and one real rehearsal (e2e)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.commands.config import precheck
from dapo_mcore.commands.launcher import dead_rank_line
from dapo_mcore.commands.rehearse import launcher_dead_rank, passed_line, recipe_model, rehearse, shrink
from dapo_mcore.config import load_config
from dapo_mcore.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _plan(name: str, *overrides: str, vllm: bool = False, nproc: int | None = None):
    cfg = load_config(ROOT / "examples" / name, list(overrides))
    return shrink(cfg, recipe_model(cfg)[0], vllm_installed=vllm, nproc=nproc)


def _value(plan, key: str) -> str:
    hits = [o.split("=", 1)[1] for o in plan.overrides if o.split("=", 1)[0] == key]
    assert hits, key
    return hits[-1]


@pytest.mark.unit
@pytest.mark.parametrize("recipe", EXAMPLES, ids=lambda p: p.name)
def test_every_recipes_rehearsal_passes_the_configs_own_checks_at_its_world(recipe, tmp_path):
    """The shrunk model is divisible the way the layout needs (heads by TP, layers by the pipeline's stages, experts
    by EP): the trainer's own validation accepts the rehearsal's config at the rehearsal's world size."""
    cfg = load_config(recipe, [])
    plan = shrink(cfg, recipe_model(cfg)[0], vllm_installed=False)
    extra = []
    if plan.hf is not None:
        (tmp_path / "config.json").write_text(json.dumps(plan.hf))
        extra = [f"model.hf_path={tmp_path}"]
    checked = precheck(str(recipe), [*plan.overrides, *extra, f"run.dir={tmp_path / 'run'}"],
                       world_size=plan.world, warn=False, check_files=False)
    assert checked.parallel.backend == "gloo" and not checked.model.fp8.enabled
    assert plan.world <= 8


@pytest.mark.unit
def test_the_moe_recipe_keeps_every_switch_at_two():
    plan = _plan("qwen3-30b-a3b.yaml")
    assert plan.world == 2  # DP 2, EP 2 x expert-TP 1 (the recipe's); TP 1 to fit the machine (MoE with TP needs SP)
    assert (_value(plan, "parallel.tensor_parallel"), _value(plan, "parallel.expert_parallel"),
            _value(plan, "parallel.sequence_parallel"), _value(plan, "parallel.pipeline_parallel")) == \
        ("1", "2", "false", "1")
    assert any(n.startswith("TP with MoE") for n in plan.not_rehearsed)
    assert "sequence parallel (TP is 1 here)" in plan.not_rehearsed
    hf = plan.hf
    assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] % 2 == 0 and hf["num_experts_per_tok"] == 2
    assert hf["num_attention_heads"] % 2 == 0 and hf["num_key_value_heads"] % 2 == 0
    assert not any(o.startswith("algo.router_replay") or o.startswith("algo.tis_cap") for o in plan.overrides)
    # the recipe ships replay on (vLLM engines as independent instances); turned off, it is not claimed
    assert "router_replay=rollout" in plan.kept and "rollout correction" in plan.kept
    assert "router_replay=rollout" not in _plan("qwen3-30b-a3b.yaml", "algo.router_replay=none").kept
    assert _value(plan, "rollout.engine") == "hf"
    assert any(n.startswith("vLLM (not installed") for n in plan.not_rehearsed)
    assert _value(plan, "rollout.engine") == "hf"
    assert _value(_plan("qwen3-30b-a3b.yaml", vllm=True), "rollout.engine") == "vllm"


@pytest.mark.unit
def test_pipeline_virtual_stages_and_async_engine_ranks_map_to_two(tmp_path):
    plan = _plan("qwen3-32b-fp8.yaml", "parallel.virtual_pipeline=4")
    assert (_value(plan, "parallel.pipeline_parallel"), _value(plan, "parallel.virtual_pipeline")) == ("2", "2")
    assert plan.hf["num_hidden_layers"] % 4 == 0 and plan.world == 8 and "FP8" in plan.not_rehearsed
    # the trainer's own checks accept it: layers by PP x VPP, and each DP rank's mini-batch at least PP responses
    # (the interleaved schedule runs micro-batches in groups of PP)
    (tmp_path / "config.json").write_text(json.dumps(plan.hf))
    checked = precheck(str(ROOT / "examples" / "qwen3-32b-fp8.yaml"),
                       ["parallel.virtual_pipeline=4", *plan.overrides, f"model.hf_path={tmp_path}",
                        f"run.dir={tmp_path / 'run'}"], world_size=plan.world, warn=False, check_files=False)
    assert checked.parallel.virtual_pipeline == 2
    asy = _plan("qwen2.5-32b-fp8-async.yaml")
    assert _value(asy, "rollout.pipeline.engine_ranks") == "2"
    assert asy.world == 2 * 2 * 1 + 2  # DP 2 would be 10 processes: DP drops to 1, and the closing line says DP=1
    assert "DP=1" in asy.kept and "async with 2 engine ranks" in asy.kept
    assert _plan("qwen2.5-32b-fp8-async.yaml", nproc=10).world == 10


@pytest.mark.unit
@pytest.mark.parametrize("name", ["qwen2.5-32b-fp8.yaml", "qwen3-32b-fp8.yaml"])
def test_the_dense_recipes_rehearse_their_schedule_and_the_paper_key_drops_it(name):
    schedule = ("streaming", "partial", "completion order")
    plan = _plan(name)
    assert all(s in plan.kept for s in schedule)
    assert _value(plan, "rollout.schedule.stream_chunk_prompts") == "2"  # a chunk of one prompt per data-parallel rank (DP=2)
    assert not any(s in _plan(name, "rollout.schedule.preset=paper").kept for s in schedule)


@pytest.mark.unit
def test_a_cpu_recipe_keeps_its_tiny_model_and_one_process():
    plan = _plan("tiny_cpu.yaml")
    assert plan.hf is None and plan.world == 1 and not any(o.startswith("model.hf_path") for o in plan.overrides)


@pytest.mark.unit
def test_a_world_the_layout_cannot_take_is_one_line():
    with pytest.raises(UserError, match=r"--nproc-per-node 3: .*use 2 or 4"):
        _plan("qwen3-30b-a3b.yaml", nproc=3)


@pytest.mark.unit
def test_a_model_path_that_is_not_here_and_names_no_preset_is_one_line():
    cfg = load_config(ROOT / "examples" / "qwen2.5-7b.yaml", ["model.hf_path=/nowhere/my-model"])
    with pytest.raises(UserError, match="model.preset=NAME"):
        recipe_model(cfg)


@pytest.mark.unit
def test_the_summary_names_the_rank_the_launcher_named():
    """The fault targets rank 1, but the summary says what the launcher saw: the rank its dead-rank line names."""
    log = "\n".join(["[rank0] step 2 done", dead_rank_line("0", 9, "train"), "[rank1] peer left"])
    assert launcher_dead_rank(log) == "0"
    assert launcher_dead_rank("no rank died here") is None
    assert launcher_dead_rank(dead_rank_line("?", 9, "train")) is None  # the launcher could not tell: the target
    plan = _plan("tiny_cpu.yaml", nproc=2)
    line = passed_line("r.yaml", 12.0, {"model_type": "qwen2", "num_hidden_layers": 2}, plan, "0", 137, "x")
    assert "rank 0 killed (-9) at step 3 (exit 137)" in line and line.startswith("rehearsed r.yaml")


def _fake_train(run: Path, dead: str | None):
    """A stand-in for the two train launches: the first writes step 1-2 checkpoints and (maybe) the launcher's
    dead-rank line, the second finishes step 3; both write what a run logs."""
    calls = []

    def train(recipe, overrides, world, log, fault):
        calls.append(fault)
        with log.open("a") as f:
            if fault:
                for step in (1, 2):
                    (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True, exist_ok=True)
                logging.getLogger("dapo_mcore.test").warning("a warning on stderr before the verdict")
                f.write((dead_rank_line(dead, 9, "train") if dead else "killed") + "\n")
                return 137
            (run / "checkpoints" / "step_000003").mkdir(parents=True)
            f.write("loaded checkpoint checkpoints/step_000002 (step 2)\n")
            return 0
    return train, calls


@pytest.mark.unit
def test_the_verdict_is_the_last_line_and_names_the_launchers_rank(tmp_path, monkeypatch, capsys):
    """rehearse's closing line is its last line of output and names the rank the launcher named in THIS
    rehearsal's part of the log (a --run-dir used before holds an older rehearsal's lines: not read)."""
    from dapo_mcore.commands import rehearse as mod

    run = tmp_path / "run"
    (tmp_path / "run.log").write_text(dead_rank_line("3", 9, "train") + "\n")  # an earlier rehearsal's line
    train, calls = _fake_train(run, dead="0")
    monkeypatch.setattr(mod, "_train", train)
    assert rehearse(str(ROOT / "examples" / "tiny_cpu.yaml"), [], 2, run) == 0
    out, _ = capsys.readouterr()
    last = out.strip().splitlines()[-1]
    assert last.startswith("rehearsed ") and "rank 0 killed (-9)" in last, out
    assert calls == ["step:3@1", None]
    # no dead-rank line in this rehearsal's part of the log: the rank the fault targeted, not the older line's 3
    run2 = tmp_path / "run2"
    (tmp_path / "run2.log").write_text(dead_rank_line("3", 9, "train") + "\n")
    monkeypatch.setattr(mod, "_train", _fake_train(run2, dead=None)[0])
    assert rehearse(str(ROOT / "examples" / "tiny_cpu.yaml"), [], 2, run2) == 0
    assert "rank 1 killed (-9)" in capsys.readouterr()[0].strip().splitlines()[-1]


@pytest.mark.e2e
def test_a_two_rank_rehearsal_trains_is_killed_and_resumes(tmp_path, cli_env):
    """tiny_cpu.yaml on 2 ranks: two steps, rank 1 killed (-9) at the third, the resume finishes it."""
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "rehearse", "examples/tiny_cpu.yaml",
                           "reward.workers=2", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], cwd=ROOT, env=cli_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = proc.stdout.strip().splitlines()[-1]  # the verdict: the last line of all it printed
    assert line.startswith("rehearsed examples/tiny_cpu.yaml") and "rank 1 killed (-9) at step 3" in line
    assert "DP=2" in line and "not rehearsed:" in line
    log = (tmp_path / "run.log").read_text()
    assert "DAPO_MCORE_FAULT=step:3@1: killing this process" in log and "checkpoints/step_000002 (step 2)" in log
    assert "dapo-mcore: rank 1 died of SIGKILL" in log  # the rank the verdict names
    assert "Traceback" not in log  # the killed rank's reward-pool workers stop quietly (the pool: reward.workers)
    steps = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"step"' in r]
    assert max(steps) == 3
    evals = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "eval/problems" in r]
    assert [e["eval/problems"] for e in evals] == [8]  # the closing evaluation only, on eval.max_prompts prompts
