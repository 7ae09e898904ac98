"""``scripts/gpu_smoke_hook.py`` without a GPU: the pieces of its checks that a CPU can run."""

import importlib.util
from pathlib import Path

import pytest

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_smoke_hook.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke_hook", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    return module


def test_batches_land_on_the_next_captured_graph_and_one_runs_eagerly(smoke):
    """As SGLang's decode graph runner: a batch replays the smallest captured size that holds it,
    its rows padded; above the largest it runs eagerly, so the hook's buffer holds that batch too."""
    assert [smoke.padded_size(b, smoke.GRAPH_SIZES) for b in smoke.PADDED_BATCHES] == [4, 24, 136, None]
    assert smoke.padded_size(4, smoke.GRAPH_SIZES) == 4 and smoke.padded_size(1, smoke.GRAPH_SIZES) == 4
    assert smoke.MAX_BATCH == max(smoke.PADDED_BATCHES) == max(smoke.GRAPH_SIZES) + 1


def test_the_padded_batch_check_pools_the_models_block_means_eagerly(smoke, tmp_path):
    """The script's check of batches of 3 and 17 requests (every one in its first denoising forward),
    eagerly on the CPU: the rows the hook records are the model's own first-round block means."""
    import torch

    torch.manual_seed(0)
    model = smoke.TinyModel().eval()
    results = []
    smoke.check_padded_batches(model, lambda name, ok, detail="": results.append((name, ok, detail)), tmp_path,
                               graphs=False, batches=(3, 17))
    assert [(name, ok) for name, ok, _ in results] == [
        ("batch 3: pooled rows equal the model's block means", True),
        ("batch 17: pooled rows equal the model's block means", True)]
    with smoke.hook_syncs() as found:  # nothing synchronises on the CPU: the check counts CUDA calls only
        torch.ones(3).sum().item()
    assert found == []


def test_the_loop_period_comparison_times_both_hooks_and_leaves_the_fake_as_it_found_it(smoke, tmp_path):
    """The script's hook-vs-pass-through comparison on the CPU, small: a row per hook, the hook's
    rows within B with first rounds in its steps, both targets with a verdict; afterwards every
    function it timed or patched is the fake's own again (the script's other checks run on it)."""
    import re

    import torch

    from dwise_predict.serving.sglang.install import PATCHES
    from dwise_predict.serving.sglang.surface import ResolvedSglang

    fake = smoke.fake
    sglang = ResolvedSglang(fake.resolve)
    patched = [(getattr(sglang, owner), name) for owner, name, _ in PATCHES]  # every patch point, abort_request too
    timed = [(fake.FillAlgorithm, "step"), (smoke.GpuRunner, "forward")]
    before = {(cls, name): vars(cls).get(name) for cls, name in patched + timed}
    torch.manual_seed(0)
    lines = smoke.compare_loop_periods(smoke.TinyModel().eval(), tmp_path, slots=4, steps=20, warmup=5)
    assert [line.split()[0] for line in lines[1:3]] == ["pass-through", "dwise"], lines
    number = r"(-?\d+(?:\.\d+)?)"
    dwise = re.search(rf"rows/step\s+{number}\s+first rounds/step\s+{number}", lines[2])
    assert 0 < float(dwise[1]) <= 4 and float(dwise[2]) > 0, lines[2]
    assert re.fullmatch(rf"target loop period mean <= \+1 % over the pass-through: \+?{number} %, (met|MISSED)", lines[3])
    assert re.fullmatch(rf"target loop period p99 <= \+3 % over the pass-through: \+?{number} %, (met|MISSED)", lines[4])
    assert {key: vars(key[0]).get(key[1]) for key in before} == before
