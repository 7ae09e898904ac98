"""The SGLang surface the adapter patches: real pinned source (when present), snapshot, and fake agree."""

import importlib.util
import inspect
import json
from pathlib import Path

import numpy as np
import pytest

import sglang_reference
from dwise_predict.serving.sglang import SGLANG_VERSION, SURFACE, read_surface, surface_problems
from fetch_sglang import is_complete, source_root

SNAPSHOT = json.loads((Path(__file__).parent / "fakes" / "sglang_surface.json").read_text())
NOT_FAKED = {"sglang.srt.entrypoints.engine"}  # the launcher's entry point: tested with a spawned child instead


def _sglang_source() -> Path | None:
    """The unpacked wheel (``scripts/fetch_sglang.py``, which CI runs; ``$DWISE_SGLANG_SRC`` overrides
    its place), else an installed ``sglang``."""
    if is_complete(source_root()):
        return source_root()
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent.parent
    return None


def test_snapshot_is_of_the_pinned_release_and_covers_the_whole_table():
    assert SNAPSHOT["sglang_version"] == SGLANG_VERSION
    assert set(SNAPSHOT["surface"]) == {f"{t.module}:{t.qualname}" for t in SURFACE}
    assert surface_problems(SNAPSHOT["surface"]) == []


@pytest.mark.skipif(_sglang_source() is None, reason=sglang_reference.SKIP_REASON)
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
    from fakes import sglang_fake

    cls_name, member = touch.qualname.split(".", 1)
    module = sglang_fake.resolve(touch.module)
    return getattr(module, cls_name), member


FAKED = [t for t in SURFACE if t.module not in NOT_FAKED]
needs_wheel = pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)


@needs_wheel
@pytest.mark.parametrize("touch", [t for t in FAKED if t.kind != "attribute"], ids=lambda t: t.qualname)
def test_fake_functions_match_the_snapshot_signatures(touch):
    cls, member = _fake_member(touch)
    params = list(inspect.signature(getattr(cls, member)).parameters)
    expected = SNAPSHOT["surface"][f"{touch.module}:{touch.qualname}"]["params"]
    assert params[: len(touch.params)] == expected[: len(touch.params)] == list(touch.params)


@needs_wheel
@pytest.mark.parametrize("touch", [t for t in FAKED if t.kind == "attribute"], ids=lambda t: t.qualname)
def test_fake_instances_have_the_snapshot_attributes(touch):
    from fakes import sglang_fake

    cls, member = _fake_member(touch)
    config = sglang_fake.config(8, 4)
    req = sglang_fake.Req("r", [1] * 8, None, config, [2], np.zeros(2, np.float32), (1, 0, 8))
    scheduler = sglang_fake.Scheduler(config, 2, 1000)
    instances = {
        "DllmConfig": config,
        "DllmManager": sglang_fake.DllmManager(config),
        "FakeDllmMixin": scheduler,  # the fake's SchedulerDllmMixin
        "Scheduler": scheduler,
        "Req": req,
        "ReqDllmMixin": req,  # SGLang's own mixin, through the fake's Req
        "ScheduleBatch": sglang_fake.ScheduleBatch([req], sglang_fake.ForwardMode.DLLM_EXTEND),
        "PrefillAdder": scheduler._create_prefill_adder(scheduler.running_batch),  # SGLang's, from the wheel
        "GroupCoordinator": scheduler.dp_tp_group,
        "AbortReq": sglang_fake.AbortReq(rid="r"),
        "DllmAlgorithm": sglang_fake.FillAlgorithm(config),
        "ForwardBatch": sglang_fake.ForwardBatch(sglang_fake.ScheduleBatch([req], sglang_fake.ForwardMode.DLLM_EXTEND)),
        "ModelRunner": sglang_fake.ModelRunner(8, 4),
        "ModelConfig": sglang_fake.ModelConfig({0}),
        "ReqToTokenPool": scheduler.req_to_token_pool,
        "SamplingParams": sglang_fake.SamplingParams(8, {"dwise_category": "code"}),
        "SchedulerMetricsCollector": sglang_fake.SchedulerMetricsCollector({"tp_rank": 0}),
    }
    owner = instances.get(cls.__name__, cls)
    assert hasattr(owner, member), f"fake {cls.__name__} lacks {member}"
