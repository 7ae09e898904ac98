"""How `make test` shares the suite between its pytest-xdist workers (``--dist loadfile``).

xdist hands out work units in collection order (``--no-loadscope-reorder``), each to the first
worker that is free, and a unit runs whole on one worker. One unit per test file, as ``--dist
loadfile`` makes them, builds each module fixture once; :data:`UNITS` changes that where it pays:

- a file with a few long tests that share no costly fixture is cut into several units, so that no
  unit outlasts a worker's share of the suite;
- files that read the same session fixture (``conftest.loco_evaluation``) go together, so it is
  built once.

:data:`FIRST` starts the longest units first (the longest-processing-time rule): on two workers a
long unit started last leaves the other worker idle at the end. The order comes from the seconds
each unit took in a whole run on the idle 2-core machine (2026-12-03: 696 s of tests over the two
workers, 380 s in all); a unit missing from it runs after them in file order, and a test or file
renamed here only falls back to its file's unit, so nothing is ever left out.

The conftest applies both: :func:`scheduler` replaces xdist's ``loadfile`` scheduler (its units
are files), and workers collect in :func:`rank` order. Why not ``--dist loadgroup`` with
``xdist_group`` marks: pytest-xdist 3.8 groups by rewriting ``item._nodeid``, which pytest 9.2 no
longer reads (``Node.nodeid`` comes from ``Node._id``), so the marks group nothing.
"""

from __future__ import annotations

# unit name -> its members: a file name, or "file::test" (a test with all its parametrizations)
UNITS = {
    "faults: evaluate killed at renames": ("test_faults.py::test_evaluate_killed_at_renames_leaves_a_whole_report",),
    "faults: extending a collect": (
        "test_faults.py::test_extending_a_finished_collect_reads_as_incomplete_until_it_finishes",),
    "evaluate: across-set tables, LOCO": ("test_evaluate_ablate.py", "test_evaluate_loco.py"),
    "evaluate: ablations": (
        "test_evaluate_ablate.py::test_train_size_and_seeds_ablations",
        "test_evaluate_ablate.py::test_cli_ablate_inputs_finds_the_first_round_signal_and_names_the_winner"),
}

# units started first, longest first (wall seconds in a whole run on the idle 2-core machine, both
# workers busy; 2026-12-03, 380 s in all)
FIRST = (
    # SGLang's real server (tests/live/, skipped without .venv-sglang): measured alone on the shared, busy
    # 2-core machine on 2026-12-05, each a server start (~22 s idle, 30-100 s busy) and its requests
    "test_live_refresh.py",  # ~180 alone (2026-12-05): a server, 360 requests, a refresh trained while it serves
    "test_live_plugin.py",  # ~120 (two DP ranks)
    "test_live_serve.py",  # ~80
    "test_live_refusals.py",  # ~75 (four starts, each refused before the model loads)
    "test_live_engine.py",  # ~55
    "test_faults.py",  # ~72 (the tests left after the two cut out)
    "test_train_select.py",  # ~62
    "evaluate: across-set tables, LOCO",  # ~57
    "test_engine_conformance.py",  # ~43
    "test_benchmarks.py",  # ~39 on the busy machine, 2026-12-05 (every benchmark's --smoke, one process)
    "test_quickstart.py",  # ~34
    "test_simulate_retrain.py",  # ~25 estimated (37 alone at load 5, 2026-12-05): 14 retrainings, a bundle, two CLI runs
    "faults: evaluate killed at renames",  # ~29
    "test_collect_kill.py",  # ~29
    "evaluate: ablations",  # ~26
    "test_hostile_bundles.py",  # ~25
    "test_drift_scenario.py",  # ~24 alone on the busy machine, 2026-12 (collect, train, publish, refresh: --smoke)
    "test_bad_inputs.py",  # ~22
    "test_train_objective.py",  # ~21
    "test_zoo.py",  # ~21
    "test_serving_sglang_adapter.py",  # ~20
    "test_export_verify.py",  # ~19
    "faults: extending a collect",  # ~18
    "test_packaging.py",  # ~16
    "test_train_run.py",  # ~13
    "test_progress_lines.py",  # ~13 alone on the busy machine, 2026-12-05 (three trainings, an evaluation)
    "test_batch_formers.py",  # ~13 on the busy machine, 2026-12-05 (simulate on both batch formers with Table 12)
    "test_serving_plugin.py",  # ~12
    "test_d2f.py",  # ~12 estimated (21 alone at load 4, 2026-12-05): D2F scripted, on the tiny dLLM, collect + characterize
    "test_serving_lifecycle.py",  # ~12
)

_MEMBER_OF = {member: unit for unit, members in UNITS.items() for member in members}


def work_unit(nodeid: str) -> str:
    """The unit of the test ``nodeid`` (``tests/test_x.py::test_y[params]``)."""
    path, _, test = nodeid.partition("::")
    file_name = path.rsplit("/", 1)[-1]
    return _MEMBER_OF.get(f"{file_name}::{test.split('[', 1)[0]}") or _MEMBER_OF.get(file_name) or file_name


def rank(nodeid: str) -> int:
    """Where the unit of the test ``nodeid`` starts: its place in :data:`FIRST`, or after all of them."""
    unit = work_unit(nodeid)
    return FIRST.index(unit) if unit in FIRST else len(FIRST)


def scheduler(config, log):
    """xdist's ``loadfile`` scheduler with these work units in place of files."""
    from xdist.scheduler import LoadFileScheduling

    class WorkUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)
