"""docs/cluster.md's script table names every job script in slurm/, so a user reading the guide finds each one."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_cluster_guide_lists_every_sbatch_script():
    table = [line for line in (ROOT / "docs/cluster.md").read_text().splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1] for line in table}
    scripts = {p.name for p in (ROOT / "slurm").glob("*.sbatch")}
    assert scripts, "no slurm/*.sbatch found"
    assert not scripts - listed, f"docs/cluster.md's script table misses {sorted(scripts - listed)}"
