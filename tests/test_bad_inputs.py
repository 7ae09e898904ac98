"""One line per mistake (issue 17): a table of bad inputs across every command.

Each case runs the CLI in-process and asserts: exit code not 0, exactly one line on stderr, the
words that name the problem and the fix, and every file that existed before (the shared trace
dataset, run, bundle, zoo and model, and the case's own bad input) byte-identical afterwards. New
files may only be lock files. All cases share one small world built once per module.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
import torch

from collect_helpers import make_tiny_dir
from dwise_predict.cli import main
from evaluate_helpers import fixed_config, make_traces, write

CREATED = "2026-01-01T00:00:00+00:00"

PROGRESS_LINE = re.compile(r"(collect|train|evaluate|simulate): ")  # cli/progress.py's lines


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.exports.zoo import publish
    from dwise_predict.training import train_run

    root = tmp_path_factory.mktemp("world")
    traces = write(make_traces(n_requests=160), root / "d" / "traces")
    run = root / "run"
    train_run(traces, run, fixed_config())
    bundle = export_bundle(run, root / "bundle", name="tiny", created=CREATED)
    zoo = root / "zoo"
    publish(bundle, zoo, verify=False)
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's folder")
    return {"root": root, "d": root / "d", "traces": traces, "run": run, "bundle": bundle, "zoo": zoo,
            "model": make_tiny_dir(root / "model"), "foreign": foreign}


# --- setups: each builds the case's bad input under tmp and returns extra placeholders ------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def traces_with(edit: Callable[[pd.DataFrame], pd.DataFrame]):
    """A copy of the traces whose request table is rewritten by ``edit`` (bypassing validation)."""
    def setup(w, tmp):
        bad = _copy(w["traces"], tmp / "bad")
        table = pd.read_parquet(bad / "requests.parquet")
        edit(table).to_parquet(bad / "requests.parquet", index=False)
        return {"bad": bad}
    return setup


def set_column(name, value, row=0):
    def edit(table):
        table[name] = table[name].astype(object if value is None or isinstance(value, str) else float)
        table.at[row, name] = value
        return table
    return edit


def file_in_copy(key: str, name: str, content: bytes | str):
    """A copy of world[key] with ``name`` replaced by ``content`` (bytes, or text)."""
    def setup(w, tmp):
        bad = _copy(w[key], tmp / "bad")
        data = content.encode() if isinstance(content, str) else content
        (bad / name).write_bytes(data)
        return {"bad": bad}
    return setup


def json_in_copy(key: str, name: str, edit: Callable[[dict], object]):
    def setup(w, tmp):
        bad = _copy(w[key], tmp / "bad")
        (bad / name).write_text(json.dumps(edit(json.loads((bad / name).read_text()))))
        return {"bad": bad}
    return setup


def removed_in_copy(key: str, name: str):
    def setup(w, tmp):
        bad = _copy(w[key], tmp / "bad")
        (bad / name).unlink()
        return {"bad": bad}
    return setup


def spec(text: str):
    def setup(w, tmp):
        path = tmp / "spec.toml"
        path.write_text(text)
        return {"spec": path}
    return setup


def text_file(name: str, content: bytes | str):
    def setup(w, tmp):
        path = tmp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return {"file": path}
    return setup


def nested_traces(w, tmp):
    traces = _copy(w["traces"], tmp / "d" / "traces")
    return {"nested": traces}


def dangling_link(w, tmp):
    (tmp / "link").symlink_to(tmp / "nowhere")
    return {"link": tmp / "link"}


def a_file(w, tmp):
    (tmp / "file").write_text("x")
    return {"file": tmp / "file"}


def a_fifo(w, tmp):
    os.mkfifo(tmp / "fifo")
    return {"fifo": tmp / "fifo"}


def incomplete_collection(w, tmp):
    bad = _copy(w["traces"], tmp / "bad")
    (bad / "shards").mkdir()
    (bad / "requests.parquet").unlink()
    return {"bad": bad}


def incomplete_collection_with_manifest(text: str):
    """An interrupted collection (one committed shard, not consolidated) whose manifest is damaged."""
    def setup(w, tmp):
        from dwise_predict.collectors.store import TraceStore
        from dwise_predict.traces import load_traces

        ds = load_traces(w["traces"])
        bad = tmp / "bad"
        with TraceStore(bad, ds.manifest) as store:
            store.write_shard(ds.requests.assign(workload_index=range(len(ds))), ds.first_round, ds.prompt_last)
        (bad / "manifest.json").write_text(text)
        return {"bad": bad}
    return setup


def zero_rows(w, tmp):
    from safetensors.numpy import save_file
    import numpy as np

    bad = _copy(w["traces"], tmp / "bad")
    pd.read_parquet(bad / "requests.parquet").iloc[:0].to_parquet(bad / "requests.parquet", index=False)
    save_file({"first_round": np.zeros((0, 16), np.float32), "prompt_last": np.zeros((0, 16), np.float32)},
              str(bad / "hidden.safetensors"))
    return {"bad": bad}


def resealed_bundle(edit: Callable[[dict], None]):
    def setup(w, tmp):
        from dwise_predict.bundles.manifest import seal_manifest

        bad = _copy(w["bundle"], tmp / "bad")
        manifest = json.loads((bad / "bundle.json").read_text())
        edit(manifest)
        (bad / "bundle.json").write_bytes(seal_manifest(manifest))
        return {"bad": bad}
    return setup


def bundle_with_extra_file(w, tmp):
    bad = _copy(w["bundle"], tmp / "bad")
    (bad / "extra.onnx").write_bytes(b"planted")
    return {"bad": bad}


def zoo_index(content: str):
    def setup(w, tmp):
        zoo = tmp / "zoo"
        zoo.mkdir()
        (zoo / "index.json").write_text(content)
        return {"badzoo": zoo}
    return setup


def hub_cache(w, tmp):
    """A huggingface_hub cache holding the world's bundle as hf://my-org/tiny at main (tests/hub_helpers)."""
    from hub_helpers import cache_commit

    cache_commit(tmp / "hf", "my-org/tiny", "a" * 40, {p.name: p.read_bytes() for p in w["bundle"].iterdir()},
                 refs=["main"])
    return {"hfcache": tmp / "hf"}


def algorithm_file(content: str):
    """An algorithm config file, as a server's ``--dllm-algorithm-config`` YAML."""
    def setup(w, tmp):
        (tmp / "algorithm.yaml").write_text(content)
        return {"alg": tmp / "algorithm.yaml"}
    return setup


def model_with(name: str | None, content: bytes | None, config_edit: Callable[[dict], object] | None = None,
               drop: str | None = None):
    """A copy of the tiny model directory with one file replaced, its config edited or a file dropped."""
    def setup(w, tmp):
        bad = _copy(w["model"], tmp / "m")
        if drop:
            (bad / drop).unlink()
        if name:
            (bad / name).write_bytes(content)
        if config_edit:
            (bad / "config.json").write_text(json.dumps(config_edit(json.loads((bad / "config.json").read_text()))))
        return {"m": bad}
    return setup


class _Planted:
    """Unpickling this would create a marker file: a pickle payload that must never run."""

    marker = "/tmp/dwise-pickle-ran"

    def __reduce__(self):
        return (open, (self.marker, "w"))


def truncated_weights(w, tmp):
    bad = _copy(w["model"], tmp / "m")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {"m": bad}


def wider_config(config):
    return {**config, "hidden_size": config["hidden_size"] * 2}


# --- setups of the second adversarial pass (issue 43) ---------------------------------------------

DEEP_JSON = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"  # Python's json recurses per level


def folder_of_yours(*ours: str):
    """A folder of the user's that holds one of a command's own file names beside their own file."""
    def setup(w, tmp):
        mine = tmp / "mine"
        mine.mkdir()
        for name in ours:
            (mine / name).write_text("{}")
        (mine / "notes.txt").write_text("mine")
        return {"mine": mine}
    return setup


def link_to(key: str):
    def setup(w, tmp):
        (tmp / "link").symlink_to(w[key], target_is_directory=True)
        return {"link": tmp / "link"}
    return setup


def _collection(path: Path, ds, manifest: dict | None = None) -> Path:
    """A collection directory with two committed shards of ``ds`` (not consolidated)."""
    from dwise_predict.collectors.store import TraceStore

    half = len(ds) // 2
    with TraceStore(path, manifest or ds.manifest) as store:
        for rows in (slice(0, half), slice(half, len(ds))):
            store.write_shard(ds.requests.iloc[rows].assign(workload_index=range(rows.start, rows.stop)),
                              ds.first_round[rows], ds.prompt_last[rows])
    return path


def flipped_shard(suffix: str):
    """A collection whose first shard's ``suffix`` file has one bit flipped in the middle, after commit."""
    def setup(w, tmp):
        from dwise_predict.traces import load_traces

        bad = _collection(tmp / "bad", load_traces(w["traces"]))
        path = bad / "shards" / f"shard-000000{suffix}"
        data = bytearray(path.read_bytes())
        data[len(data) * 3 // 4] ^= 0x10  # safetensors: inside the tensor data; Parquet: inside a data page
        path.write_bytes(bytes(data))
        return {"bad": bad}
    return setup


def two_hidden_sizes(together: bool):
    """Collections of one manifest whose shards hold rows of hidden size 16 and 24: in two directories
    (``traces merge A B``) or ``together`` in one (its consolidation)."""
    def setup(w, tmp):
        from dwise_predict.traces import load_traces
        from dwise_predict.traces.synthetic import make_synthetic_traces

        ds = load_traces(w["traces"])
        other = make_synthetic_traces(40, 24, seed=7)
        other.requests["request_id"] = other.requests["request_id"] + "-wide"
        if together:
            from dwise_predict.collectors.store import TraceStore

            with TraceStore(tmp / "a", ds.manifest) as store:
                store.write_shard(ds.requests.assign(workload_index=range(len(ds))), ds.first_round, ds.prompt_last)
                store.write_shard(other.requests.assign(workload_index=range(len(ds), len(ds) + 40)),
                                  other.first_round, other.prompt_last)
            return {"a": tmp / "a", "b": tmp / "a"}
        return {"a": _collection(tmp / "a", ds), "b": _collection(tmp / "b", other, ds.manifest)}
    return setup


def small_traces(n: int):
    def setup(w, tmp):
        return {"small": write(make_traces(n_requests=n), tmp / "small")}
    return setup


def jsonl_workload(line: str):
    def setup(w, tmp):
        (tmp / "d.jsonl").write_text('{"prompt": "fine"}\n' + line + "\n")
        (tmp / "spec.toml").write_text('[[sources]]\ntype = "jsonl"\npath = "d.jsonl"\ncategory = "chat"\n')
        return {"spec": tmp / "spec.toml"}
    return setup


def hidden_with(edit: Callable[[dict], None]):
    """A copy of the traces whose hidden tensors are rewritten by ``edit`` (bypassing validation)."""
    def setup(w, tmp):
        from safetensors.numpy import load_file, save_file

        bad = _copy(w["traces"], tmp / "bad")
        tensors = load_file(str(bad / "hidden.safetensors"))
        edit(tensors)
        save_file(tensors, str(bad / "hidden.safetensors"))
        return {"bad": bad}
    return setup


def manifest_with(edit: Callable[[dict], None]):
    def change(manifest):
        edit(manifest)
        return manifest
    return json_in_copy("traces", "manifest.json", change)


def many_blocks(table):
    table["rounds_per_block"] = table["rounds_per_block"].astype(object)
    table.at[0, "rounds_per_block"] = [1] * 1000
    table.at[0, "total_rounds"] = 1000
    return table


# --- the table ---------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    argv: list[str]
    words: tuple[str, ...]  # lower-case substrings of the one stderr line: the problem and the fix
    setup: Callable | None = None
    code: int = 1
    env: dict = field(default_factory=dict)


HELP = "--help`"
Q = "--limit 2 --out {tmp}/o"
CASES = [
    # command-line usage: typer's errors, one line naming the command's --help
    Case("usage-limit-not-int", ["collect", "--limit", "abc", "--out", "{tmp}/o"], ("'--limit'", "integer", HELP), code=2),
    Case("usage-unknown-option", ["collect", "--bogus"], ("no such option: --bogus", "dwise-predict collect --help"), code=2),
    Case("usage-train-no-args", ["train"], ("missing argument", "dwise-predict train --help"), code=2),
    Case("usage-unknown-command", ["nosuch"], ("no such command 'nosuch'", "dwise-predict --help"), code=2),
    Case("usage-dtype-choice", ["collect", "--dtype", "int8", "--out", "{tmp}/o"], ("'--dtype'", "int8", HELP), code=2),
    Case("usage-evaluate-no-out", ["evaluate", "{traces}"], ("missing option '--out'", HELP), code=2),
    Case("usage-export-no-out", ["export", "{run}"], ("missing option '--out'", HELP), code=2),
    Case("usage-slots-not-int", ["simulate", "{traces}", "--slots", "many"], ("'--slots'", HELP), code=2),
    Case("usage-zoo-pull-no-ref", ["zoo", "pull", "--zoo", "{zoo}"], ("missing argument", "zoo pull --help"), code=2),
    Case("usage-traces-show-no-path", ["traces", "show"], ("missing argument", "traces show --help"), code=2),
    Case("usage-train-tiny-steps", ["dllm", "train-tiny", "--out", "{tmp}/m", "--steps", "abc"], ("'--steps'", "dllm train-tiny --help"), code=2),
    Case("usage-publish-no-zoo", ["publish", "{bundle}"], ("missing option '--zoo'", HELP), code=2),
    Case("usage-epochs-float", ["train", "{traces}", "--out", "{tmp}/r", "--max-epochs", "1.5"], ("'--max-epochs'", HELP), code=2),
    # inputs and outputs never alias; --overwrite / --force replace only our own kind of directory
    Case("collect-limit-huge", ["collect", "--limit", str(10**30), "--out", "{tmp}/o"], ("--limit", "2,147,483,647")),
    Case("workload-show-limit-huge", ["workload", "show", "tiny-default", "--limit", str(10**30)],
         ("--limit", "2,147,483,647")),
    Case("collect-rounds-hidden-huge", ["collect", "--rounds-hidden", str(10**9), "--limit", "2", "--out", "{tmp}/o"],
         ("--rounds-hidden", "from 1 to 256")),
    Case("refresh-out-is-recording", ["refresh", "{traces}", "--bundle", "{bundle}", "--out", "{traces}"],
         ("is the input", "outside")),
    Case("refresh-no-recording", ["refresh", "{tmp}/nothing", "--bundle", "{bundle}", "--out", "{tmp}/r"],
         ("is no recording", "the hook records into")),
    Case("evaluate-out-is-run", ["evaluate", "{traces}", "--run", "{run}", "--out", "{run}"], ("is the input --run", "outside")),
    Case("evaluate-out-is-traces", ["evaluate", "{traces}", "--out", "{traces}"], ("is the input traces", "outside")),
    Case("evaluate-out-inside-traces", ["evaluate", "{traces}", "--out", "{traces}/eval"], ("lies inside the input traces",)),
    Case("evaluate-out-foreign", ["evaluate", "{traces}", "--out", "{foreign}"], ("not an evaluation", "new or empty --out")),
    Case("train-out-is-traces", ["train", "{traces}", "--out", "{traces}", "--overwrite"], ("is the input traces", "outside")),
    Case("train-out-contains-traces", ["train", "{nested}", "--out", "{tmp}/d", "--overwrite"], ("contains the input traces",), nested_traces),
    Case("train-overwrite-foreign", ["train", "{traces}", "--out", "{foreign}", "--overwrite"], ("not a run directory", "never replaced")),
    Case("train-overwrite-traces-elsewhere", ["train", "{traces}", "--out", "{bad}", "--overwrite"], ("not a run directory",), removed_in_copy("traces", "manifest.json")),
    Case("train-out-exists", ["train", "{traces}", "--out", "{run}"], ("already exists", "--overwrite")),
    Case("train-out-dangling-link", ["train", "{traces}", "--out", "{link}"], ("is a link to", "does not exist"), dangling_link),
    Case("train-out-file", ["train", "{traces}", "--out", "{file}"], ("is a file", "directory"), a_file),
    Case("export-out-is-run", ["export", "{run}", "--out", "{run}", "--force"], ("is the input run", "outside")),
    Case("export-out-inside-run", ["export", "{run}", "--out", "{run}/bundle"], ("lies inside the input run",)),
    Case("export-force-over-traces", ["export", "{run}", "--out", "{traces}", "--force"], ("not a bundle", "never replaced")),
    Case("export-out-exists", ["export", "{run}", "--out", "{bundle}"], ("already exists", "--force")),
    Case("merge-out-is-input", ["traces", "merge", "{traces}", "--out", "{traces}"], ("is the input dirs",)),
    Case("pull-out-is-zoo", ["zoo", "pull", "tiny", "--zoo", "{zoo}", "--out", "{zoo}"], ("is the input --zoo",)),
    Case("pull-out-foreign", ["zoo", "pull", "tiny", "--zoo", "{zoo}", "--out", "{foreign}"], ("not a bundle", "never replaced")),
    Case("characterize-out-inside-traces", ["characterize", "{traces}", "--out", "{traces}/c"], ("lies inside the input traces",)),
    Case("simulate-out-is-traces", ["simulate", "{traces}", "--out", "{traces}"], ("is the input traces",)),
    Case("collect-into-foreign", ["collect", "--limit", "2", "--out", "{foreign}"], ("not a trace collection", "new or empty --out")),
    Case("compare-out-is-traces", ["compare-regressors", "{traces}", "--out", "{traces}"], ("is the input traces",)),
    Case("collect-out-is-model", ["collect", "--model", "{model}", "--out", "{model}"], ("is the input --model",)),
    # `collect --layers` and the ablations that need it
    Case("collect-layers-out-of-range", ["collect", "--layers", "99", *Q.split()], ("--layers 99", "out of range", "0..4")),
    Case("collect-layers-not-ints", ["collect", "--layers", "last", *Q.split()], ("--layers", "comma-separated layer indices")),
    Case("evaluate-ablate-layers-without-layers", ["evaluate", "{traces}", "--ablate", "layers", "--out", "{tmp}/e"],
         ("--ablate layers", "re-collect", "collect --layers")),
    # counts bounded before anything is allocated (this spec used to hang and eat memory)
    Case("workload-show-huge-count", ["workload", "show", "{spec}"], ("train must be an integer from 0 to 100,000", "fix it in the spec"),
         spec('[[sources]]\ntype = "tiny"\ncategory = "chat"\ntrain = 100000000000\neval = 1\n')),
    Case("collect-huge-count", ["collect", "--workload", "{spec}", "--limit", "4", "--out", "{tmp}/o"], ("100,000",),
         spec('[[sources]]\ntype = "tiny"\ncategory = "chat"\ntrain = 100000000000\neval = 1\n')),
    Case("workload-huge-needles", ["workload", "show", "{spec}"], ("target_words", "1,000,000"),
         spec('[[sources]]\ntype = "multi_needle"\ncategory = "long"\ncount = 2\ntarget_words = 10000000000\n')),
    Case("workload-category-newline", ["workload", "show", "{spec}"], ("category must be a name",),
         spec('[[sources]]\ntype = "tiny"\ncategory = "chat\\n"\ncount = 2\n')),
    # damaged trace datasets
    Case("traces-manifest-not-object", ["train", "{bad}", "--out", "{tmp}/r"], ("does not hold a json object", "collect it again"), file_in_copy("traces", "manifest.json", "[1, 2]")),
    Case("traces-manifest-not-utf8", ["train", "{bad}", "--out", "{tmp}/r"], ("not utf-8 text",), file_in_copy("traces", "manifest.json", b"\xff\xfe{")),
    Case("traces-zero-rows", ["train", "{bad}", "--out", "{tmp}/r"], ("holds no requests", "dwise-predict collect"), zero_rows),
    Case("traces-null-category", ["train", "{bad}", "--out", "{tmp}/r"], ("category", "non-empty string"), traces_with(set_column("category", None))),
    Case("traces-without-end-probability", ["train", "{bad}", "--out", "{tmp}/r"], ("lack columns end_probability", "re-collect"),
         traces_with(lambda t: t.drop(columns=["end_probability"]))),
    Case("traces-int-category", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("category", "non-empty string"), traces_with(lambda t: t.assign(category=7))),
    Case("traces-fractional-rounds", ["train", "{bad}", "--out", "{tmp}/r"], ("total_rounds", "whole numbers"), traces_with(set_column("total_rounds", 3.5))),
    Case("traces-negative-rounds", ["characterize", "{bad}"], ("total_rounds", "whole numbers >= 1"), traces_with(set_column("total_rounds", -4))),
    Case("traces-billion-rounds", ["train", "{bad}", "--out", "{tmp}/r"], ("total_rounds", "more than a budget", "corrupt"), traces_with(set_column("total_rounds", 10**9))),
    Case("merge-manifest-not-object", ["traces", "merge", "{bad}", "--out", "{tmp}/m"], ("does not hold a json object", "damaged"), file_in_copy("traces", "manifest.json", "3")),
    Case("show-collecting-manifest-not-object", ["traces", "show", "{bad}"], ("does not hold a json object",), incomplete_collection_with_manifest("[]")),
    Case("traces-garbage-parquet", ["traces", "show", "{bad}"], ("cannot read traces",), file_in_copy("traces", "requests.parquet", b"garbage")),
    Case("traces-no-hidden", ["train", "{bad}", "--out", "{tmp}/r"], ("has no hidden.safetensors",), removed_in_copy("traces", "hidden.safetensors")),
    Case("traces-unfinished-collection", ["train", "{bad}", "--out", "{tmp}/r"], ("unfinished", "rerun the same `dwise-predict collect`"), incomplete_collection),
    # training options
    Case("config-wrong-type", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"], ("members must be int",), text_file("c.json", '{"members": "3"}')),
    Case("config-not-json", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"], ("not valid json",), text_file("c.json", "{members")),
    Case("config-not-object", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"], ("does not hold a json object",), text_file("c.json", "[3]")),
    Case("config-bool-for-float", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"], ("lr must be float",), text_file("c.json", '{"lr": true}')),
    Case("train-diverging-lr", ["train", "{traces}", "--out", "{tmp}/r", "--lr", "1e30", "--members", "1", "--width", "8",
                                 "--max-epochs", "3", "--patience", "1"], ("diverged", "lower the learning rate")),
    Case("train-zero-members", ["train", "{traces}", "--out", "{tmp}/r", "--members", "0"], ("members must be >= 1",)),
    # damaged runs
    Case("run-calibration-strings", ["export", "{bad}", "--out", "{tmp}/b"], ("calibration.json", "numbers", "dwise-predict train"), json_in_copy("run", "calibration.json", lambda c: {**c, "x": ["a"] * len(c["x"])})),
    Case("run-config-traces-not-object", ["export", "{bad}", "--out", "{tmp}/b"], ("traces.model", "dwise-predict train"), json_in_copy("run", "config.json", lambda c: {**c, "traces": 3})),
    Case("run-config-not-object", ["evaluate", "{traces}", "--run", "{bad}", "--out", "{tmp}/e"], ("does not hold a json object", "dwise-predict train"), file_in_copy("run", "config.json", "[]")),
    Case("run-calibration-not-utf8", ["export", "{bad}", "--out", "{tmp}/b"], ("not utf-8 text",), file_in_copy("run", "calibration.json", b"\xff\xff")),
    Case("run-refine-spec-string", ["export", "{bad}", "--out", "{tmp}/b"], ("refine.json", "hidden_size"), json_in_copy("run", "refine.json", lambda s: {**s, "hidden_size": "16"})),
    Case("run-truncated-weights", ["export", "{bad}", "--out", "{tmp}/b"], ("refine.safetensors", "dwise-predict train"), file_in_copy("run", "refine.safetensors", b"\x08\x00")),
    Case("run-missing-metrics", ["export", "{bad}", "--out", "{tmp}/b"], ("lacks metrics.json",), removed_in_copy("run", "metrics.json")),
    Case("run-before-early-signals", ["export", "{bad}", "--out", "{tmp}/b"], ("older dwise-predict", "early signals", "dwise-predict train"),
         json_in_copy("run", "refine.json", lambda s: {k: v for k, v in s.items() if k != "early_signals"})),
    Case("run-linear-length-scale", ["export", "{bad}", "--out", "{tmp}/b"], ("older dwise-predict", "linear scale", "dwise-predict train"),
         json_in_copy("run", "refine.json", lambda s: {k: v for k, v in s.items() if k != "length_scale"})),
    # bundles and zoos
    Case("verify-not-a-bundle", ["verify", "{foreign}"], ("is not a bundle", "dwise-predict export")),
    Case("verify-files-entry-malformed", ["verify", "{bad}"], ("'files' must map", "re-export"), resealed_bundle(lambda m: m["files"].update({"admission.txt": "abc"}))),
    Case("verify-files-not-object", ["verify", "{bad}"], ("'files' must map",), resealed_bundle(lambda m: m.update(files=[1]))),
    Case("verify-schema-1-bundle", ["verify", "{bad}"], ("bundle schema 1", "early_signals", "re-export"), resealed_bundle(lambda m: m.update(schema_version=1))),
    Case("verify-schema-2-bundle", ["verify", "{bad}"], ("bundle schema 2", "linear scale", "re-export"), resealed_bundle(lambda m: m.update(schema_version=2))),
    Case("verify-schema-3-bundle", ["verify", "{bad}"], ("bundle schema 3", "three early signals", "re-export"), resealed_bundle(lambda m: m.update(schema_version=3))),
    Case("simulate-bundle-unlisted-file", ["simulate", "{traces}", "--bundle", "{bad}"], ("does not list (extra.onnx)", "re-export"), bundle_with_extra_file),
    Case("publish-version-newline", ["publish", "{bundle}", "--zoo", "{tmp}/z", "--version", "7\n"], ("--version", "letters, digits")),
    Case("publish-name-newline", ["publish", "{bundle}", "--zoo", "{tmp}/z", "--name", "tiny\n"], ("--name",)),
    Case("zoo-index-entry-not-object", ["zoo", "list", "--zoo", "{badzoo}"], ("entry 0", "restore the index"), zoo_index('{"schema_version": 1, "bundles": [3]}')),
    Case("zoo-index-entry-no-name", ["zoo", "show", "x", "--zoo", "{badzoo}"], ("entry 0",), zoo_index('{"schema_version": 1, "bundles": [{"version": "1"}]}')),
    Case("zoo-index-entry-escapes", ["zoo", "pull", "x", "--zoo", "{badzoo}", "--out", "{tmp}/p"], ("entry 0", "outside the zoo"),
         zoo_index('{"schema_version": 1, "bundles": [{"name": "x", "version": "1", "file": "../../etc/x.tar", "sha256": "0"}]}')),
    Case("zoo-index-not-json", ["zoo", "pull", "x", "--zoo", "{badzoo}", "--out", "{tmp}/p"], ("not valid json", "restore"), zoo_index("{")),
    # the Hugging Face Hub (offline: HF_HUB_OFFLINE=1 and a cache; nothing reaches the network)
    Case("hub-pull-bad-repo-id", ["zoo", "pull", "hf://no-slash", "--out", "{tmp}/p"], ("hf://no-slash", "not a hugging face repo id", "owner/name")),
    Case("hub-pull-bad-revision", ["zoo", "pull", "hf://my-org/tiny@../x", "--out", "{tmp}/p"], ("not a branch, tag or commit",)),
    Case("hub-pull-revision-not-cached", ["zoo", "pull", "hf://my-org/tiny@v9", "--out", "{tmp}/p"],
         ("hf://my-org/tiny@v9", "not in the hugging face cache", "hf_hub_offline=1"), hub_cache,
         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{hfcache}"}),
    Case("hub-pull-and-zoo", ["zoo", "pull", "hf://my-org/tiny", "--zoo", "{zoo}", "--out", "{tmp}/p"], ("not both",), code=2),
    Case("usage-zoo-pull-no-zoo", ["zoo", "pull", "tiny", "--out", "{tmp}/p"], ("missing option '--zoo'", "zoo pull --help"), code=2),
    Case("hub-publish-bad-repo-id", ["publish", "{bundle}", "--hub", "a/b/c"], ("--hub", "not a hugging face repo id")),
    Case("hub-publish-bad-version", ["publish", "{bundle}", "--hub", "my-org/tiny", "--version", "../x"], ("--version", "not a branch, tag")),
    Case("hub-publish-revision-with-zoo", ["publish", "{bundle}", "--zoo", "{tmp}/z", "--revision", "exp"], ("--revision is for the hub",), code=2),
    Case("zoo-missing", ["zoo", "list", "--zoo", "{tmp}/none"], ("no zoo at", "dwise-predict publish")),
    Case("zoo-pull-unknown", ["zoo", "pull", "nothere", "--zoo", "{zoo}", "--out", "{tmp}/p"], ("no bundle named 'nothere'", "zoo list")),
    # model directories and devices
    Case("model-config-not-object", ["collect", "--model", "{m}", *Q.split()], ("does not hold a json object", "re-save"), model_with("config.json", b"[1]")),
    Case("model-config-not-utf8", ["collect", "--model", "{m}", *Q.split()], ("not utf-8 text",), model_with("config.json", b"\xff{")),
    Case("model-garbage-weights", ["collect", "--model", "{m}", *Q.split()], ("cannot load the model",), model_with("model.safetensors", b"garbage garbage")),
    Case("model-empty-weights", ["collect", "--model", "{m}", *Q.split()], ("cannot load the model",), model_with("model.safetensors", b"")),
    Case("model-truncated-weights", ["collect", "--model", "{m}", *Q.split()], ("cannot load the model",), truncated_weights),
    Case("model-mismatched-shapes", ["collect", "--model", "{m}", *Q.split()], ("cannot load the model",), model_with(None, None, wider_config)),
    Case("model-pickle-weights", ["collect", "--model", "{m}", *Q.split()], ("cannot load the model",),
         model_with("pytorch_model.bin", pickle.dumps({"weight": _Planted()}), drop="model.safetensors")),
    Case("device-bogus", ["collect", "--device", "bogus", *Q.split()], ("--device 'bogus'", "cpu, cuda")),
    Case("device-cuda-absent", ["collect", "--device", "cuda", *Q.split()], ("no cuda device", "--device cpu")),
    Case("model-missing", ["collect", "--model", "{tmp}/nothing", *Q.split()], ("no model directory", "--model tiny")),
    # options of simulate, collect, quickstart, compare-regressors
    Case("simulate-round-ms-nan", ["simulate", "{traces}", "--round-ms", "nan"], ("--round-ms",)),
    Case("simulate-rates-empty-item", ["simulate", "{traces}", "--rates", "1x,,2x"], ("empty item",)),
    Case("simulate-rates-empty", ["simulate", "{traces}", "--rates", ""], ("--rates is empty",)),
    Case("simulate-rate-not-a-number", ["simulate", "{traces}", "--rate", "fast"], ("--rate item 'fast'", "multiple like 2x")),
    Case("simulate-unknown-policy", ["simulate", "{traces}", "--policies", "nope"], ("--policies", "choose from")),
    Case("simulate-batch-former-unknown", ["simulate", "{traces}", "--batch-former", "sideways"],
         ("'--batch-former'", "sideways", HELP), code=2),
    Case("simulate-subset-unknown-category", ["simulate", "{traces}", "--subset", "mcq,nope", "--requests", "8"],
         ("--subset names categories", "nope", "they hold: chat, code, math, mcq")),
    Case("simulate-subset-every-category", ["simulate", "{traces}", "--subset", "chat,code,math,mcq", "--requests", "8"],
         ("--subset (chat, code, math, mcq) holds every category", "no other requests")),
    Case("simulate-subset-empty", ["simulate", "{traces}", "--subset", " , "], ("--subset is empty", "mcq,hard_mcq")),
    Case("simulate-subset-in-a-sweep", ["simulate", "{traces}", "--subset", "mcq", "--rates", "1x"],
         ("--subset compares latencies at one load", "drop --rates")),
    Case("simulate-budget-sweep-missing", ["simulate", "{traces}", "--budget-sweep", "{tmp}/nothing"],
         ("--budget-sweep", "is not a trace directory")),
    Case("simulate-budget-sweep-empty", ["simulate", "{traces}", "--budget-sweep", " , "], ("--budget-sweep is empty",)),
    Case("simulate-budget-sweep-same-budget", ["simulate", "{traces}", "--budget-sweep", "{traces}"],
         ("share the output budget 256", "one trace set per budget")),
    Case("simulate-budget-sweep-other-algorithm", ["simulate", "{traces}", "--budget-sweep", "{bad}"],
         ("differ in decoding (algorithm:", "the output budget alone"),
         json_in_copy("traces", "manifest.json", lambda m: {**m, "decoding": {**m["decoding"], "algorithm": "other"}})),
    Case("simulate-budget-sweep-in-a-sweep", ["simulate", "{traces}", "--budget-sweep", "{traces}", "--ks", "2,4"],
         ("replay at one load", "drop --rates / --ks")),
    Case("simulate-budget-sweep-into-its-traces", ["simulate", "{traces}", "--budget-sweep", "{bad}", "--out", "{bad}"],
         ("--out", "is one of the --budget-sweep traces"), lambda w, tmp: {"bad": _copy(w["traces"], tmp / "bad")}),
    Case("simulate-out-inside-budget-sweep-traces", ["simulate", "{traces}", "--budget-sweep", "{bad}", "--out", "{bad}/sim"],
         ("--out", "lies inside the input --budget-sweep", "never writes over its inputs"),
         lambda w, tmp: {"bad": _copy(w["traces"], tmp / "bad")}),
    Case("simulate-drop-category-unknown", ["simulate", "{traces}", "--drop-category", "poetry"],
         ("unknown category 'poetry'", "pass one of those to --drop-category")),
    Case("simulate-drop-category-all-and-names", ["simulate", "{traces}", "--drop-category", "all", "--drop-category", "mcq"],
         ("--drop-category all already holds out each category",)),
    Case("simulate-drop-category-train-split", ["simulate", "{traces}", "--drop-category", "mcq", "--split", "train"],
         ("retrain on the train split", "drop --split")),
    Case("collect-limit-zero", ["collect", "--limit", "0", "--out", "{tmp}/o"], ("--limit must be a whole number of requests from 1 to",)),
    Case("collect-shard-bad", ["collect", "--shard", "3/2", "--out", "{tmp}/o"], ("--shard", "0 <= i < n")),
    Case("collect-algorithm-config-list", ["collect", "--algorithm-config", "[1]", "--out", "{tmp}/o"], ("--algorithm-config", "json object")),
    Case("collect-algorithm-config-bad-yaml", ["collect", "--algorithm-config", "{alg}", "--out", "{tmp}/o"],
         ("--algorithm-config", "not valid yaml (line 2: mapping values are not allowed here)"),
         algorithm_file("threshold: 0.9\n  edit: 1\n")),
    Case("collect-algorithm-config-yaml-list", ["collect", "--algorithm-config", "{alg}", "--out", "{tmp}/o"],
         ("--algorithm-config", "mapping"), algorithm_file("- threshold: 0.9\n")),
    Case("collect-algorithm-config-block-size-clash", ["collect", "--algorithm-config", "{alg}", "--block-size", "4",
                                                       "--out", "{tmp}/o"], ("--block-size 4", "block_size 8", "give one"),
         algorithm_file("threshold: 0.9\nblock_size: 8\n")),
    Case("collect-algorithm-config-key-not-read", ["collect", "--algorithm-config", "{alg}", "--out", "{tmp}/o"],
         ("has no parameter edit_threshold", "sglang ignores", "remove it"),
         algorithm_file("threshold: 0.9\nedit_threshold: 0.1\n")),
    Case("collect-d2f-add-threshold-zero", ["collect", "--algorithm", "D2F", "--algorithm-config", "{alg}", "--out", "{tmp}/o"],
         ("add_threshold must be a number in (0, 1]", "got 0"), algorithm_file("add_threshold: 0\n")),
    Case("collect-d2f-threshold-shorthand", ["collect", "--algorithm", "D2F", "--threshold", "0.9", "--out", "{tmp}/o"],
         ("d2f has no parameter threshold", "add_threshold, decode_threshold, confidence_threshold")),
    Case("collect-d2f-rounds-hidden", ["collect", "--algorithm", "D2F", "--rounds-hidden", "2", "--out", "{tmp}/o"],
         ("--rounds-hidden does not fit d2f", "drop --rounds-hidden")),
    Case("collect-d2f-batch-size", ["collect", "--algorithm", "D2F", "--batch-size", "64", "--out", "{tmp}/o"],
         ("--batch-size 64 does not apply to --algorithm d2f", "one request at a time", "drop --batch-size")),
    Case("quickstart-limit-zero", ["quickstart", "--limit", "0", "--out", "{tmp}/q"], ("--limit must be at least 1",)),
    Case("compare-folds-one", ["compare-regressors", "{traces}", "--folds", "1"], ("--folds must be at least 2",)),
    # the scheduling lab and the serving hook
    Case("batch-timeout-missing-file", ["batch-timeout", "--service-times", "{tmp}/none.json"],
         ("service-time file", "does not exist")),
    Case("batch-timeout-negative", ["batch-timeout", "--timeout", "-1"], ("--timeout must be >= 0",)),
    Case("profile-rounds-device-bogus", ["profile-rounds", "--device", "bogus", "--out", "{tmp}/p.json"],
         ("--device 'bogus'", "cpu, cuda")),
    Case("serve-bundle-missing", ["serve", "--bundle", "{tmp}/nothing", "--dry-run"],
         ("no bundle.json", "dwise-predict export")),
    Case("serve-prompt-cache-negative", ["serve", "--record", "{tmp}/t", "--block-size", "8", "--hidden-size", "4",
                                         "--prompt-cache", "-1", "--dry-run"], ("--prompt-cache must be 0 or more",)),
]

# Issue 43, the second adversarial pass; each row is a family ("a43-<family>-..."), counted in the
# report. A row whose command used to succeed asserts what it now refuses; the shared checks below
# assert one line, inputs unchanged and nothing written outside --out.
RUN_FAST = ["--members", "1", "--width", "8", "--max-epochs", "2"]
CASES += [
    # data loss and pollution: an --out holding files of yours is never written into or replaced
    Case("a43-output-simulate-into-folder-of-yours", ["simulate", "{traces}", "--requests", "8", "--policies", "fcfs-mixed",
                                                      "--out", "{mine}"], ("notes.txt", "never replaced or written into"),
         folder_of_yours("simulate.json")),
    Case("a43-output-sweep-into-folder-of-yours", ["simulate", "{traces}", "--requests", "8", "--policies", "fcfs-mixed",
                                                   "--rates", "1x", "--out", "{mine}"], ("notes.txt",),
         folder_of_yours("simulate.json", "sweep.json")),
    Case("a43-output-evaluate-into-folder-of-yours", ["evaluate", "{traces}", "--run", "{run}", "--out", "{mine}"],
         ("notes.txt", "never replaced"), folder_of_yours("evaluation.json")),
    Case("a43-output-characterize-into-folder-of-yours", ["characterize", "{traces}", "--out", "{mine}"],
         ("notes.txt",), folder_of_yours("characterization.json")),
    Case("a43-output-train-overwrite-folder-of-yours", ["train", "{traces}", "--out", "{mine}", "--overwrite"],
         ("notes.txt",), folder_of_yours("refine.json", "config.json")),
    Case("a43-output-across-into-folder-of-yours", ["evaluate", "{traces}", "--across", "--out", "{mine}"],
         ("notes.txt",), folder_of_yours("across.json")),
    Case("a43-output-batch-timeout-into-folder-of-yours", ["batch-timeout", "--out", "{mine}"], ("notes.txt",),
         folder_of_yours("batch_timeout.json")),
    Case("a43-output-compare-into-folder-of-yours", ["compare-regressors", "{traces}", "--folds", "2", "--repeats", "1",
                                                     "--out", "{foreign}"], ("not a regressor comparison",)),
    Case("a43-output-train-overwrite-link-to-foreign", ["train", "{traces}", "--out", "{link}", "--overwrite"],
         ("not a run directory", "never replaced"), link_to("foreign")),
    Case("a43-output-export-force-link-to-traces", ["export", "{run}", "--out", "{link}", "--force"],
         ("not a bundle", "never replaced"), link_to("traces")),
    Case("a43-output-simulate-link-to-traces", ["simulate", "{traces}", "--out", "{link}"], ("is the input traces",),
         link_to("traces")),
    # silent wrong successes: traces that cannot describe one decoding
    Case("a43-schema-1", ["train", "{bad}", "--out", "{tmp}/r"], ("schema version 1", "collect them again"),
         manifest_with(lambda m: m.update(schema_version=1))),
    Case("a43-schema-true", ["train", "{bad}", "--out", "{tmp}/r"], ("schema version true", "not a whole number"),
         manifest_with(lambda m: m.update(schema_version=True))),
    Case("a43-schema-string", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("schema version '3'",),
         manifest_with(lambda m: m.update(schema_version="3"))),
    Case("a43-manifest-model-not-object", ["simulate", "{bad}", "--bundle", "{bundle}"], ("model that is not a json object",),
         manifest_with(lambda m: m.update(model=[1]))),
    Case("a43-manifest-hidden-size-disagrees", ["train", "{bad}", "--out", "{tmp}/r"], ("model.hidden_size 99", "rows of 16"),
         manifest_with(lambda m: m["model"].update(hidden_size=99))),
    # a decoding the engine's rules refuse (issue 51): one line naming the manifest and the parameter
    Case("traces-decoding-d2f-string", ["simulate", "{bad}", "--bundle", "{bundle}"],
         ("manifest.json records a decoding", "decode_threshold must be a number in (0, 1], got '<script>'",
          "collect the traces again"),
         manifest_with(lambda m: m["decoding"].update(algorithm="D2F", algorithm_config={
             "add_threshold": 0.5, "decode_threshold": "<script>", "confidence_threshold": 1.0}))),
    Case("traces-decoding-unknown-key", ["evaluate", "{bad}", "--out", "{tmp}/e"],
         ("lowconfidence has no parameter high", "collect the traces again"),
         manifest_with(lambda m: m["decoding"].update(algorithm="LowConfidence", algorithm_config={"high": 1}))),
    Case("traces-decoding-in-budget-sweep", ["simulate", "{traces}", "--budget-sweep", "{bad}"],
         ("threshold must be a number in [0.0, 1.0], got 1.5",),
         manifest_with(lambda m: m["decoding"].update(algorithm="LowConfidence", algorithm_config={"threshold": 1.5}))),
    Case("a43-columns-prompt-blocks-absurd", ["simulate", "{bad}", "--requests", "8", "--policies", "fcfs-mixed"],
         ("prompt_blocks is 1e+15", "corrupt"), traces_with(set_column("prompt_blocks", 10**15))),
    Case("a43-columns-total-not-sum", ["train", "{bad}", "--out", "{tmp}/r"], ("rounds_per_block sums to",),
         traces_with(lambda t: t.assign(total_rounds=t["total_rounds"] + 1))),
    Case("a43-columns-too-many-blocks", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("lists 1000 blocks",),
         traces_with(many_blocks)),
    Case("a43-columns-rounds-per-block-text", ["train", "{bad}", "--out", "{tmp}/r"], ("not a list of whole numbers",),
         traces_with(lambda t: t.assign(rounds_per_block=t["rounds_per_block"].map(lambda v: ",".join(map(str, v)))))),
    Case("a43-columns-output-over-budget", ["characterize", "{bad}"], ("exceed its budget",),
         traces_with(lambda t: t.assign(output_tokens=t["budget"] + 1))),
    Case("a43-columns-finish-unknown", ["characterize", "{bad}"], ("finish is 'maybe'",), traces_with(lambda t: t.assign(finish="maybe"))),
    Case("a43-columns-confidence-above-one", ["train", "{bad}", "--out", "{tmp}/r"], ("mean_confidence is 3", "outside [0, 1]"),
         traces_with(lambda t: t.assign(mean_confidence=3.0))),
    Case("a43-columns-negative-wall", ["characterize", "{bad}"], ("wall_s is -1",), traces_with(lambda t: t.assign(wall_s=-1.0))),
    Case("a43-columns-request-id-missing", ["train", "{bad}", "--out", "{tmp}/r"], ("request_id", "non-empty string"),
         traces_with(set_column("request_id", None))),
    Case("a43-columns-request-id-int", ["train", "{bad}", "--out", "{tmp}/r"], ("request_id", "found 0"),
         traces_with(lambda t: t.assign(request_id=range(len(t))))),
    Case("a43-columns-prompt-missing", ["compare-regressors", "{bad}", "--folds", "2", "--repeats", "1"],
         ("prompt", "the prompt's text"), traces_with(lambda t: t.assign(prompt=None))),
    Case("a43-columns-category-blank", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("category", "found ' '"),
         traces_with(lambda t: t.assign(category=" "))),
    # silent wrong successes and tracebacks: shards damaged on disk, or of two hidden sizes
    Case("a43-shards-bit-flip-tensors", ["traces", "merge", "{bad}", "--out", "{tmp}/m"],
         ("shard-000000.parquet is damaged", "delete shard-000000.parquet and shard-000000.safetensors"),
         flipped_shard(".safetensors")),
    Case("a43-shards-bit-flip-table", ["traces", "merge", "{bad}", "--out", "{tmp}/m"],
         ("shard-000000.parquet", "delete shard-000000.parquet and shard-000000.safetensors"), flipped_shard(".parquet")),
    Case("a43-shards-bit-flip-resume", ["collect", "--limit", "2", "--out", "{bad}"], ("is damaged",),
         flipped_shard(".safetensors")),
    Case("a43-shards-two-hidden-sizes-merge", ["traces", "merge", "{a}", "{b}", "--out", "{tmp}/m"],
         ("rows of shape (24,)", "different models"), two_hidden_sizes(together=False)),
    Case("a43-shards-two-hidden-sizes-consolidate", ["traces", "merge", "{a}", "--out", "{tmp}/m"],
         ("rows of shape (24,)", "different models"), two_hidden_sizes(together=True)),
    # tracebacks: JSON, YAML and TOML nested past any stack
    Case("a43-nesting-trace-manifest", ["train", "{bad}", "--out", "{tmp}/r"], ("nests arrays or objects more than 64 deep",),
         file_in_copy("traces", "manifest.json", DEEP_JSON)),
    Case("a43-nesting-show-manifest", ["traces", "show", "{bad}"], ("more than 64 deep",), file_in_copy("traces", "manifest.json", DEEP_JSON)),
    Case("a43-nesting-merge-manifest", ["traces", "merge", "{bad}", "--out", "{tmp}/m"], ("more than 64 deep",),
         file_in_copy("traces", "manifest.json", DEEP_JSON)),
    Case("a43-nesting-run-config", ["evaluate", "{traces}", "--run", "{bad}", "--out", "{tmp}/e"], ("more than 64 deep",),
         file_in_copy("run", "config.json", DEEP_JSON)),
    Case("a43-nesting-run-calibration", ["export", "{bad}", "--out", "{tmp}/b"], ("more than 64 deep",),
         file_in_copy("run", "calibration.json", DEEP_JSON)),
    Case("a43-nesting-run-admission-spec", ["evaluate", "{traces}", "--run", "{bad}", "--out", "{tmp}/e"], ("admission.json", "more than 64 deep"),
         file_in_copy("run", "admission.json", DEEP_JSON)),
    Case("a43-json-run-admission-nan", ["evaluate", "{traces}", "--run", "{bad}", "--out", "{tmp}/e"], ("admission.json", "not valid json", "nan"),
         file_in_copy("run", "admission.json", '{"features": NaN}')),
    Case("a43-json-run-admission-list", ["evaluate", "{traces}", "--run", "{bad}", "--out", "{tmp}/e"],
         ("admission.json does not hold a json object", "retrain"), file_in_copy("run", "admission.json", "[1]")),
    Case("a43-nesting-train-config", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"], ("more than 64 deep",),
         text_file("c.json", DEEP_JSON)),
    Case("a43-nesting-round-profile", ["simulate", "{traces}", "--round-profile", "{file}"], ("round profile", "more than 64 deep"),
         text_file("p.json", DEEP_JSON)),
    Case("a43-nesting-service-times", ["batch-timeout", "--service-times", "{file}"], ("more than 64 deep",),
         text_file("s.json", DEEP_JSON)),
    Case("a43-nesting-algorithm-config-json", ["collect", "--algorithm-config", "{deep}", "--out", "{tmp}/o"],
         ("--algorithm-config nests arrays or objects more than 64 deep",), lambda w, tmp: {"deep": DEEP_JSON}),
    Case("a43-nesting-algorithm-config-yaml", ["collect", "--algorithm-config", "{alg}", "--out", "{tmp}/o"],
         ("nests too deeply",), algorithm_file("threshold: " + "[" * 5000 + "]" * 5000 + "\n")),
    Case("a43-nesting-workload-toml", ["workload", "show", "{spec}"], ("nests too deeply",),
         spec("x = " + "[" * 100_000 + "]" * 100_000 + "\n")),
    Case("a43-nesting-workload-yaml", ["workload", "show", "{file}"], ("nests too deeply",),
         text_file("w.yaml", "sources: " + "[" * 5000 + "]" * 5000 + "\n")),
    # nine aliases deep: a billion strings once the spec's name is printed (it used to hang)
    Case("a51-yaml-alias-bomb", ["workload", "show", "{file}"], ("yaml alias", "write each value out"),
         text_file("w.yaml", "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                   + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
                   + "name: *i\nsources: []\n")),
    Case("a43-nesting-workload-jsonl-line", ["workload", "show", "{spec}"], ("d.jsonl:2", "more than 64 deep"),
         jsonl_workload(DEEP_JSON)),
    Case("a43-nesting-collection-manifest", ["traces", "show", "{bad}"], ("more than 64 deep",),
         incomplete_collection_with_manifest(DEEP_JSON)),
    # tracebacks: numbers no library takes, sizes no machine holds
    Case("a43-numbers-train-seed-negative", ["train", "{traces}", "--out", "{tmp}/r", "--seed", "-1"], ("'--seed'", HELP), code=2),
    Case("a43-numbers-train-seed-2-64", ["train", "{traces}", "--out", "{tmp}/r", "--seed", str(2**64)], ("'--seed'", HELP), code=2),
    Case("a43-numbers-config-seed-negative", ["train", "{traces}", "--out", "{tmp}/r", "--config", "{file}"],
         ("seed must lie in [0, 2147483647]",), text_file("c.json", '{"seed": -1}')),
    Case("a43-numbers-collect-seed-negative", ["collect", "--seed", "-1", "--out", "{tmp}/o"], ("'--seed'",), code=2),
    Case("a43-numbers-simulate-seed-huge", ["simulate", "{traces}", "--seed", str(2**64)], ("'--seed'",), code=2),
    Case("a43-numbers-train-width-huge", ["train", "{traces}", "--out", "{tmp}/r", "--width", "1000000000"],
         ("width must be at most 16,384",)),
    Case("a43-numbers-train-members-huge", ["train", "{traces}", "--out", "{tmp}/r", "--members", "100000"],
         ("members must be at most 32",)),
    Case("a43-numbers-train-threads-huge", ["train", "{traces}", "--out", "{tmp}/r", "--threads", "100000"],
         ("num_threads must be at most 256",)),
    Case("a43-numbers-simulate-k-inf", ["simulate", "{traces}", "--k", "inf"], ("--k must be a finite number",)),
    Case("a43-numbers-simulate-ks-inf", ["simulate", "{traces}", "--ks", "1,inf"], ("--ks must be a comma list of finite",)),
    Case("a43-numbers-simulate-ks-nan", ["simulate", "{traces}", "--ks", "1,nan", "--requests", "8"], ("--ks",)),
    Case("a43-numbers-simulate-requests-huge", ["simulate", "{traces}", "--requests", "100000000000"],
         ("--requests must lie in 0..1,000,000",)),
    Case("a43-numbers-simulate-arrival-seeds-huge", ["simulate", "{traces}", "--arrival-seeds", "100000000"],
         ("--arrival-seeds must lie in 1..1,000",)),
    Case("a43-numbers-export-probes-huge", ["export", "{run}", "--out", "{tmp}/b", "--probes", "2000000000"],
         ("'--probes'", "4096", HELP), code=2),
    Case("a43-numbers-batch-timeout-requests-huge", ["batch-timeout", "--requests", "100000000000"],
         ("--requests must lie in 100..10,000,000",)),
    Case("a43-numbers-batch-timeout-batch-huge", ["batch-timeout", "--batch-size", "1000000000000"],
         ("--batch-size must lie in 1..4,096",)),
    # edges that were already handled, kept as rows so they stay so
    Case("a43-splits-no-eval", ["train", "{bad}", "--out", "{tmp}/r"], ("no 'eval' split",),
         traces_with(lambda t: t.assign(split="train"))),
    Case("a43-splits-no-train", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("0 training requests",),
         traces_with(lambda t: t.assign(split="eval"))),
    Case("a43-columns-split-int", ["train", "{bad}", "--out", "{tmp}/r"], ("split", "'train' or 'eval'", "found 1:"),
         traces_with(lambda t: t.assign(split=1))),
    Case("a43-files-hidden-truncated", ["train", "{bad}", "--out", "{tmp}/r"], ("cannot read traces", "collect it again"),
         file_in_copy("traces", "hidden.safetensors", b"\x40\x00\x00\x00\x00\x00\x00\x00{")),
    Case("a43-edges-shard-zero", ["collect", "--shard", "0/0", "--out", "{tmp}/o"], ("--shard", "0 <= i < n")),
    Case("a43-edges-limit-negative", ["collect", "--limit", "-5", "--out", "{tmp}/o"], ("--limit must be a whole number of requests from 1 to",)),
    Case("a43-env-zoo-is-a-file", ["zoo", "list"], ("no zoo at",), a_file, env={"DWISE_ZOO": "{file}"}),
    Case("a43-env-zoo-empty", ["zoo", "list"], ("missing option '--zoo'", "dwise_zoo"), code=2, env={"DWISE_ZOO": ""}),
    # invented beside the pass: values no collection writes, in tensors and columns
    Case("a43-data-hidden-nan", ["train", "{bad}", "--out", "{tmp}/r"], ("first_round", "nan or inf"),
         hidden_with(lambda t: t["first_round"].__setitem__((0, 0), np.nan))),
    Case("a43-data-prompt-last-inf", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("prompt_last", "nan or inf"),
         hidden_with(lambda t: t["prompt_last"].__setitem__((1, 2), np.inf))),
    Case("a43-data-first-round-narrower", ["train", "{bad}", "--out", "{tmp}/r"], ("hidden_size 16", "rows of 3"),
         hidden_with(lambda t: t.__setitem__("first_round", t["first_round"][:, :3]))),
    Case("a43-data-duplicate-request-id", ["train", "{bad}", "--out", "{tmp}/r"], ("appears twice", "unique"),
         traces_with(lambda t: t.assign(request_id=[t.request_id[0]] * 2 + list(t.request_id[2:])))),
    Case("a43-data-prompt-tokens-text", ["train", "{bad}", "--out", "{tmp}/r"], ("prompt_tokens",),
         traces_with(lambda t: t.assign(prompt_tokens=t.prompt_tokens.astype(str).where(t.index != 0, "many")))),
    Case("a43-data-total-rounds-zero", ["evaluate", "{bad}", "--out", "{tmp}/e"], ("total_rounds",),
         traces_with(set_column("total_rounds", 0))),
    # multi-line errors: a progress line before a refusal
    Case("a43-lines-compare-folds-1000", ["compare-regressors", "{traces}", "--folds", "1000"], ("cannot fill 1000 folds",)),
    Case("a43-lines-compare-tiny-traces", ["compare-regressors", "{small}", "--folds", "2"],
         ("to fit on in a fold", "collect more requests"), small_traces(24)),
    # multi-line errors: a value holding a line break other than \n (str.splitlines breaks at U+2028,
    # U+2029, \x85, \x0b, \x0c, \x1c-\x1e), echoed in our message or in typer's
    Case("a43-lines-path-u2028", ["train", "{tmp}/a\u2028b", "--out", "{tmp}/r"], ("a\\u2028b", "no trace directory")),
    Case("a43-lines-path-x85", ["evaluate", "{tmp}/a\x85b", "--out", "{tmp}/e"], ("a\\x85b",)),
    Case("a43-lines-usage-u2029", ["collect", "--bo\u2029gus"], ("--bo\\u2029gus", HELP), code=2),
    Case("a43-lines-usage-x0b", ["colle\x0bct"], ("colle\\x0bct", HELP), code=2),
    # the environment (issue 51): --out names no file system or file of ours holds, met before anything
    # is made (files.refuse_unusable_path) or wherever first used (cli/app.py); these were tracebacks
    Case("a51-env-out-not-utf8", ["train", "{traces}", "--out", "{tmp}/o\udcff"], ("--out", "not utf-8", "utf-8 name")),
    Case("a51-env-out-not-utf8-merge", ["traces", "merge", "{traces}", "--out", "{tmp}/o\udcff"], ("not utf-8",)),
    Case("a51-env-out-name-256", ["export", "{run}", "--out", "{tmp}/" + "a" * 256], ("too long", "255 bytes", "shorter")),
    Case("a51-env-out-name-256-merge", ["traces", "merge", "{traces}", "--out", "{tmp}/" + "a" * 256],
         ("name of 256 bytes", "over the 255", "shorten")),
    Case("a51-env-out-path-max", ["train", "{traces}", "--out", "{tmp}/" + "/".join(["a" * 200] * 21)],
         ("too long", "4,096 (path_max)", "shorter")),
    Case("a51-env-out-path-max-merge", ["traces", "merge", "{traces}", "--out", "{tmp}/" + "/".join(["a" * 200] * 21)],
         ("--out is", "path limit (path_max)", "shorter --out")),
    Case("a51-env-simulate-out-name-256", ["simulate", "{traces}", "--out", "{tmp}/" + "a" * 256],
         ("too long", "255 bytes", "path_max")),
    Case("a51-env-input-name-256", ["traces", "show", "{tmp}/" + "a" * 256], ("too long", "255 bytes")),
    # clean errors that misled (issue 51)
    Case("a51-mislead-export-names-the-run", ["export", "{bad}", "--out", "{tmp}/b"],
         ("/bad/admission.txt: num_class is none", "retrain"),
         file_in_copy("run", "admission.txt", "tree\nversion=v4\n")),  # named its temporary copy, .b.tmp-PID/
    Case("a51-mislead-round-profile-fifo", ["simulate", "{traces}", "--round-profile", "{fifo}"],
         ("is not a regular file", "the profile's json file"), a_fifo),  # "does not exist"
    Case("a51-mislead-shard-owns-none", ["collect", "--limit", "1", "--shard", "1/2", "--out", "{tmp}/o"],
         ("--shard 1/2 owns none of the workload's 1 requests", "at most 1 shards", "--limit")),  # "run collect first"
    Case("a51-mislead-schema-version-true", ["traces", "show", "{bad}"], ("schema version true, not a whole number",),
         manifest_with(lambda m: m.__setitem__("schema_version", True))),  # held: not "an old schema"
]


def _snapshot(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, world, tmp_path, capsys, monkeypatch):
    if case.id == "device-cuda-absent" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    monkeypatch.delenv("DWISE_ZOO", raising=False)
    monkeypatch.delenv("DWISE_DEBUG", raising=False)
    values = {**world, "tmp": tmp_path}
    if case.setup is not None:
        values.update(case.setup(world, tmp_path))
    for name, value in case.env.items():
        monkeypatch.setenv(name, value.format(**values))
    argv = [arg.format(**values) for arg in case.argv]
    before = _snapshot(world["root"], tmp_path)

    code = main(argv)

    err = capsys.readouterr().err
    # off a terminal a long command logs its stages first (cli/progress.py): the error is the one other line
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert code == case.code, err
    assert len(lines) == 1, err
    for word in case.words:
        assert word.lower() in lines[0].lower(), lines[0]
    after = _snapshot(world["root"], tmp_path)
    assert {k: after.get(k) for k in before} == before, "an input changed"
    assert all(Path(p).name.endswith(".lock") for p in set(after) - set(before)), set(after) - set(before)
    assert not Path(_Planted.marker).exists(), "a pickle payload ran"


def test_one_line_escapes_every_character_a_line_breaks_at():
    """cli.app._one_line: no character str.splitlines breaks at survives (the set found by trying them
    all, not copied from the code), and each shows as its escape."""
    import sys

    from dwise_predict.cli.app import _one_line

    breaks = [chr(c) for c in range(sys.maxunicode + 1) if len(f"a{chr(c)}b".splitlines()) > 1]
    assert len(breaks) == 10  # \n \r \x0b \x0c \x1c \x1d \x1e \x85 \u2028 \u2029
    for char in breaks:
        line = _one_line(f"x{char}y\r\n")
        assert line.splitlines() == [line] and line == f"x{char.encode('unicode_escape').decode()}y\\r\\n"


def test_the_json_reader_refuses_what_no_file_of_ours_holds(tmp_path):
    """files.loads_json / read_json: one typed error for JSON too deep for the stack, deeper than any
    of ours, larger than any of ours (checked before the file is read), or holding NaN (unless asked);
    the depth count stays linear on quotes that never close; what we write reads back."""
    import time

    from dwise_predict.errors import InputError
    from dwise_predict.files import JSON_MAX_DEPTH, loads_json, read_json, read_json_object

    nested = lambda depth: "[" * depth + "]" * depth  # noqa: E731
    deepest = loads_json(nested(JSON_MAX_DEPTH), InputError, "x")
    for _ in range(JSON_MAX_DEPTH - 1):
        deepest = deepest[0]
    assert deepest == []
    assert loads_json('["[[[", {"a": "]]]"}]', InputError, "x") == ["[[[", {"a": "]]]"}]  # brackets in strings
    for text in (nested(JSON_MAX_DEPTH + 1), nested(100_000)):  # the second used to raise RecursionError
        with pytest.raises(InputError, match=f"x nests arrays or objects more than {JSON_MAX_DEPTH} deep"):
            loads_json(text, InputError, "x")
    with pytest.raises(InputError, match=r"x is not valid JSON \(NaN is not a JSON number\)"):
        loads_json('{"loss": NaN}', InputError, "x")
    assert loads_json('{"loss": NaN}', InputError, "x", allow_nan=True)["loss"] != 0  # NaN != anything
    started = time.perf_counter()  # a closing quote required, this took ~30 s at 40,000 (quadratic)
    with pytest.raises(InputError, match="not valid JSON"):
        loads_json('"' + '\\"' * 200_000, InputError, "x")
    assert time.perf_counter() - started < 2
    (tmp_path / "big.json").write_text('{"a": "' + "b" * 2000 + '"}')
    with pytest.raises(InputError, match="big.json holds 2,009 bytes of JSON, more than the 1,000 this reads: fix it"):
        read_json(tmp_path / "big.json", InputError, fix="fix it", max_bytes=1000)
    assert read_json(tmp_path / "big.json", InputError, max_bytes=None) == {"a": "b" * 2000}
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(InputError, match="does not hold a JSON object"):
        read_json_object(tmp_path / "list.json", InputError)


def test_the_table_covers_every_command():
    import typer.main

    from dwise_predict.cli import app

    def names(group, prefix=()):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                yield from names(cmd, prefix + (name,))
            else:
                yield " ".join(prefix + (name,))

    tried = {" ".join(a for a in c.argv[:2] if not a.startswith(("-", "{"))) for c in CASES}
    tried |= {c.argv[0] for c in CASES}
    untested = {n for n in names(typer.main.get_command(app)) if n not in tried}
    assert not untested, untested
    assert len(CASES) >= 60
