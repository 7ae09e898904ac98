"""The distribution a user installs: ``python -m build`` makes an sdist and, from it, a wheel that
installs into a new virtual environment and runs, its shipped weights and presets inside it.

The new environment borrows this one's dependencies through a ``.pth`` line (a fresh install of torch
and the rest is what ``make install`` already does on every CI run); the package itself comes only
from the wheel, so a file the sdist or the wheel leaves out fails here, not on a user's machine.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _new_environment(env: Path) -> Path:
    """A new virtual environment that borrows this one's dependencies; its python."""
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_sdist_and_wheel_install_in_a_new_environment_and_run(tmp_path):
    dist = tmp_path / "dist"
    # no isolation: the build backend is this environment's setuptools (a dev dependency), so the
    # test needs no network; without --sdist/--wheel, build makes the wheel from the sdist
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    assert "deprecat" not in (built.stdout + built.stderr).lower()
    sdist, = dist.glob("dwise_predict-*.tar.gz")
    wheel, = dist.glob("dwise_predict-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "dwise_predict/dllm/weights/model.safetensors" in names
    assert any(n.startswith("dwise_predict/collectors/presets/") and n.endswith(".toml") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "dwise-predict = dwise_predict.cli.app:main" in entry_points
    assert "dwise = dwise_predict.serving.plugin:register" in entry_points
    assert not any(n.startswith("tests/") for n in names)

    env = tmp_path / "env"
    python = _new_environment(env)
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                                "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]

    # run from tmp_path, so the repository's own dwise_predict/ is nowhere on the path
    helped = subprocess.run([str(env / "bin" / "dwise-predict"), "quickstart", "--help"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--out" in helped.stdout
    where = subprocess.run([str(python), "-c", "from dwise_predict.dllm import TINY_MODEL_DIR as d; "
                            "print(d.resolve(), (d / 'model.safetensors').stat().st_size)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert Path(where[0]).is_relative_to(env.resolve()) and int(where[1]) > 0
    assert sdist.stat().st_size > 0


@pytest.mark.slow
def test_editable_install_warns_of_nothing_of_ours(tmp_path):
    """`make install`'s `pip install -e .`: setuptools warns on every editable install of a project
    whose package root it has to guess (it then installs an import finder); pyproject.toml names it."""
    env = tmp_path / "env"
    python = _new_environment(env)
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "--no-build-isolation", "-e", str(ROOT)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    # this machine's pip configuration names find-links folders that may be absent: pip's, not ours
    said = [line for line in (installed.stdout + installed.stderr).splitlines()
            if not (line.startswith("WARNING: Location") and line.endswith("is neither a file nor a directory."))]
    assert not [line for line in said if "warning" in line.lower() or "deprecat" in line.lower()], said
    where = subprocess.run([str(python), "-c", "import dwise_predict; print(dwise_predict.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == ROOT / "dwise_predict" / "__init__.py"
