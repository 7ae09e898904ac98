"""One real bundle per test process for the serving tests: a hand-built run exported by `export_bundle`.

Built once (about 5 s) into a temporary directory, reused, and removed when the test process exits;
tests that modify a bundle copy it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

HIDDEN = 32


@functools.lru_cache(maxsize=1)
def served_bundle() -> tuple[Path, object]:
    """(bundle directory, the synthetic traces it was trained on)."""
    from export_helpers import make_run

    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.traces.synthetic import make_synthetic_traces

    root = Path(tempfile.mkdtemp(prefix="dwise-serving-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    traces = make_synthetic_traces(n_requests=400, hidden_size=HIDDEN, seed=0)
    run = make_run(root / "run", traces=traces)
    bundle = export_bundle(run, root / "bundle", created="2026-01-01T00:00:00+00:00")
    return bundle, traces
