"""The user guides describe the product: docs/cluster.md's script table names every job script in slurm/,
benchmarks/README.md's tables every benchmark script with the headline it really prints, and no guide (README.md,
docs/*.md but the history file, benchmarks/README.md) cites a development machine's paths or the issue and round
numbers of the project's making."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "history.md"),
          ROOT / "benchmarks" / "README.md"]
MAKING = re.compile(r"\bissues? #?\d+|#\d{2}\b|\bround \d+|/work/|shared/notes|\.\./shared/", re.IGNORECASE)


@pytest.mark.unit
def test_cluster_guide_lists_every_sbatch_script():
    table = [line for line in (ROOT / "docs/cluster.md").read_text().splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1] for line in table}
    scripts = {p.name for p in (ROOT / "slurm").glob("*.sbatch")}
    assert scripts, "no slurm/*.sbatch found"
    assert not scripts - listed, f"docs/cluster.md's script table misses {sorted(scripts - listed)}"


@pytest.mark.unit
def test_benchmarks_readme_lists_every_script_with_the_headline_it_prints():
    rows = [line.split("|") for line in (ROOT / "benchmarks/README.md").read_text().splitlines()
            if line.startswith("| `")]
    listed: dict[str, str] = {}
    for row in rows:  # the first table's row (its 4th column is the headline); the smoke tables list them again
        listed.setdefault(row[1].strip().strip("`"), row[4])
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert scripts and set(listed) == scripts, (sorted(scripts - set(listed)), sorted(set(listed) - scripts))
    for script, headline in listed.items():
        text = (ROOT / "benchmarks" / script).read_text()
        for name in re.findall(r"`([a-z][a-z0-9_]+)(?:`|:)", headline):
            assert f"{name}: " in text, f"benchmarks/README.md: {script} prints no '{name}: ...' line"


@pytest.mark.unit
def test_guides_cite_no_development_paths_or_issue_numbers():
    found = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}"
             for path in GUIDES for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in MAKING.finditer(line)]
    assert not found, "history belongs in docs/history.md:\n" + "\n".join(found)
