"""The drift scenario's quality side, end to end at CI's size (``scripts/drift_scenario.py --smoke``):
traffic of instructions, code and multiple choice, then a shift to math and harder multiple choice.

On the tiny dLLM's traces the predictor trained before the shift (``drift@1``) ranks its own
traffic's held-out requests well and the new traffic about at chance: the replayed live monitor
shows the drop. ``refresh`` on the after-shift "recording" publishes ``drift@2``, whose refined ρ on
the requests refresh held out is far above ``drift@1``'s on the same requests. Measured over seeds
0, 1, 2 at this size (2026-12): before 0.75-0.93, after -0.23 to -0.02; on the held-out requests
drift@1 -0.30 to -0.09, drift@2 0.82-0.90; refresh's refined-ρ interval's lower bound 0.68-0.95. The
margins asserted below are about half of the smallest effect seen.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLEAR_MARGIN = 0.4  # refined ρ: the drop, and v2's gain over v1 on the same requests


def _script():
    spec = importlib.util.spec_from_file_location("drift_scenario", ROOT / "scripts" / "drift_scenario.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """The smoke scenario run once in this process (torch and the training stack imported once):
    its exit code, stdout, drift.json and directory."""
    import contextlib
    import io

    script, out = _script(), tmp_path_factory.mktemp("drift") / "scenario"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = script.main(["--out", str(out), "--smoke", "--seed", "0"])
    record = json.loads((out / "drift.json").read_text()) if code == 0 else None
    return {"script": script, "code": code, "stdout": printed.getvalue(), "record": record, "out": out}


def test_the_monitor_shows_the_drop_and_refresh_restores_it(scenario, record_property):
    from dwise_predict.bundles.zoo import list_entries

    assert scenario["code"] == 0, scenario["stdout"]
    record, out = scenario["record"], scenario["out"]
    record_property("figures", "drift scenario (scripts/drift_scenario.py --smoke --seed 0):\n" + scenario["stdout"])
    phases = {p["key"]: p for p in record["phases"]}
    assert list(phases) == ["v1_before", "v1_after", "v1_after_held_out", "v2_after_held_out"]
    assert record["requests"] == {"before": 108, "after": 210}
    assert phases["v1_before"]["requests"] == 36  # 12 eval requests of each of the 3 categories
    assert phases["v1_after"]["requests"] == 210
    assert set(phases["v1_after"]["categories"]) == {"math", "multilingual_math", "hard_mcq"}

    # the drop: drift@1 ranks its own traffic, not the new one
    before, after = phases["v1_before"]["refined_rho"], phases["v1_after"]["refined_rho"]
    assert before > 0.6
    assert after < before - CLEAR_MARGIN

    # refresh publishes drift@2, its refined-ρ interval above 0, and the zoo holds 1 and 2
    refresh = record["refresh"]
    assert refresh["decision"] == "published"
    assert refresh["published"]["name"] == "drift" and refresh["published"]["version"] == "2"
    assert refresh["refined_rho"]["interval"][0] > 0
    assert [e["version"] for e in list_entries(out / "zoo") if e["name"] == "drift"] == ["1", "2"]

    # restored: on the requests refresh held out (never trained on), drift@2 ranks far better
    v1, v2 = phases["v1_after_held_out"], phases["v2_after_held_out"]
    assert v1["requests"] == v2["requests"] == refresh["window"]["held_out"] >= 30
    assert (v1["bundle"], v2["bundle"]) == ("drift@1", "drift@2")
    assert v2["refined_rho"] > v1["refined_rho"] + CLEAR_MARGIN
    assert v2["refined_rho"] > 0.6
    # the replayed monitor and refresh's judgement rank the same requests by two paths: same ρ
    judged = json.loads((out / "refresh" / "refresh.json").read_text())["figures"]
    for side, phase in (("serving", v1), ("candidate", v2)):
        for name in ("admission_rho", "refined_rho", "within_category_rho"):
            assert phase[name] == pytest.approx(judged[side][name], abs=1e-9), (side, name)

    # stdout: one table row per phase, then the decision with its interval
    lines = scenario["stdout"].strip().splitlines()
    assert lines[0].split()[:2] == ["phase", "bundle"] and len(lines) == 6
    assert lines[-1].startswith("refresh: published") and "drift@2" in lines[-1]


def test_a_rerun_with_other_options_is_refused_in_one_line(scenario, capsys):
    assert scenario["code"] == 0
    code = scenario["script"].main(["--out", str(scenario["out"]), "--smoke", "--seed", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.splitlines() == [err] and "holds a drift scenario run with --seed 0 --smoke" in err
    assert json.loads((scenario["out"] / "scenario.json").read_text()) == {"seed": 0, "smoke": True}
