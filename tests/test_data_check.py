"""``dapo-mcore data check FILE``: a prompt file's layout (columns, DAPO wording, duplicates, rejected rows) before a
job is submitted; exit 0 usable as is, 1 usable with problems, 2 (one line) not a prompt file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mcore import cli
from dapo_mcore.data.prompts import dapo_math_prompt

pytestmark = pytest.mark.unit


def _dapo_rows(problems: list[tuple[str, object]], copies: int) -> list[dict]:
    """Rows in the released DAPO-Math-17k layout, each prompt repeated ``copies`` times as in the public file."""
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": dapo_math_prompt(p)}],
             "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": str(i)}} for i, (p, a) in enumerate(problems) for _ in range(copies)]


def test_a_dapo_layout_file_is_ok_with_its_dedup_count(tmp_path, capsys):
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(_dapo_rows([("1+1?", "2"), ("2+2?", "4"), ("3+3?", "6")], copies=4)), path)
    assert cli.main(["data", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: 12 rows, columns: data_source, prompt, ability, reward_model, extra_info" in out
    assert "prompts: 3 kept, 9 duplicate rows dropped, 0 rows rejected" in out
    assert "DAPO wording (instruction + 'Answer:' reminder): 3 of 3 prompts" in out and out.rstrip().endswith("ok")


def test_rejected_rows_and_other_wording_are_reported_with_exit_1(tmp_path, capsys):
    path = tmp_path / "mixed.parquet"
    rows = _dapo_rows([("1+1?", "2"), ("2+2?", "")], copies=1)
    rows.append(dict(rows[0], prompt=[{"role": "user", "content": "What is 5+5? Put it in \\boxed{}."}]))
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert cli.main(["data", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "prompts: 2 kept, 0 duplicate rows dropped, 1 rows rejected" in out
    assert "row 1 rejected: reward_model.ground_truth is empty" in out
    assert "1 of 2 prompts (the others are used as written" in out


def test_a_file_that_is_not_a_prompt_file_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), path)
    assert cli.main(["data", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no 'prompt' column" in err and "question" in err
