"""``dapo-mcore data check FILE ...``: does a prompt file have the layout training expects, before a job is queued?

It loads the file exactly as training does (``data.datasets.load_prompt_dataset``: deduplication, ground-truth
checks) and prints, per file, the columns, the rows, the prompts kept after deduplication, the rejected rows with
their reasons, and how many prompts are in the DAPO-Math wording (the "Answer: $Answer" instruction the math
verifier reads). Exit 0: usable as is; 1: usable but with rejected rows or prompts not in DAPO wording; 2 (one line,
through the CLI): not a prompt file at all (missing, unreadable, no 'prompt' column).

The public files: DAPO-Math-17k (Hugging Face BytedTsinghua-SIA/DAPO-Math-17k, about 1.79M rows holding ~17k distinct
prompts) and AIME 2024 (BytedTsinghua-SIA/AIME-2024, each problem repeated 32 times); docs/cluster.md "Data".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dapo_mcore.data.prompts import DAPO_INSTRUCTION, DAPO_REMINDER


def _columns(path: Path) -> list[str]:
    if path.suffix != ".parquet":
        return []
    import pyarrow.parquet as pq

    return list(pq.read_schema(path).names)


def check_file(path: Path) -> tuple[list[str], bool]:
    """The report lines of one file and whether it is usable as is."""
    from dapo_mcore.data.datasets import load_prompt_dataset

    data = load_prompt_dataset(path)  # DatasetFormatError: not a prompt file (the CLI's one line, exit 2)
    report, records = data.report, data.records
    wording = sum(1 for r in records if r.prompt.startswith(DAPO_INSTRUCTION) and r.prompt.endswith(DAPO_REMINDER))
    columns = _columns(path)
    lines = [f"{path}: {report.n_rows:,} rows" + (f", columns: {', '.join(columns)}" if columns else ""),
             f"  prompts: {len(records):,} kept, {report.n_duplicates:,} duplicate rows dropped, "
             f"{len(report.rejected):,} rows rejected",
             f"  DAPO wording (instruction + 'Answer:' reminder): {wording:,} of {len(records):,} prompts"
             + ("" if wording == len(records) else " (the others are used as written: the math verifier reads the "
                "last 'Answer:' line, so a prompt that does not ask for one scores badly)"),
             f"  system turns: {sum(r.system is not None for r in records):,}; ground truths given as numbers: "
             f"{report.n_numeric_truths:,}"]
    lines += [f"  row {index} rejected: {reason}" for index, reason in report.rejected[:5]]
    if len(report.rejected) > 5:
        lines.append(f"  ... and {len(report.rejected) - 5:,} more rejected rows")
    ok = not report.rejected and wording == len(records)
    lines.append("  ok" if ok else "  usable, with the problems above")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dapo-mcore data", description="Check prompt files before training.")
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="the layout of .parquet/.jsonl prompt files (columns, prompt format, "
                                         "duplicates, rejected rows)")
    check.add_argument("files", type=Path, nargs="+", help="e.g. /data/dapo/dapo-math-17k.parquet")
    args = parser.parse_args(argv)
    all_ok = True
    for path in args.files:
        lines, ok = check_file(path)
        sys.stdout.write("\n".join(lines) + "\n")
        all_ok &= ok
    return 0 if all_ok else 1
