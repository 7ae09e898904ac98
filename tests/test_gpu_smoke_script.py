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
    timed = [(smoke.DeviceFillAlgorithm, "step"), (smoke.GpuRunner, "forward")]
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


def test_the_device_fill_step_fills_the_positions_the_fakes_loop_fills(smoke):
    """The script's tensor version of the fake algorithm's step (one host read a step) fills the same
    positions, reports the same finished rows and counts the same fills as the fake's per-row loop, over
    rows with no, some and every position masked and requests at different forwards of their block."""
    import copy
    from types import SimpleNamespace

    import torch

    fake = smoke.fake
    config = fake.config(8, 8)
    rng = torch.Generator().manual_seed(0)
    reqs = []
    for i, plan in enumerate(([3, 3], [1], [5, 2], [2, 4], [4], [6, 1])):
        req = fake.Req(f"r{i}", [100 + i], SimpleNamespace(max_new_tokens=64), config, plan, None, None)
        req.blocks_done, req.fills = i % 2, i % 3
        reqs.append(req)
    ids = torch.randint(1, 50, (len(reqs), 8), generator=rng)
    ids[torch.rand(len(reqs), 8, generator=rng) < 0.6] = fake.MASK
    ids[0], ids[1, :5] = 50, fake.MASK  # a row with nothing masked; a row masked at its start only
    results = []
    for algorithm in (fake.FillAlgorithm(config), smoke.DeviceFillAlgorithm(config)):
        batch = SimpleNamespace(batch_size=len(reqs), input_ids=ids.clone().reshape(-1), reqs=copy.deepcopy(reqs))
        done = algorithm.step(batch, None, None)
        results.append((batch.input_ids.tolist(), done, [r.fills for r in batch.reqs]))
    assert results[0] == results[1]
    assert results[0][1][0] is True and results[0][1][1:] == [False] * 5  # only the unmasked row is done
    assert results[0][0] != ids.reshape(-1).tolist()  # positions were filled


def test_the_loop_period_comparison_refines_with_a_bundle_when_given_one(smoke, tmp_path):
    """``--bundle``: the hook of the timed loop refines with the bundle (its refinement runs, the
    admission model ranks every arrival), and the figures compare per row and as the hook's share."""
    import re
    import sys

    import torch

    sys.path.insert(0, str(SCRIPT.parent.parent / "tests" / "live"))
    import live_bundle

    live_bundle.write_bundle(tmp_path / "bundle", None, 32, smoke.BS)
    bundle = smoke.period_bundle(["--bundle", str(tmp_path / "bundle")])
    torch.manual_seed(0)
    lines = smoke.compare_loop_periods(smoke.TinyModel(32).eval(), tmp_path, slots=4, steps=12, warmup=3, bundle=bundle)
    assert lines[0].endswith("refining with a bundle"), lines[0]
    assert re.fullmatch(r"figure loop period per row: pass-through [\d.]+ µs, dwise [\d.]+ µs \([+-][\d.]+ %\); "
                        r"the hook's own time \d+ µs a step, [\d.]+ % of the dwise loop period", lines[5]), lines[5]
    parts = dict(re.findall(r"([\w.]+) (\d+)", lines[6].split(":", 1)[1]))
    assert int(parts["refine"]) > 0 and int(parts["register"]) > 0, lines[6]
