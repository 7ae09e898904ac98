"""The SGLang surface the adapter patches: real pinned source (when present), snapshot, and fake agree."""

import importlib.util
import inspect
import json
import os
from pathlib import Path

import pytest

from dwise_predict.serving.sglang_adapter import SGLANG_VERSION, SURFACE, read_surface, surface_problems
from fakes import sglang_fake

SNAPSHOT = json.loads((Path(__file__).parent / "fakes" / "sglang_surface.json").read_text())


def _sglang_source() -> Path | None:
    if os.environ.get("DWISE_SGLANG_SRC"):
        return Path(os.environ["DWISE_SGLANG_SRC"])
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent.parent
    return None


def test_snapshot_is_of_the_pinned_release_and_covers_the_whole_table():
    assert SNAPSHOT["sglang_version"] == SGLANG_VERSION
    assert set(SNAPSHOT["surface"]) == {f"{t.module}:{t.qualname}" for t in SURFACE}
    assert surface_problems(SNAPSHOT["surface"]) == []


@pytest.mark.skipif(_sglang_source() is None, reason="no SGLang source here: set DWISE_SGLANG_SRC to an unpacked "
                    "sglang==0.5.23 wheel (see scripts/snapshot_sglang_surface.py) to check the real source")
def test_real_pinned_source_has_every_patched_function_and_attribute():
    root = _sglang_source()
    found = read_surface(root)
    assert surface_problems(found) == []
    assert found == SNAPSHOT["surface"], "the snapshot is stale: rerun scripts/snapshot_sglang_surface.py"


def test_surface_check_catches_a_changed_signature_and_a_missing_attribute(tmp_path):
    pkg = tmp_path / "sglang" / "srt" / "dllm" / "algorithm"
    pkg.mkdir(parents=True)
    (pkg / "base.py").write_text("class DllmAlgorithm:\n    def run(self, runner, forward_batch):\n        pass\n")
    problems = surface_problems(read_surface(tmp_path))
    assert "sglang.srt.dllm.algorithm.base:DllmAlgorithm.run takes ['self', 'runner', 'forward_batch'], " \
           "expected ['self', 'model_runner', 'forward_batch', 'algo_states'] first" in problems
    assert "sglang.srt.dllm.config:DllmConfig.block_size is missing" in problems


def _fake_member(touch):
    cls_name, member = touch.qualname.split(".", 1)
    module = sglang_fake.resolve(touch.module)
    return getattr(module, cls_name), member


@pytest.mark.parametrize("touch", [t for t in SURFACE if t.kind != "attribute"], ids=lambda t: t.qualname)
def test_fake_functions_match_the_snapshot_signatures(touch):
    cls, member = _fake_member(touch)
    params = list(inspect.signature(getattr(cls, member)).parameters)
    expected = SNAPSHOT["surface"][f"{touch.module}:{touch.qualname}"]["params"]
    assert params[: len(touch.params)] == expected[: len(touch.params)] == list(touch.params)


@pytest.mark.parametrize("touch", [t for t in SURFACE if t.kind == "attribute"], ids=lambda t: t.qualname)
def test_fake_instances_have_the_snapshot_attributes(touch):
    cls, member = _fake_member(touch)
    config = sglang_fake.DllmConfig("LowConfidence", {}, 8, 0, 4)
    instances = {
        "DllmConfig": config,
        "DllmManager": sglang_fake.DllmManager(config),
        "SchedulerDllmMixin": sglang_fake.Scheduler(config, 2, 1000),
        "Scheduler": sglang_fake.Scheduler(config, 2, 1000),
        "Req": sglang_fake.Req("r", [1] * 8, None, config, [1], [0.0], (1, 0, 8)),
    }
    owner = instances.get(cls.__name__, cls)
    assert hasattr(owner, member), f"fake {cls.__name__} lacks {member}"
