"""Lint and contract checks of every Slurm script: bash -n, shellcheck, the requeue directives."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SLURM_DIR = Path(__file__).resolve().parents[1] / "slurm"
SCRIPTS = sorted([*SLURM_DIR.rglob("*.sh"), *SLURM_DIR.rglob("*.sbatch")])
SBATCH = sorted(SLURM_DIR.glob("*.sbatch"))


def test_scripts_exist():
    names = {p.name for p in SCRIPTS}
    for required in ("env.sh", "launch.sh", "tiny_cpu.sbatch", "dapo_qwen2.5_32b_fp8.sbatch", "dapo_qwen2.5_7b.sbatch",
                     "convert.sbatch", "profile.sbatch", "install.sh", "start.sh", "stop.sh"):
        assert required in names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(SLURM_DIR)))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(SLURM_DIR)))
def test_shellcheck_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", "-s", "bash", script.name], cwd=script.parent,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def directives(script: Path) -> dict[str, str]:
    out = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_scripts_use_the_one_launch_path_and_requeue_contract(script):
    text = script.read_text()
    d = directives(script)
    assert "set -euo pipefail" in text
    assert '"$repo/slurm/launch.sh"' in text, "every job goes through slurm/launch.sh"
    assert d["open-mode"] == "append"
    assert "pkill" not in text and "killall" not in text
    if "dapo-mcore train" in text or script.name == "tiny_cpu.sbatch":  # trainer jobs: requeue contract
        assert re.fullmatch(r"B:USR1@\d+", d["signal"]), "signal the batch shell, which forwards to srun"
        assert "requeue" in d


def test_gpu_recipes_ask_one_task_per_gpu():
    for name, nodes in (("dapo_qwen2.5_32b_fp8.sbatch", 16), ("dapo_qwen2.5_7b.sbatch", 4),
                        ("dapo_qwen3_32b_fp8.sbatch", 16)):
        d = directives(SLURM_DIR / name)
        assert d["ntasks-per-node"] == d["gpus-per-node"] == "8"
        assert int(d["nodes"]) == nodes
        assert "exclusive" in d and re.fullmatch(r"\d+:\d\d:\d\d|\d+-\d+:\d\d:\d\d", d["time"])


def test_launch_forwards_signal_and_requeues_on_75():
    text = (SLURM_DIR / "launch.sh").read_text()
    assert "trap 'forward USR1' USR1" in text and 'kill -s "$sig" "$srun_pid"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "scontrol show hostnames" in text
    env = (SLURM_DIR / "env.sh").read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in env and "DAPO_REQUEUE_EXIT_CODE:-75" in env


@pytest.mark.parametrize("name, preset", [("dapo_qwen2.5_32b_fp8.sbatch", "qwen2.5-32b"),
                                          ("dapo_qwen2.5_7b.sbatch", "qwen2.5-7b"),
                                          ("dapo_qwen3_32b_fp8.sbatch", "qwen3-32b")])
def test_gpu_recipe_layout_lives_in_its_config_and_fits_the_allocation(name, preset, capsys):
    from dapo_mcore.commands.plan import main as plan

    text = (SLURM_DIR / name).read_text()
    d = directives(SLURM_DIR / name)
    assert "parallel." not in text.split("set -euo pipefail")[1], "the layout is set in the config, not here"
    config = re.search(r"config=\$\{CONFIG:-([^}]+)\}", text).group(1)
    rc = plan([str(SLURM_DIR.parent / config), "model.hf_path=null", f"model.preset={preset}",
               "--nodes", d["nodes"], "--gpus-per-node", d["gpus-per-node"]])
    assert rc == 0, capsys.readouterr().out


@pytest.mark.parametrize("name, preset", [("dapo_qwen2.5_32b_fp8.sbatch", "qwen2.5-32b"),
                                          ("dapo_qwen2.5_7b.sbatch", "qwen2.5-7b"),
                                          ("dapo_qwen2.5_32b_fp8_async.sbatch", "qwen2.5-32b"),
                                          ("dapo_qwen3_32b_fp8.sbatch", "qwen3-32b"),
                                          ("dapo_qwen3_30b_a3b.sbatch", "qwen3-30b-a3b")])
def test_gpu_recipes_allow_the_requeues_the_planner_asks_for(name, preset, capsys):
    from dapo_mcore.commands.plan import main as plan

    text = (SLURM_DIR / name).read_text()
    d = directives(SLURM_DIR / name)
    config = re.search(r"config=\$\{CONFIG:-([^}]+)\}", text).group(1)
    hours, minutes, _ = (int(x) for x in d["time"].split(":"))
    lead = int(re.fullmatch(r"B:USR1@(\d+)", d["signal"]).group(1)) / 60
    capsys.readouterr()
    assert plan([str(SLURM_DIR.parent / config), "model.hf_path=null", f"model.preset={preset}", "--nodes", d["nodes"],
                 "--gpus-per-node", d["gpus-per-node"], "--time-limit-hours", str(hours + minutes / 60),
                 "--signal-minutes", str(lead)]) == 0
    asked = re.search(r"submit with DAPO_MAX_REQUEUES=(\d+)", capsys.readouterr().out).group(1)
    assert f"export DAPO_MAX_REQUEUES=${{DAPO_MAX_REQUEUES:-{asked}}}" in text
