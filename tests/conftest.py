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


@pytest.fixture(scope="session")
def synthetic_traces():
    from dwise_predict.traces.synthetic import make_synthetic_traces

    return make_synthetic_traces(n_requests=480, hidden_size=32, seed=0)
