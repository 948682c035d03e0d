"""The bench's inputs: prompts files (JSONL), the concurrency list, the requests of a level."""

import json

import pytest

from specmesh.data.prompts import (
    level_requests,
    load_prompts_file,
    parse_concurrency,
    parse_prompts_jsonl,
)

GOOD = "\n".join([
    json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}], "name": "greet",
                "category": "chat"}),
    "",
    "# a comment",
    json.dumps({"prompt": "Count to five."}),
])


def test_parse_good_lines():
    prompts = parse_prompts_jsonl(GOOD, "p.jsonl")
    assert prompts[0] == {"name": "greet", "category": "chat",
                          "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}]}
    assert prompts[1] == {"name": "prompt-2", "category": "user",
                          "messages": [{"role": "user", "content": "Count to five."}]}


@pytest.mark.parametrize("line,why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"name": "x"}', 'needs "messages"'),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
    ('{"messages": [{"role": "user", "content": 3}]}', "content"),
])
def test_bad_line_names_file_and_line(line, why):
    with pytest.raises(SystemExit) as e:
        parse_prompts_jsonl(GOOD + "\n" + line, "p.jsonl")
    assert "p.jsonl, line 5" in str(e.value) and why in str(e.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(SystemExit, match="no prompts"):
        parse_prompts_jsonl("\n# only a comment\n", "e.jsonl")
    with pytest.raises(SystemExit, match="cannot read"):
        load_prompts_file(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "ok.jsonl"
    path.write_text(GOOD)
    assert [p["name"] for p in load_prompts_file(str(path))] == ["greet", "prompt-2"]


def test_parse_concurrency():
    assert parse_concurrency("1,4,16") == [1, 4, 16]
    assert parse_concurrency(" 2, 2 ,1") == [2, 1]
    for bad in ("", "1,x", "0", "1,-2"):
        with pytest.raises(SystemExit, match="--concurrency"):
            parse_concurrency(bad)


def test_level_requests_fill_every_client():
    ps = [{"name": "a"}, {"name": "b"}]
    assert [p["name"] for p in level_requests(ps, 1)] == ["a", "b"]
    assert [p["name"] for p in level_requests(ps, 5)] == ["a", "b", "a", "b", "a"]
