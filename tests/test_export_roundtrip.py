"""Round trip: train -> export -> verify and publish -> pull -> a fresh process with only onnxruntime
and numpy reproduces the run's Spearman rho on the eval split."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.traces.synthetic import make_synthetic_traces

# Runs in a fresh interpreter: checks every sha256 with hashlib, runs both ONNX graphs, ranks with
# numpy. Nothing of dwise_predict, torch, lightgbm or scipy is imported.
CONSUMER = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    import numpy as np
    import onnxruntime as ort

    bundle, data = Path(sys.argv[1]), Path(sys.argv[2])
    manifest = json.loads((bundle / "bundle.json").read_text())
    for name, entry in manifest["files"].items():
        if hashlib.sha256((bundle / name).read_bytes()).hexdigest() != entry["sha256"]:
            sys.exit(f"{name} fails its sha256")

    def load(name):
        return np.load(data / f"{name}.npy", allow_pickle=False)

    def ranks(x):  # average ranks for ties, as scipy.stats.rankdata
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=r)
        return (sums / counts)[inverse]

    def spearman(a, b):
        return float(np.corrcoef(ranks(a), ranks(b))[0, 1])

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    refine = ort.InferenceSession(str(bundle / "refine.onnx"), opts, providers=["CPUExecutionProvider"])
    admission = ort.InferenceSession(str(bundle / "admission.onnx"), opts, providers=["CPUExecutionProvider"])
    remaining = refine.run(None, {"first_round": load("first_round"), "prompt_last": load("prompt_last"),
                                  "prompt_tokens": load("prompt_tokens"), "budget": load("budget"),
                                  "early_signals": load("early_signals")})[0]
    total = admission.run(None, {"features": load("features")})[0]
    truth = load("total_rounds")
    banned = [m for m in ("torch", "lightgbm", "sklearn", "scipy", "pandas", "dwise_predict") if m in sys.modules]
    print(json.dumps({"refined": spearman(remaining, truth - 1), "admission": spearman(total, truth),
                      "banned": banned}))
    """
)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from dwise_predict.training import TrainConfig, train_run

    traces = make_synthetic_traces(n_requests=400, hidden_size=32, seed=0)
    run = tmp_path_factory.mktemp("runs") / "synthetic"
    train_run(traces, run, TrainConfig(max_epochs=30, bootstrap=0, num_threads=1))
    return traces, run


def test_train_export_verify_publish_pull_reproduces_rho(trained_run, tmp_path, capsys):
    traces, run = trained_run
    bundle, zoo, pulled = tmp_path / "bundle", tmp_path / "zoo", tmp_path / "elsewhere" / "pulled"
    assert main(["export", str(run), "--out", str(bundle), "--name", "synthetic-tiny"]) == 0
    # publish verifies first (exports.verify.require_verified: what `dwise-predict verify` runs) and
    # refuses a bundle that fails; the verify command's own exit code is test_export_verify's
    assert main(["publish", str(bundle), "--zoo", str(zoo)]) == 0
    assert main(["zoo", "pull", "synthetic-tiny@1", "--zoo", str(zoo), "--out", str(pulled)]) == 0
    capsys.readouterr()

    evaluation = traces.split("eval")
    data = tmp_path / "eval"
    data.mkdir()
    r = evaluation.requests
    arrays = {
        "first_round": evaluation.first_round,
        "prompt_last": evaluation.prompt_last,
        "prompt_tokens": r["prompt_tokens"].to_numpy(np.float32),
        "budget": r["budget"].to_numpy(np.float32),
        "early_signals": evaluation.early_signals,
        "features": r[["words", "newlines", "prompt_tokens"]].to_numpy(np.float32),
        "total_rounds": r["total_rounds"].to_numpy(np.float64),
    }
    for name, array in arrays.items():
        np.save(data / f"{name}.npy", np.ascontiguousarray(array))
    done = subprocess.run([sys.executable, "-I", "-c", CONSUMER, str(pulled), str(data)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["banned"] == []
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["refined"]["spearman"] > 0.5  # the hidden state carries the difficulty
    assert abs(got["refined"] - metrics["refined"]["spearman"]) < 1e-3
    assert abs(got["admission"] - metrics["admission"]["spearman"]) < 1e-3
