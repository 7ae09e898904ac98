import os

import pytest
import torch

# Two cores shared by everything: keep each test process to one torch thread.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def synthetic_traces():
    from dwise_predict.traces.synthetic import make_synthetic_traces

    return make_synthetic_traces(n_requests=480, hidden_size=32, seed=0)
