"""The whole pipeline on the built-in tiny dLLM, in one call: the newcomer's first five minutes.

collect → train → evaluate (with leave-one-category-out) → export → verify → simulate, each stage
writing into its own folder under ``out``; the simulation's section (its tables, plots and the
speed-up with what it assumed) is then added to the evaluation's ``report/report.html`` and
``report.md``, the page a newcomer opens. Every stage finishes by renaming its output into place,
and counts as done only when every file it writes is there (:data:`STAGE_FILES`) and it was made
from the same traces, options and code as this call would use (its stamp in ``out/stages.json``:
the traces' fingerprint, the options of :data:`STAGE_OPTIONS` and
:func:`~dwise_predict.versions.source_fingerprint`). So an interrupted quickstart resumes at the
first stage whose output is missing, partial or stale, and redoes every stage after it; ``collect``
itself resumes mid-stage from its shards, and its trace store refuses another seed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.files import atomic_write_text, read_json_object
from dwise_predict.versions import source_fingerprint

STAGES = ("collect", "train", "evaluate", "export", "verify", "simulate")
# what each resumable stage leaves in its folder; the stage is redone unless all of it is there
STAGE_FILES = {
    "run": ("config.json", "metrics.json", "admission.txt", "refine.safetensors", "refine.json", "calibration.json"),
    "report": ("evaluation.json", "metrics.json", "predictions.parquet", "report.html", "report.md"),
    "bundle": ("bundle.json", "README.md", "admission.onnx", "refine.onnx", "refine.pt"),
}
# the quickstart options each resumable stage's output depends on, beside the traces and the code
# (``jobs`` changes only the wall time; ``slots``, ``k`` only the simulation, which is always redone,
# and its section of the report, always replaced)
STAGE_OPTIONS = {"run": ("seed", "max_epochs"), "report": ("seed", "max_epochs", "loco"), "bundle": ()}
STAMPS = "stages.json"
# no round-cost profile: a prompt block costs a round what a denoising block does, which favours
# mixing them most (an upper bound on the gain; docs/results.md)
ROUND_COST_WORDS = "the default, no profile"


@dataclass(frozen=True)
class QuickstartConfig:
    """What the quickstart runs; the defaults are the README's first command.

    limit : requests of the ``tiny-default`` workload to collect (None: all of it).
    max_epochs : cap on each survival member's epochs (None: the training default).
    loco : evaluate leave-one-category-out (the slowest stage after collect).
    slots, k : simulated server, B block slots and resident multiplier k (Algorithm 1).
    """

    limit: int | None = None
    seed: int = 0
    max_epochs: int | None = None
    loco: bool = True
    jobs: int | None = None
    slots: int = 16
    k: float = 4.0


def stage_paths(out: Path) -> dict[str, Path]:
    return {
        "traces": out / "traces",
        "run": out / "run",
        "report": out / "report",
        "bundle": out / "bundle",
        "simulate": out / "simulate",
    }


def run_quickstart(
    out: str | os.PathLike,
    config: QuickstartConfig | None = None,
    log: Callable[[str], None] | None = None,
    collect_progress=None,
) -> dict:
    """Run every stage that has no finished output yet; return the summary (also ``out/summary.json``).

    Parameters
    ----------
    out : folder receiving ``traces/``, ``run/``, ``report/``, ``bundle/``, ``simulate/``.
    log : called with one line as each stage starts (the CLI sends them to stderr).
    collect_progress : per-request callback of :func:`dwise_predict.collectors.collect.collect`.
    """
    from dwise_predict.collectors.collect import collect
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.collectors.store import mixed_sources_note
    from dwise_predict.traces import load_traces
    from dwise_predict.training import TrainConfig

    config = config or QuickstartConfig()
    log = log or (lambda line: None)
    out = Path(out)
    paths = stage_paths(out)

    log(f"{_label('collect')}: tiny dLLM on the tiny-default workload → {paths['traces']}")
    collect("tiny", "tiny-default", paths["traces"], DecodingConfig(), seed=config.seed, limit=config.limit,
            progress=collect_progress)
    ds = load_traces(paths["traces"])
    if note := mixed_sources_note(paths["traces"], ds.manifest):
        log(f"    {note}")
    stages = _Stages(out, paths, config, ds.data_hash(), log)

    epochs = {} if config.max_epochs is None else {"max_epochs": config.max_epochs}
    train_config = TrainConfig(seed=config.seed, **epochs)
    metrics = _train_stage(stages, ds, paths, train_config, log)
    evaluation = _evaluate_stage(stages, paths, config, train_config, log)
    verified = _export_stage(stages, paths, log)
    rows, sim_config = _simulate_stage(ds, paths, config, log)
    simulated = {"slots": sim_config.slots, "k": sim_config.k, "round_ms": sim_config.round_ms,
                 "slot_ms": sim_config.slot_ms, "round_cost": ROUND_COST_WORDS}
    _add_scheduling_section(paths, speedup_lines(_speedups(rows), simulated))
    summary = _summary(paths, metrics, evaluation, rows, verified, simulated)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def speedup_lines(speedups: dict[str, float], simulated: dict) -> list[str]:
    """The simulated speed-up of DWISE (refined) over SGLang's default per arrival pattern, each line
    naming its simulation (B, k, round cost), then what that round cost assumes; [] without a figure.

    Parameters
    ----------
    speedups : arrival pattern -> speed-up (the summary's ``speedup_vs_sglang_default``).
    simulated : the summary's ``simulated`` (``slots``, ``k``, ``round_ms``, ``slot_ms``).
    """
    if not speedups:
        return []
    lines = [f"Simulated mean-latency speed-up of DWISE (refined) over SGLang's default: {speedup:.2f}x "
             f"({arrival} arrivals, B = {simulated['slots']}, k = {simulated['k']}, round cost: {ROUND_COST_WORDS})"
             for arrival, speedup in speedups.items()]
    return [*lines, f"(B = {simulated['slots']}, a round {simulated['round_ms']:g} ms + {simulated['slot_ms']:g} ms a "
                    "block, prompt or denoising alike: an upper bound; with a measured round-cost profile the gain "
                    "is smaller, see docs/results.md)"]


def _speedups(rows: list[dict]) -> dict[str, float]:
    """Arrival pattern -> mean-latency speed-up of DWISE (refined) over SGLang's default."""
    return {r["arrival"]: r["speedup_vs_default"] for r in rows if r["policy"] == "dwise-refined"}


def _label(stage: str) -> str:
    """``[i/N] stage``: the stage's place in :data:`STAGES`, as each stage's log line starts."""
    return f"[{STAGES.index(stage) + 1}/{len(STAGES)}] {stage}"


def _train_stage(stages: _Stages, ds, paths: dict[str, Path], train_config, log: Callable[[str], None]) -> dict:
    """Train both predictors into ``run/`` unless a finished run of the same inputs is there; its metrics."""
    from dwise_predict.training import train_run

    log(f"{_label('train')}: admission LightGBM + refinement predictor (candidate chosen out of fold on the ranking of all requests) → {paths['run']}")
    if stages.redo("run"):
        train_run(ds, paths["run"], train_config, overwrite=True)
        stages.finished("run")
    return read_json_object(paths["run"] / "metrics.json", ConfigError, fix=f"delete {paths['run']} to redo it")


def _evaluate_stage(stages: _Stages, paths: dict[str, Path], config: QuickstartConfig, train_config,
                    log: Callable[[str], None]) -> dict:
    """Evaluate the run into ``report/`` unless a finished report of the same inputs is there; its
    ``evaluation.json``."""
    from dwise_predict.evaluation.evaluate import claim_evaluation_out, evaluate, write_evaluation
    from dwise_predict.evaluation.pool import kept_results_dir

    log(f"{_label('evaluate')}: held-out categories, baselines, report → {paths['report']}")
    if stages.redo("report"):
        with claim_evaluation_out(paths["report"], [paths["traces"]], paths["run"]):
            evaluation = evaluate([paths["traces"]], run=paths["run"], loco=config.loco, jobs=config.jobs,
                                  config=train_config, log=lambda line: log(f"    {line}"),
                                  kept=kept_results_dir(paths["report"]))
            write_evaluation(evaluation, paths["report"])
        stages.finished("report")
    return read_json_object(paths["report"] / "evaluation.json", ConfigError,
                            fix=f"delete {paths['report']} to redo it")


def _export_stage(stages: _Stages, paths: dict[str, Path], log: Callable[[str], None]) -> bool:
    """Export the run into ``bundle/`` (unless a finished bundle of the same inputs is there), then
    verify it in a fresh process, always; a bundle that fails stops the quickstart."""
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.exports.verify import verify_bundle

    log(f"{_label('export')}: ONNX + TorchScript bundle → {paths['bundle']}")
    if stages.redo("bundle"):
        export_bundle(paths["run"], paths["bundle"], force=True)
        stages.finished("bundle")

    log(f"{_label('verify')}: hashes and parity in a fresh process")
    report = verify_bundle(paths["bundle"])
    if not report.ok:
        raise BundleError(f"{paths['bundle']} failed verification ({report.failed_artifacts()}): "
                          f"run `dwise-predict verify {paths['bundle']}` for the table")
    return report.ok


def _simulate_stage(ds, paths: dict[str, Path], config: QuickstartConfig, log: Callable[[str], None]):
    """Replay the evaluation split under every scheduler into ``simulate/`` (always redone: it is
    quick); the comparison rows and the simulated server."""
    from dwise_predict.bundles.load import load_bundle
    from dwise_predict.simulation.report import write_outputs
    from dwise_predict.simulation.simulator import SimConfig, compare_arrivals, sim_requests_from_traces

    log(f"{_label('simulate')}: replay the eval split under every scheduler → {paths['simulate']}, "
        f"its section → {paths['report'] / 'report.html'}")
    bundle = load_bundle(paths["bundle"], expect_model=ds.model_fingerprint, expect_decoding=ds.decoding)
    sim_config = SimConfig(slots=config.slots, k=config.k, seed=config.seed)
    requests = sim_requests_from_traces(ds, "eval", bundle)
    tails: list[dict] = []
    rows = compare_arrivals(requests, sim_config, ["burst", "burst-poisson"], tails=tails)
    settings = {"slots": config.slots, "k": config.k, "seed": config.seed, "requests": len(requests),
                "round_cost": {**sim_config.cost.as_dict(), "source": ROUND_COST_WORDS}}
    write_outputs(rows, paths["simulate"], "simulate", settings, tails)
    return rows, sim_config


def _add_scheduling_section(paths: dict[str, Path], speedups: list[str]) -> None:
    """Add the scheduling section, rebuilt from what the simulate stage wrote (``simulate.json``, its
    plots) and opened by the ``speedups`` lines, to the evaluation's report; it replaces the section an
    earlier run added, so a resumed quickstart's report is the same as an uninterrupted one's."""
    from dwise_predict.evaluation.document import Section, add_sections
    from dwise_predict.simulation.report import simulation_section

    folder = paths["simulate"]
    saved = read_json_object(folder / "simulate.json", ConfigError, fix=f"delete {folder} to redo it",
                             allow_nan=True)  # an undefined ρ is NaN
    pngs = {stem: (folder / f"{stem}.png").read_bytes() for stem in ("simulate", "simulate_categories")
            if (folder / f"{stem}.png").is_file()}
    section = simulation_section(saved, pngs)
    add_sections([Section(section.title, section.text, [*speedups, *section.blocks])], paths["report"])


def _done(paths: dict[str, Path], stage: str) -> bool:
    return all((paths[stage] / name).is_file() for name in STAGE_FILES[stage])


class _Stages:
    """Which resumable stages to redo: the first one whose files are missing or whose stamp differs
    from this call's, and every one after it (each is made from the one before)."""

    def __init__(self, out: Path, paths: dict[str, Path], config: QuickstartConfig, traces_fingerprint: str,
                 log: Callable[[str], None]):
        self.path, self.paths, self.log = out / STAMPS, paths, log
        self.stamps = (read_json_object(self.path, ConfigError, fix="delete it to redo every stage after collect")
                       if self.path.is_file() else {})
        self.current = {stage: {"traces": traces_fingerprint, "code": source_fingerprint(),
                                **{name: getattr(config, name) for name in options}}
                        for stage, options in STAGE_OPTIONS.items()}
        self.redoing = False

    def redo(self, stage: str) -> bool:
        if self.redoing:
            return True
        stamp, want = self.stamps.get(stage), self.current[stage]
        if not _done(self.paths, stage):
            why = None
        elif stamp is None:
            why = "has no record of what made it (an older dwise-predict)"
        else:
            changed = [f"different {key}" if key in ("code", "traces") else f"{key}={stamp.get(key)} (now {want[key]})"
                       for key in want if stamp.get(key) != want[key]]
            if not changed:
                return False
            why = f"was made with {', '.join(changed)}"
        if why:
            self.log(f"    {self.paths[stage]} {why}: redoing it and every later stage")
        # forget this stage's and the later stamps first: killed part-way, a rerun redoes all of them
        later = list(STAGE_OPTIONS)[list(STAGE_OPTIONS).index(stage):]
        self.stamps = {name: value for name, value in self.stamps.items() if name not in later}
        self._write()
        self.redoing = True
        return True

    def finished(self, stage: str) -> None:
        self.stamps[stage] = self.current[stage]
        self._write()

    def _write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.stamps, indent=2, sort_keys=True) + "\n")


def _summary(paths: dict[str, Path], metrics: dict, evaluation: dict, rows: list[dict], verified: bool,
             simulated: dict) -> dict:
    loco = evaluation.get("loco") or {}
    return {
        "n_train": metrics["n_train"],
        "n_eval": metrics["n_eval"],
        "admission_rho": metrics["admission"]["spearman"],
        "refined_rho": metrics["refined"]["spearman"],
        "admission_within_category": metrics["admission"]["within_category_mean"],
        "refined_within_category": metrics["refined"]["within_category_mean"],
        "held_out": loco.get("mean"),
        "held_out_ci": loco.get("mean_ci"),  # 95% over resampled evaluation requests
        "calibration": metrics["calibration"],
        "speedup_vs_sglang_default": _speedups(rows),
        "simulated": simulated,
        "verified": verified,
        "paths": {name: str(path) for name, path in paths.items()},
        "report": str(paths["report"] / "report.html"),
    }
