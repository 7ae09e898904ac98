"""Fixtures of the live tests: SGLang's environment, the tiny SDAR model and the bundles built for it.

Without ``.venv-sglang`` (``make sglang-env``) every live test is skipped, with the reason; under
``DWISE_REQUIRE_SGLANG=1`` (CI) each fails instead, so a CI run without SGLang's server cannot pass.
The model and bundles are built once per test session and, under pytest-xdist, once for all its
workers (:func:`shared`): each worker would otherwise spend ~30 s of the 2 shared cores on its own copy.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from functools import partial
from pathlib import Path

import pytest

import live_server
import tiny_sdar


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    """``.venv-sglang``, or the test skipped (failed under ``DWISE_REQUIRE_SGLANG=1``)."""
    if not live_server.venv_ready():
        if os.environ.get("DWISE_REQUIRE_SGLANG") == "1":
            pytest.fail(f"DWISE_REQUIRE_SGLANG=1 but {live_server.MISSING}", pytrace=False)
        pytest.skip(live_server.MISSING)
    return live_server.VENV


def shared(tmp_path_factory, name: str, build) -> Path:
    """``build(path)`` once per session, its result at a path all xdist workers of the session share
    (the parent of each worker's base temp directory); the first worker builds under a lock, the
    others wait for it and reuse the result."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    done = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            building = root / f"{name}.partial"
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir()
            build(building / name)
            (building / name).rename(done)
            shutil.rmtree(building)
    return done


@pytest.fixture(scope="session")
def tiny_model(sglang_venv, tmp_path_factory) -> Path:
    """The tiny random SDAR checkpoint and its tokenizer (``tiny_sdar``), seed 0."""
    return shared(tmp_path_factory, "tiny-sdar", tiny_sdar.write_model)


@pytest.fixture(scope="session")
def ranking_bundle(tiny_model, tmp_path_factory) -> Path:
    """A bundle for the tiny model whose admission ranks longest prompt first (``live_bundle``)."""
    import live_bundle

    return shared(tmp_path_factory, "ranking-bundle", partial(live_bundle.write_bundle, model_dir=tiny_model,
                                                               hidden=tiny_sdar.HIDDEN, block_size=tiny_sdar.BLOCK))


@pytest.fixture(scope="session")
def narrow_bundle(tiny_model, tmp_path_factory) -> Path:
    """A bundle of hidden size 32 (the model's is 64) that names no model config, as a bundle trained
    on a live recording: only its width tells it is not this model's."""
    import live_bundle

    return shared(tmp_path_factory, "narrow-bundle", partial(live_bundle.write_bundle, model_dir=None,
                                                              hidden=tiny_sdar.HIDDEN // 2, block_size=tiny_sdar.BLOCK))


@pytest.fixture(scope="session")
def stale_bundle(tiny_model, tmp_path_factory) -> Path:
    """A bundle for the tiny model, trained on traffic where rounds fell with the budget (``live_bundle``):
    stale for the live server's traffic, where they rise with it."""
    import live_bundle

    return shared(tmp_path_factory, "stale-bundle", partial(live_bundle.write_stale_bundle, model_dir=tiny_model,
                                                             hidden=tiny_sdar.HIDDEN, block_size=tiny_sdar.BLOCK))
