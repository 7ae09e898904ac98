import os

import pytest
import torch
from transformers.utils import logging as transformers_logging

# Two cores shared by everything: keep each test process to one torch thread.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# transformers gives its loggers a handler on whatever sys.stderr is when it first logs: inside a
# test that is capsys's stream, closed afterwards, and every later warning prints a "Logging error"
# traceback into the next test's stderr. Set the handler up now, on the session's stream.
transformers_logging.get_logger("transformers")


def pytest_sessionstart(session):
    """With ``DWISE_REQUIRE_SGLANG=1`` (CI sets it) a missing SGLang source stops the run: the
    checks against SGLang's own code would otherwise all skip and the run would still pass."""
    import sglang_reference

    if os.environ.get("DWISE_REQUIRE_SGLANG") == "1" and not sglang_reference.available():
        raise pytest.UsageError(f"DWISE_REQUIRE_SGLANG=1 but {sglang_reference.SKIP_REASON}")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (``make test``) the work units are those of ``tests/work_units.py``."""
    if config.getvalue("dist") != "loadfile":
        return None
    import work_units

    return work_units.scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker: the longest work units first (``tests/work_units.py``); xdist hands units
    out in this order under ``--no-loadscope-reorder``. A run without xdist keeps the file order."""
    if hasattr(config, "workerinput"):
        import work_units

        items.sort(key=lambda item: work_units.rank(item.nodeid))  # stable: a unit keeps its order


# figures a test reports with ``record_property("figures", text)``: printed after the run, in CI's log
# too (pytest-xdist hands each worker's reports, their user properties included, to this process)
_FIGURES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _FIGURES.extend(str(value) for name, value in report.user_properties if name == "figures")


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("figures the tests measured")
        for text in _FIGURES:
            terminalreporter.write_line(text)


@pytest.fixture(scope="session")
def synthetic_traces():
    from dwise_predict.traces.synthetic import make_synthetic_traces

    return make_synthetic_traces(n_requests=480, hidden_size=32, seed=0)


@pytest.fixture(scope="session")
def loco_evaluation(tmp_path_factory):
    """``evaluate --loco`` in this process (fast config) of ``evaluate_helpers.make_traces()``, written to a
    folder: ``(traces directory, Evaluation)``. Read, never changed, by test_evaluate_loco (its known
    answers) and test_evaluate_ablate (the reference a resumed evaluation must reproduce), so the
    ~7 retrainings run once per test process."""
    from dwise_predict.evaluation.evaluate import evaluate
    from evaluate_helpers import fast_config, make_traces, write

    traces = write(make_traces(), tmp_path_factory.mktemp("loco") / "traces")
    return traces, evaluate([traces], loco=True, jobs=1, config=fast_config())
