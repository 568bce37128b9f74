"""JSONL / Parquet prompt datasets: field mapping, chat prompts, and malformed rows → file:line."""

import json

import pytest

from jaxrl_fp8.data.readers import DatasetFields, read_prompt_dataset
from jaxrl_fp8.data.records import DatasetError


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_string_and_chat_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", [
        json.dumps({"prompt": "What is 1+1?", "label": "2"}),
        "",  # blank lines are not rows
        json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2+2?"}], "label": 4}),
        json.dumps({"prompt": "Half?", "label": 0.5}),
    ])
    records, report = read_prompt_dataset(path)
    assert [r.answer for r in records] == ["2", "4", "0.5"]
    assert records[0].prompt == "What is 1+1?" and not records[0].is_chat
    assert records[1].is_chat and records[1].prompt[1] == {"role": "user", "content": "What is 2+2?"}
    assert [r.source for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert [r.uid for r in records] == [0, 1, 2]
    assert (report.num_rows, report.num_records, report.num_skipped) == (3, 3, 0)


def test_nested_field_names_and_metadata(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(
        {"question": "q?", "reward_model": {"ground_truth": "7"}, "level": 3})])
    fields = DatasetFields(prompt="question", answer="reward_model.ground_truth", metadata=("level",))
    (record,), _ = read_prompt_dataset(path, fields)
    assert (record.prompt, record.answer, record.metadata) == ("q?", "7", {"level": 3})


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "x", "label": "1"', "invalid JSON"),
    ('["not", "an", "object"]', "row must be an object"),
    ('{"label": "1"}', "missing prompt field 'prompt'"),
    ('{"prompt": "x"}', "missing answer field 'label'"),
    ('{"prompt": "", "label": "1"}', "empty string"),
    ('{"prompt": 5, "label": "1"}', "non-empty string or a non-empty list"),
    ('{"prompt": [{"role": "user"}], "label": "1"}', "string 'role' and 'content'"),
    ('{"prompt": [{"role": "robot", "content": "x"}], "label": "1"}', "role 'robot'"),
    ('{"prompt": "x", "label": [1]}', "string or a number"),
    ('{"prompt": "x", "label": true}', "string or a number"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "ok", "label": "1"})
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_line, good])
    with pytest.raises(DatasetError) as e:
        read_prompt_dataset(path)
    assert str(e.value).startswith(f"{path}:3: ")
    assert message in str(e.value)


def test_skip_malformed_counts(tmp_path):
    good = json.dumps({"prompt": "ok", "label": "1"})
    path = _write_jsonl(tmp_path / "mixed.jsonl", [good, "{oops", good, '{"prompt": "x"}'])
    records, report = read_prompt_dataset(path, skip_malformed=True)
    assert len(records) == 2 and [r.uid for r in records] == [0, 1]
    assert (report.num_rows, report.num_skipped) == (4, 2)
    assert report.errors[0].startswith(f"{path}:2: ") and report.errors[1].startswith(f"{path}:4: ")


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        read_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        read_prompt_dataset(tmp_path / "d.csv")
    path = _write_jsonl(tmp_path / "allbad.jsonl", ["{", "{"])
    with pytest.raises(DatasetError, match="no valid records"):
        read_prompt_dataset(path, skip_malformed=True)


def test_max_records(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": f"p{i}", "label": str(i)}) for i in range(10)])
    records, _ = read_prompt_dataset(path, max_records=4)
    assert [r.answer for r in records] == ["0", "1", "2", "3"]


def test_parquet_rows_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet reading needs pyarrow (not yet in the .venv)")
    import pyarrow.parquet as pq

    table = pa.table({
        "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}],
                   [{"role": "user", "content": "3+3?"}]],
        "label": ["2", "4", None],
    })
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=f"{path}:3: field 'label' must be a string or a number"):
        read_prompt_dataset(path)
    records, report = read_prompt_dataset(path, skip_malformed=True)
    assert [r.answer for r in records] == ["2", "4"] and records[1].prompt[0]["content"] == "2+2?"
    assert records[0].source == f"{path}:1" and report.num_skipped == 1
