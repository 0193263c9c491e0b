"""``dapo-mcore config``, and the checks train/eval run before importing Megatron or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.commands.config import main, precheck, world_size_from_env
from dapo_mcore.config.tree import ConfigError
from dapo_mcore.run.checkpoints import resolve_eval_checkpoint

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_config_prints_resolved_config_and_layout(capsys):
    assert main([str(ROOT / "examples/tiny_cpu.yaml"), "train.steps=10", "run.dir=/nonexistent/run"]) == 0
    out = capsys.readouterr().out
    assert "steps: 10" in out and "# derived" in out
    assert "# updates: 4 optimizer step(s) per rollout step (16 / 4 prompts per mini-batch x 1 epoch(s)); " \
           "10 steps = 40 updates" in out
    assert "# run dir: /nonexistent/run (new)" in out
    assert "# rollout schedule: batch and filter, DAPO's published loop (every rollout.schedule switch off)" in out


def test_config_names_the_recipe_schedule_and_the_key_back_to_the_paper_loop(capsys):
    recipe = [str(ROOT / "examples/qwen2.5-32b-fp8.yaml"), "model.hf_path=null", "model.preset=qwen2.5-32b",
              "--world-size", "128"]
    assert main(recipe) == 0
    assert ("# rollout schedule: streaming + partial rollouts, completion order "
            "(rollout.schedule.preset=partial_completion); DAPO's published loop: rollout.schedule.preset=paper"
            in capsys.readouterr().out)
    assert main([*recipe, "rollout.schedule.preset=paper"]) == 0
    assert "# rollout schedule: batch and filter, DAPO's published loop" in capsys.readouterr().out


def test_config_validates_the_layout_for_a_world_size(capsys):
    with pytest.raises(ConfigError, match="tensor_parallel"):
        main([str(ROOT / "examples/tiny_cpu.yaml"), "parallel.tensor_parallel=2", "--world-size", "3"])
    assert main([str(ROOT / "examples/tiny_cpu.yaml"), "parallel.tensor_parallel=2", "--world-size", "2"]) == 0
    assert "# processes: 2 = data parallel 1 x tensor parallel 2" in capsys.readouterr().out


def test_world_size_from_env():
    assert world_size_from_env({}) == 1
    assert world_size_from_env({"RANK": "0", "WORLD_SIZE": "4"}) == 4
    assert world_size_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "8"}) == 8


def _ckpt(root: Path, step: int, complete: bool = True) -> Path:
    d = root / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    if complete:
        (d / "COMPLETE").write_text("")
    return d


def test_eval_checkpoint_accepts_a_run_dir(tmp_path):
    run = tmp_path / "run"
    _ckpt(run, 10)
    newest = _ckpt(run, 20)
    _ckpt(run, 30, complete=False)
    assert resolve_eval_checkpoint(str(run)) == str(newest)
    assert resolve_eval_checkpoint(str(newest)) == str(newest)
    (run / "checkpoints" / "latest").write_text("step_000010")
    assert resolve_eval_checkpoint(str(run)) == str(run / "checkpoints" / "step_000010")
    assert resolve_eval_checkpoint("base") == "base" and resolve_eval_checkpoint(None) is None


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: (p / "empty_run").mkdir() or p / "empty_run", "holds no complete checkpoint"),
])
def test_eval_checkpoint_errors(tmp_path, make, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_eval_checkpoint(str(make(tmp_path)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from dapo_mcore.cli import main; rc = main(sys.argv[1:]); "
            "print('heavy:', sorted(m for m in ('transformers', 'megatron') if m in sys.modules)); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_config_errors_and_bad_eval_paths_come_before_heavy_imports(tmp_path):
    bad_key = _cli("train", "examples/tiny_cpu.yaml", "algo.clip_hgh=0.3")
    assert bad_key.returncode == 2 and "Did you mean 'clip_high'" in bad_key.stderr
    assert "heavy: []" in bad_key.stdout
    bad_ckpt = _cli("eval", "examples/tiny_cpu.yaml", "--checkpoint", str(tmp_path / "nope"))
    assert bad_ckpt.returncode == 2 and "no such directory" in bad_ckpt.stderr
    assert "heavy: []" in bad_ckpt.stdout


def test_config_refuses_what_train_refuses(tmp_path, capsys):
    """Overrides after --world-size; sequence parallel on the local spec, the distributed optimizer
    on gloo and another run's directory are refused by `config`, as `train` refuses them, before anything starts."""
    tiny = str(ROOT / "examples/tiny_cpu.yaml")
    assert main([tiny, "--world-size", "2", "parallel.tensor_parallel=2", f"run.dir={tmp_path / 'r'}"]) == 0
    assert "tensor parallel 2" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="sequence_parallel=true needs model.layer_spec=transformer_engine"):
        main([tiny, "--world-size", "2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="with parallel.backend=gloo set parallel.distributed_optimizer=false"):
        main([tiny, "parallel.backend=gloo", "parallel.distributed_optimizer=true"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algo:\n  clip_high: 0.5\n")
    with pytest.raises(ConfigError, match="holds another run"):
        main([tiny, f"run.dir={run}"])
    assert main([tiny, f"run.dir={run}", "run.overwrite=true"]) == 0


def test_config_checks_a_cluster_config_on_a_laptop(capsys, tmp_path):
    """`config` validates the layout of a cluster config whose dataset files live on the cluster: a missing file
    is a warning naming what `train` would refuse here, not the end of the check (the 32B async recipe at 128 ranks)."""
    cfg = str(ROOT / "examples/qwen2.5-32b-fp8-async.yaml")
    assert main([cfg, "model.hf_path=null", "model.preset=qwen2.5-32b", "--world-size", "128"]) == 0
    out, err = capsys.readouterr()
    assert "32 trainer ranks (0-31) + 96 engine ranks (32-127)" in out
    assert "train would refuse: data.train='/data/dapo/dapo-math-17k.parquet': no such file" in err
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(ConfigError, match="no such file"):  # train itself still refuses it, before anything starts
        precheck(str(ROOT / "examples/tiny_cpu.yaml"), [f"data.train={missing}"])
