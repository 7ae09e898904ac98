"""``scripts/compare_traces.py``: two collections of the same requests (say CPU and GPU) compared."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from dwise_predict.traces.dataset import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_traces.py"


def compare(*args):
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)
    return result.returncode, result.stdout


def test_it_counts_differing_rounds_and_measures_the_first_round_states(tmp_path):
    """A second copy in another request order, one request decoded to another length, every first-round
    state moved by 1e-5: one request's rounds and tokens differ, the states within the tolerance."""
    base = make_synthetic_traces(n_requests=40, hidden_size=8, seed=0)
    write_traces(base, tmp_path / "a")
    other = make_synthetic_traces(n_requests=40, hidden_size=8, seed=0)
    order = np.arange(len(other))[::-1].copy()
    requests = other.requests.iloc[order].reset_index(drop=True)
    first = other.requests["request_id"].iloc[0]
    changed = (requests["request_id"] == first).to_numpy()
    blocks = [list(x) for x in requests["rounds_per_block"]]
    blocks[int(np.flatnonzero(changed)[0])][-1] += 1  # one more round in its last block
    requests = requests.assign(total_rounds=requests["total_rounds"] + changed, rounds_per_block=blocks)
    other.requests, other.first_round = requests, other.first_round[order] + np.float32(1e-5)
    other.prompt_last = other.prompt_last[order]
    write_traces(other, tmp_path / "b")
    code, out = compare(tmp_path / "a", tmp_path / "b")
    assert code == 0, out
    assert out.startswith("40 requests: rounds differ in 1, output tokens in 0; first-round states |diff| max 1.0"), out
    assert f"  {first}: rounds " in out
    code, out = compare(tmp_path / "a", tmp_path / "b", "--tolerance", "1e-6")
    assert code == 1 and "differ by 1.0" in out, out
