"""docs/data.md's example rows load as the page says: the message list as written, the raw problem in DAPO's
wording, ground truths as strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_mcore.data.datasets import load_prompt_dataset
from dapo_mcore.data.prompts import DAPO_INSTRUCTION, DAPO_REMINDER

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def test_the_pages_example_rows_load_as_it_says(tmp_path):
    text = DOC.read_text()
    block = text.split("```json\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "rows.jsonl"
    path.write_text(block)
    records = load_prompt_dataset(str(path)).records
    assert [r.ground_truth for r in records] == ["204", "55"]
    assert records[0].prompt.startswith("Solve the following math problem step by step.")  # as written
    raw = "What is the sum of the first 10 positive integers?"
    assert records[1].prompt == f"{DAPO_INSTRUCTION}\n\n{raw}\n\n{DAPO_REMINDER}"
    assert DAPO_INSTRUCTION.split("where")[0].strip() in " ".join(text.split())  # the page quotes the wording
