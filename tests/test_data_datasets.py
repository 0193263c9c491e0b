"""Prompt files: parquet/jsonl loading, dedupe, rejected rows, bad paths; prompts; DataConfig."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mcore.data.config import DataConfig
from dapo_mcore.data.datasets import DatasetFormatError, load_prompt_dataset
from dapo_mcore.data.prompts import DAPO_INSTRUCTION, DAPO_REMINDER, dapo_math_prompt, encode_prompts
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.data.sources import filter_by_length, load_prompt_records, prompt_encoder
from dapo_mcore.data.tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.unit


def _dapo_row(content, truth, style="rule-lighteval/MATH_v2"):
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": content}], "ability": "MATH",
            "reward_model": {"ground_truth": truth, "style": style}, "extra_info": {"index": "x", "split": "default"}}


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_dedupes_and_counts(tmp_path):
    rows = [_dapo_row("p1", "540"), _dapo_row("p2", "7"), _dapo_row("p1", "540"), _dapo_row("p1", "540"),
            _dapo_row("p3", "1")]
    ds = load_prompt_dataset(_write_parquet(tmp_path / "d.parquet", rows))
    assert [r.prompt for r in ds.records] == ["p1", "p2", "p3"]
    assert [r.ground_truth for r in ds.records] == ["540", "7", "1"]
    assert ds.report.n_rows == 5 and ds.report.n_duplicates == 2 and ds.report.rejected == []
    assert ds.records[0].data_source == "math_dapo" and [r.index for r in ds.records] == [0, 1, 2]


def test_parquet_rejects_bad_ground_truth_with_index_and_reason(tmp_path):
    rows = [_dapo_row("p1", "5"), _dapo_row("p2", None), _dapo_row("p3", ""), _dapo_row("p4", "9")]
    ds = load_prompt_dataset(_write_parquet(tmp_path / "d.parquet", rows))
    assert [r.prompt for r in ds.records] == ["p1", "p4"]
    assert [i for i, _ in ds.report.rejected] == [1, 2]
    assert "missing" in ds.report.rejected[0][1] and "empty" in ds.report.rejected[1][1]


def test_jsonl_both_layouts_dedupe_and_rejects(tmp_path):
    lines = [_dapo_row("p1", "3"), {"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 1+1?", "answer": "2"},
             {"prompt": "q", "answer": [5]}, {"prompt": "r"}, {"prompt": 7, "answer": "1"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = load_prompt_dataset(path)
    assert [r.prompt for r in ds.records] == ["p1", dapo_math_prompt("What is 1+1?")]
    assert ds.report.n_duplicates == 1 and ds.report.n_rows == 6
    assert {i for i, _ in ds.report.rejected} == {3, 4, 5}
    reasons = dict(ds.report.rejected)
    assert "list" in reasons[3] and "no ground truth" in reasons[4] and "prompt" in reasons[5]
    raw = load_prompt_dataset(path, wrap_raw=False)
    assert raw.records[1].prompt == "What is 1+1?"


def test_verl_system_turn_dedups_on_the_whole_conversation(tmp_path):
    """verl's [system, user] prompts share the system turn: 3 distinct problems are 3 records, not 1 + 2 duplicates."""
    def row(user, truth, system="Think step by step."):
        return {**_dapo_row(user, truth), "prompt": [{"role": "system", "content": system},
                                                     {"role": "user", "content": user}]}

    rows = [row("p1", "1"), row("p2", "2"), row("p1", "1"), row("p3", "3"), row("p1", "1", system="Be brief.")]
    for path in (_write_parquet(tmp_path / "d.parquet", rows), tmp_path / "d.jsonl"):
        if path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ds = load_prompt_dataset(path)
        assert [(r.system, r.prompt) for r in ds.records] == [
            ("Think step by step.", "p1"), ("Think step by step.", "p2"), ("Think step by step.", "p3"),
            ("Be brief.", "p1")]
        assert ds.report.n_duplicates == 1 and ds.report.rejected == []
    from dapo_mcore.data.prompts import render_prompt_ids
    from dapo_mcore.errors import UserError

    tok = build_tiny_tokenizer()
    with pytest.raises(UserError, match="chat template cannot render a system turn and a user turn"):
        render_prompt_ids(tok, "p1", "Think step by step.")  # the tiny template has no system role
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    encode = prompt_encoder(tok, DataConfig(max_prompt_len=64))

    rec = ds.records[0]
    assert encode(rec) == render_prompt_ids(tok, "p1", "Think step by step.") != render_prompt_ids(tok, "p1")


def test_numeric_ground_truth_is_taken_as_its_string(tmp_path):
    rows = [_dapo_row("p1", 42), _dapo_row("p2", 7)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = load_prompt_dataset(tmp_path / "d.parquet")
    assert [r.ground_truth for r in ds.records] == ["42", "7"] and ds.report.n_numeric_truths == 2
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [
        {"prompt": "a", "answer": 2.5}, {"prompt": "b", "answer": "3"}, {"prompt": "c", "answer": float("nan")}]))
    ds = load_prompt_dataset(path)
    assert [r.ground_truth for r in ds.records] == ["2.5", "3"] and ds.report.n_numeric_truths == 1
    assert "not a finite number" in ds.report.rejected[0][1]


def test_files_people_have_give_one_line_errors(tmp_path):
    """Unreadable datasets: a non-UTF-8 jsonl, a parquet whose prompt is an empty list or a struct without content, a
    directory: DatasetFormatError (one line, exit 2 through the CLI), never UnicodeDecodeError/ArrowInvalid."""
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"prompt": "ok", "answer": "1"}).encode() + b"\n" +
                    '{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(DatasetFormatError, match="line 2 is not UTF-8"):
        load_prompt_dataset(bad)
    empty = _write_parquet(tmp_path / "empty.parquet", [{**_dapo_row("p", "1"), "prompt": []}])
    with pytest.raises(DatasetFormatError, match=r"no usable rows \(1 rejected\)"):
        load_prompt_dataset(empty)
    no_content = _write_parquet(tmp_path / "nc.parquet", [{**_dapo_row("p", "1"), "prompt": [{"role": "user"}]},
                                                           {**_dapo_row("p", "1"), "prompt": [{"role": "user"}]}])
    with pytest.raises(DatasetFormatError, match="no usable rows"):
        load_prompt_dataset(no_content)
    mixed = _write_parquet(tmp_path / "m.parquet", [{**_dapo_row("p", "1"), "prompt": []}, _dapo_row("q", "2")])
    assert [r.prompt for r in load_prompt_dataset(mixed).records] == ["q"]
    with pytest.raises(DatasetFormatError, match="a directory, not a file"):
        load_prompt_dataset(tmp_path)
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(ValueError, match="is a directory; give the .parquet/.jsonl file inside it"):
        DataConfig(train=str(tmp_path / "dir.parquet")).validate()


def test_dapo_math_prompt_wording():
    text = dapo_math_prompt("Find x.")
    assert text == f"{DAPO_INSTRUCTION}\n\nFind x.\n\n{DAPO_REMINDER}"
    assert text.startswith("Solve the following math problem step by step. The last line of your response")
    assert text.endswith('Remember to put your answer on its own line after "Answer:".')


@pytest.mark.parametrize("name,content,match", [
    ("missing.jsonl", None, "no such file"),
    ("d.csv", "a,b\n1,2\n", "unsupported suffix"),
    ("d.jsonl", "a,b\n1,2\n", "line 1 is not JSON"),
    ("d.jsonl", "[1, 2]\n", "not an object"),
    ("d.parquet", "not parquet at all", "not a readable parquet"),
    ("e.jsonl", "\n", "no rows"),
])
def test_bad_files_raise_one_clear_error(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetFormatError, match=match) as info:
        load_prompt_dataset(path)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value) and "expected" in str(info.value)


def test_parquet_without_prompt_column(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", [{"question": "q", "answer": "1"}])
    with pytest.raises(DatasetFormatError, match="no 'prompt' column"):
        load_prompt_dataset(path)


def test_all_rows_rejected_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": True}) + "\n")
    with pytest.raises(DatasetFormatError, match="no usable rows"):
        load_prompt_dataset(path)


def test_encode_prompts_drop_and_left_truncate():
    tok = build_tiny_tokenizer()
    recs = [PromptRecord("1+2", "3", "t", 0), PromptRecord("1+2+3+4+5", "15", "t", 1)]
    kept, dropped = encode_prompts(recs, tok, max_prompt_len=8, truncation="drop")
    assert [p.record.index for p in kept] == [0] and dropped[0][0] == 1 and "12 tokens" in dropped[0][1]
    kept, dropped = encode_prompts(recs, tok, max_prompt_len=8, truncation="left")
    assert dropped == [] and kept[1].truncated and len(kept[1].input_ids) == 8
    assert tok.decode(kept[1].input_ids) == "2+3+4+5<assistant>"
    with pytest.raises(ValueError, match="truncation"):
        encode_prompts(recs, tok, 8, truncation="right")


def test_data_config_validate_and_sources(tmp_path):
    cfg = DataConfig()
    cfg.validate()
    train, held = load_prompt_records(cfg, "train"), load_prompt_records(cfg, "eval")
    assert len(train) == 4032 and len(held) == 1008
    with pytest.raises(ValueError, match="registered tasks: .*task:max4"):
        DataConfig(train="task:nope").validate()
    with pytest.raises(ValueError, match="no such file"):
        DataConfig(eval=str(tmp_path / "x.parquet")).validate()
    with pytest.raises(ValueError, match="truncation"):
        DataConfig(truncation="right").validate()
    path = _write_parquet(tmp_path / "aime.parquet", [_dapo_row("p1", "5")] * 3)
    cfg = DataConfig(eval=str(path))
    cfg.validate()
    assert [r.ground_truth for r in load_prompt_records(cfg, "eval")] == ["5"]
    assert load_prompt_records(DataConfig(eval=""), "eval") == []


def test_filter_by_length_and_prompt_encoder():
    tok = build_tiny_tokenizer()
    recs = [PromptRecord("1+2", "3", "t", 0), PromptRecord("1+2+3+4+5", "15", "t", 1)]
    kept, dropped = filter_by_length(recs, tok, DataConfig(max_prompt_len=8))
    assert kept == recs[:1] and [i for i, _ in dropped] == [1]
    enc = prompt_encoder(tok, DataConfig(max_prompt_len=8))
    assert tok.decode(enc(recs[0])) == "<bos><user>1+2<assistant>"
    with pytest.raises(ValueError, match="truncation=left"):
        enc(recs[1])
    left = prompt_encoder(tok, DataConfig(max_prompt_len=8, truncation="left"))
    assert len(left(recs[1])) == 8
