"""Keep the predictor fresh: retrain on recent live traffic, publish only a candidate that wins.

From one or more recordings (contract-1 trace directories that ``serve --record`` writes, one per
data-parallel rank, merged as ``traces merge`` merges them) the last ``window`` requests are taken in
the store's order (``workload_index``: each recording's arrival index; ranks interleave by it, so the
window is the recent traffic to within a few requests per rank). They are split by a hash of the
request id, 20 % held out (:func:`~dwise_predict.collectors.live.live_split`, what the recorder
writes), whatever split the directories hold. The candidate is trained with the serving bundle's
recipe (``bundle.json``'s ``recipe``; for a bundle exported before bundles carried one, the
:class:`~dwise_predict.training.TrainConfig` defaults, and the result says so) on the window's train
split, plus the original traces' train split when they are given; it is exported and verified. Then
the candidate and the serving bundle are judged side by side on the window's held-out requests,
which neither was trained on:

- admission ρ, refined ρ, within-category ρ (refined) and the calibration ratio (median refined /
  actual remaining rounds; 1 is calibrated) over the finished held-out requests, each difference
  (candidate − serving) with a paired percentile bootstrap interval: both bundles scored on the same
  resamples of requests, each category resampled within itself (:func:`~dwise_predict.metrics.stratified_indices`,
  :func:`~dwise_predict.metrics.rank_scores`);
- the simulated mean latency of DWISE (``dwise-refined``) when each bundle's estimates schedule the
  held-out requests as one burst (:mod:`dwise_predict.simulation.simulator`, with the server's
  round-cost profile or the simulator's default cost), the difference's interval a bootstrap of the
  per-request latency differences (:func:`~dwise_predict.metrics.bootstrap_mean_ci`; the schedule is
  not simulated again per resample).

Decision (:func:`decide`): publish when the refined-ρ difference's interval lies above 0 and the
mean-latency difference's interval does not lie above 0 (the candidate is not slower beyond its
interval). Too few requests to judge is refused, saying how many are needed.

``out`` holds ``stages.json`` (what made each resumable stage; it marks a refresh directory),
``recordings/`` (the merged recordings, rebuilt on every call), ``serving/`` (the serving bundle
pulled from the zoo), ``run/`` (the candidate's training run, :mod:`dwise_predict.training.run`),
``candidate/`` (the candidate bundle) and ``refresh.json`` (figures, intervals, decision and why).
Interrupted, a rerun resumes: the run is trained again only when the training requests, the recipe
or the code changed (their stamp in ``stages.json``), the candidate exported again only after a new
run, and a rerun judges against the zoo version it pulled first (a refresh that published has made
that version the zoo's latest; a new refresh takes a new ``out``) and never publishes one candidate
twice.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from dwise_predict.bundles.manifest import BundleManifest
from dwise_predict.errors import BundleError, ConfigError, InputError, StoreError
from dwise_predict.files import atomic_dir, claim_output, read_json_object, write_json
from dwise_predict.versions import source_fingerprint

MIN_HELD_OUT = 30  # finished held-out requests: fewer give intervals too wide to decide anything
MIN_TRAIN = 50  # training requests the recipe's cross-validated choice needs at the least
STAMPS = "stages.json"
RESULT_FILE = "refresh.json"
RESULT_SCHEMA_VERSION = 1
# everything a refresh directory holds (our own locks included); anything else in `out` is someone's
CONTENTS = (STAMPS, RESULT_FILE, "recordings", "serving", "run", "candidate", ".*.lock")
SCHEDULER = "dwise-refined"
LEVEL = 0.95
RANK_FIGURES = ("admission_rho", "refined_rho", "within_category_rho", "calibration_ratio")
FIGURES = (*RANK_FIGURES, "mean_latency_s")
DEFAULT_COST = "the simulator's default (no round profile)"
RULE = ("publish when the refined-ρ difference's 95 % interval lies above 0 and the simulated mean-latency "
        "difference's interval does not lie above 0")


@dataclass(frozen=True)
class RefreshConfig:
    """How a refresh judges and what it may do.

    window : the most recent requests taken from the recordings (None: every recorded one).
    seed : the bootstrap's resamples and the burst's arrival order (the recipe keeps its own seed).
    bootstrap : paired resamples behind every interval.
    slots, k : the simulated server, ``B`` block slots and the resident multiplier ``k`` (Algorithm 1).
    publish : publish a winning candidate into the zoo (None: when a zoo is given).
    """

    window: int | None = None
    seed: int = 0
    bootstrap: int = 1000
    slots: int = 16
    k: float = 4.0
    publish: bool | None = None

    def check(self) -> None:
        """Raise ConfigError naming every option that cannot work."""
        from dwise_predict.training.config import LIMITS, MAX_SEED

        problems = []
        if self.window is not None and self.window < 1:
            problems.append(f"`window` must be at least 1 request, got {self.window}")
        if not 100 <= self.bootstrap <= LIMITS["bootstrap"]:
            problems.append(f"`bootstrap` must lie in [100, {LIMITS['bootstrap']:,}] resamples, got {self.bootstrap}")
        if not 0 <= self.seed <= MAX_SEED:
            problems.append(f"`seed` must lie in [0, {MAX_SEED}], got {self.seed}")
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class Serving:
    """The bundle serving now: its directory, checked manifest, version (the zoo's, else the first 12
    hex of its manifest seal, as the hook names it) and where it came from."""

    path: Path
    manifest: BundleManifest
    version: str
    source: str


@dataclass(frozen=True)
class Sources:
    """What a refresh reads: the recordings, the serving bundle (``bundle``, or ``name`` in ``zoo``),
    the original training traces and the round profile (None where not given)."""

    recordings: tuple[Path, ...]
    bundle: Path | None = None
    zoo: Path | None = None
    name: str | None = None
    traces: Path | None = None
    round_profile: Path | None = None

    def check(self, publish: bool) -> None:
        problems = []
        if not self.recordings:
            problems.append("no recording given: pass at least one RECORDINGS directory")
        if self.bundle is None and (self.zoo is None or self.name is None):
            problems.append("give the serving bundle: `bundle`, or `zoo` with `name` (its latest version)")
        if self.name is not None and self.zoo is None:
            problems.append("`name` names a bundle in a zoo: give `zoo` too")
        if publish and self.zoo is None:
            problems.append("`publish` needs `zoo` (and `name`, or the serving bundle's own name)")
        # before `out` is claimed: a mistyped recording leaves nothing behind
        from dwise_predict.traces.dataset import MANIFEST_FILE  # pandas: not at the CLI's start

        problems += [f"{r} is no recording (no {MANIFEST_FILE}): give a directory the hook records into, one per "
                     "rank (e.g. rec/dp0)" for r in self.recordings if not (Path(r) / MANIFEST_FILE).is_file()]
        if problems:
            raise ConfigError("; ".join(problems))

    def inputs(self) -> list[tuple[str, Path | None]]:
        """Every input as :func:`~dwise_predict.files.refuse_aliasing` names it."""
        return [*(("RECORDINGS", r) for r in self.recordings), ("`bundle`", self.bundle), ("`zoo`", self.zoo),
                ("`traces`", self.traces), ("`round_profile`", self.round_profile)]


def refresh(sources: Sources, out: str | os.PathLike, config: RefreshConfig | None = None,
            log: Callable[[str], None] | None = None) -> dict:
    """Retrain on the recordings' window, judge the candidate against the serving bundle, publish it
    when it wins; return what ``out/refresh.json`` records (see the module docstring).

    Raises
    ------
    ConfigError
        Conflicting sources or options.
    InputError
        ``out`` aliases an input, or too few requests to judge (``refresh.json`` then says so too).
    BundleError
        The recordings or ``traces`` are of another model or decoding than the serving bundle.
    StoreError, TraceError
        An empty or damaged recording, an unwritable ``out``.
    """
    config = config or RefreshConfig()
    config.check()
    publish = config.publish if config.publish is not None else sources.zoo is not None
    sources.check(publish)
    sim_config, cost_source = simulated_server(config, sources.round_profile)
    log = log or _quiet
    with claim_output(out, sources.inputs(), "a refresh directory", STAMPS, replace=True, contents=CONTENTS) as out:
        stamps = Stamps(out)
        (out / RESULT_FILE).unlink(missing_ok=True)  # an earlier call's decision is not this one's
        serving = serving_bundle(out, stamps, sources, log)
        recipe, recipe_source = bundle_recipe(serving)
        window, recorded = recorded_window(sources.recordings, out, config.window, log)
        check_matches(serving, window, "the recordings")
        original = original_train(sources.traces, serving, window)
        training = window if original is None else _pooled(window, original)
        record = {"schema_version": RESULT_SCHEMA_VERSION, "serving": _serving_record(serving),
                  "recordings": [str(r) for r in sources.recordings],
                  "traces": None if sources.traces is None else str(sources.traces),
                  "recipe": {"source": recipe_source, "options": recipe.to_dict()},
                  "window": _window_record(config.window, recorded, window, original, training),
                  "simulation": {"scheduler": SCHEDULER, "arrival": "burst", "slots": sim_config.slots,
                                 "k": sim_config.k, "seed": config.seed,
                                 "round_cost": {**sim_config.cost.as_dict(), "source": cost_source}},
                  "bootstrap": config.bootstrap, "level": LEVEL, "rule": RULE}
        _refuse_too_few(record, out)
        _train_stage(out, stamps, training, recipe, log)
        candidate = _candidate_stage(out, stamps, _candidate_name(sources, serving), log)
        log(f"judging the candidate against {serving.source} on {record['window']['held_out']} held-out requests")
        record.update(compare_bundles(window.split("eval"), serving.path, candidate, sim_config, config.bootstrap,
                                      config.seed))
        wins, why = decide(record["differences"])
        record.update(candidate=str(candidate), candidate_wins=wins,
                      **_publish_stage(stamps, candidate, sources, serving, wins, why, publish, log))
        write_json(out / RESULT_FILE, record)
    return record


def _quiet(line: str) -> None:
    """The default log: nothing."""


def simulated_server(config: RefreshConfig, round_profile: Path | None):
    """The simulated server (:class:`~dwise_predict.simulation.simulator.SimConfig`, a burst) and
    what its round cost is: the profile's, else :data:`DEFAULT_COST`."""
    from dwise_predict.simulation.round_cost import load_round_cost
    from dwise_predict.simulation.simulator import SimConfig

    cost = None if round_profile is None else load_round_cost(round_profile)
    sim_config = SimConfig(slots=config.slots, k=config.k, seed=config.seed, arrival="burst", round_cost=cost)
    return sim_config, DEFAULT_COST if round_profile is None else str(round_profile)


class Stamps:
    """``out/stages.json``: what made each resumable stage (``serving``, ``run``, ``candidate``,
    ``published``); written as soon as a refresh starts, so an interrupted one's ``out`` is known
    for a refresh directory."""

    def __init__(self, out: Path):
        self.path = out / STAMPS
        self.data = (read_json_object(self.path, StoreError, fix=f"delete {out} to start the refresh over")
                     if self.path.is_file() else {})
        out.mkdir(exist_ok=True)
        write_json(self.path, self.data)

    def get(self, stage: str):
        return self.data.get(stage)

    def set(self, stage: str, stamp) -> None:
        self.data[stage] = stamp
        write_json(self.path, self.data)


def serving_bundle(out: Path, stamps: Stamps, sources: Sources, log: Callable[[str], None]) -> Serving:
    """The serving bundle: ``sources.bundle`` as it is, or ``sources.name``'s latest version in the
    zoo, pulled into ``out/serving`` (pinned in ``stages.json`` before the pull: a rerun judges against
    the same version, even after this refresh published the next one)."""
    from dwise_predict.bundles.manifest import BUNDLE_FILE, SEAL_KEY
    from dwise_predict.bundles.screen import open_bundle
    from dwise_predict.bundles.zoo import find_entry, pull

    if sources.bundle is not None:
        manifest = open_bundle(sources.bundle)
        return Serving(sources.bundle, manifest, manifest.raw[SEAL_KEY][:12], str(sources.bundle))
    pinned, path = stamps.get("serving"), out / "serving"
    if pinned is None or (pinned.get("zoo"), pinned.get("name")) != (str(sources.zoo), sources.name):
        entry = find_entry(sources.zoo, sources.name)
        pinned = {"zoo": str(sources.zoo), "name": sources.name, "version": entry["version"]}
        shutil.rmtree(path, ignore_errors=True)  # another zoo's or name's bundle, from an earlier call
        stamps.set("serving", pinned)
    ref = f"{sources.name}@{pinned['version']}"
    if not (path / BUNDLE_FILE).is_file():
        log(f"pulling the serving bundle {ref} from {sources.zoo} → {path}")
        pull(sources.zoo, ref, path)
    return Serving(path, open_bundle(path), pinned["version"], f"{ref} (zoo {sources.zoo})")


def bundle_recipe(serving: Serving):
    """The :class:`~dwise_predict.training.TrainConfig` that made the serving bundle, and where it
    comes from: its ``recipe``, else the defaults (a bundle exported before bundles carried one)."""
    from dwise_predict.training import TrainConfig

    if serving.manifest.recipe is None:
        return TrainConfig(), ("the TrainConfig defaults: the serving bundle records no recipe (exported before "
                               "bundles carried one)")
    try:
        return TrainConfig.from_dict(serving.manifest.recipe), "the serving bundle's recipe"
    except ConfigError as err:
        raise BundleError(f"the recipe in {serving.path}'s bundle.json cannot be trained by this dwise-predict "
                          f"({err}): upgrade dwise-predict, or refresh from a bundle it exported") from None


def recorded_window(recordings, out: Path, window: int | None, log: Callable[[str], None]):
    """The recordings merged into ``out/recordings`` (:func:`~dwise_predict.collectors.store.merge`:
    one model and decoding, DP ranks interleaved by arrival index), their last ``window`` requests
    split by request id (:func:`~dwise_predict.collectors.live.live_split`); and how many were recorded."""
    from dwise_predict.collectors.live import live_split
    from dwise_predict.collectors.store import merge
    from dwise_predict.traces import load_traces

    log(f"merging {len(recordings)} recording(s) → {out / 'recordings'}")
    with atomic_dir(out / "recordings") as tmp:
        merge(list(recordings), tmp)
    recorded = load_traces(out / "recordings")
    n = len(recorded)
    taken = recorded if window is None or window >= n else recorded.subset(np.arange(n) >= n - window)
    log(f"the window: the last {len(taken)} of {n} recorded requests")
    split = [live_split(rid) for rid in taken.requests["request_id"]]
    return replace(taken, requests=taken.requests.assign(split=split)), n


def check_matches(serving: Serving, ds, what: str) -> None:
    """Refuse traces (``what``) of another model or decoding than the serving bundle was trained on, as
    the hook refuses a bundle for another server (:func:`~dwise_predict.bundles.load.check_compatible`)."""
    from dwise_predict.bundles.load import check_compatible
    from dwise_predict.engine.algorithms import comparable_decoding

    identity = serving.manifest.identity
    decoding = {"block_size": None, **ds.decoding}
    check_compatible(identity, ds.model_fingerprint, comparable_decoding(identity.decoding.algorithm, decoding),
                     f"{serving.source}, refreshed from {what},")
    if ds.hidden_size != serving.manifest.hidden_size:
        raise BundleError(f"{what} hold hidden states of width {ds.hidden_size}, the serving bundle {serving.source} "
                          f"takes {serving.manifest.hidden_size}: refresh only from traces of the model it serves")


def original_train(traces: Path | None, serving: Serving, window):
    """The train split of the original traces (None without them), checked against the serving
    bundle and the recordings (the fingerprint keys both know must agree: a recording may know the
    served model by its hidden size alone) and carrying the recordings' manifest; their request ids
    may not repeat the window's."""
    from dwise_predict.evaluation.inputs import model_identity, model_label
    from dwise_predict.traces import load_traces

    if traces is None:
        return None
    original = load_traces(traces)
    check_matches(serving, original, f"`traces` {traces}")
    theirs, ours = model_identity(original), model_identity(window)
    if any(theirs[key] is not None and ours[key] is not None and theirs[key] != ours[key] for key in theirs):
        raise InputError(f"`traces` {traces} come from another model ({model_label(original)}) than the recordings "
                         f"({model_label(window)}): give the traces the serving bundle was trained on")
    train = original.split("train")
    shared = sorted(set(train.requests["request_id"]) & set(window.requests["request_id"]))
    if shared:
        raise InputError(f"`traces` {traces} and the recordings share {len(shared)} request ids (e.g. "
                         f"{shared[0]!r}): give the original training traces, not a recording")
    return replace(train, manifest=window.manifest)


def _pooled(window, original):
    """The window and the original traces' train split as one training set (the window first: its
    eval split is what train_run reports on)."""
    from dwise_predict.evaluation.inputs import concat

    return concat([window, original])


def _serving_record(serving: Serving) -> dict:
    return {"source": serving.source, "path": str(serving.path), "name": serving.manifest.name,
            "version": serving.version, "created": serving.manifest.created}


def _window_record(asked: int | None, recorded: int, window, original, training) -> dict:
    """How many requests the window holds, split by split, and what the candidate trains on."""
    from dwise_predict.training.fit import Targets

    held_out = window.split("eval")
    return {"asked": asked, "recorded": recorded, "requests": len(window),
            "train": int((window.requests["split"] == "train").sum()), "held_out": len(held_out),
            "held_out_finished": int(Targets.of(held_out).events.sum()) if len(held_out) else 0,
            "original_train": 0 if original is None else len(original),
            "training": int((training.requests["split"] == "train").sum()), "fingerprint": training.data_hash()}


def _refuse_too_few(record: dict, out: Path) -> None:
    """Record in ``refresh.json`` and raise when the window cannot train or judge a candidate."""
    counts = record["window"]
    problems = []
    if counts["held_out_finished"] < MIN_HELD_OUT:
        problems.append(f"{counts['held_out_finished']} finished held-out requests (20 % of the window, by request "
                        f"id), and judging needs at least {MIN_HELD_OUT}")
    if counts["training"] < MIN_TRAIN:
        problems.append(f"{counts['training']} training requests, and the candidate needs at least {MIN_TRAIN}")
    if not problems:
        return
    why = (f"too few requests to judge: the window of {counts['requests']} recorded requests holds "
           f"{'; '.join(problems)}: widen `window` (about {int(MIN_HELD_OUT / 0.2 * 1.25)} requests) or record longer")
    write_json(out / RESULT_FILE, {**record, "decision": "refused", "candidate_wins": None, "published": None,
                                   "why": why})
    raise InputError(why)


def _train_stage(out: Path, stamps: Stamps, training, recipe, log: Callable[[str], None]) -> None:
    """Train the candidate into ``out/run`` unless a finished run of the same requests, recipe and
    code is there."""
    from dwise_predict.runs import REQUIRED_FILES
    from dwise_predict.training import train_run

    run = out / "run"
    stamp = {"training": training.data_hash(), "recipe": recipe.to_dict(), "code": source_fingerprint()}
    if stamps.get("run") == stamp and all((run / name).is_file() for name in REQUIRED_FILES):
        log(f"candidate run {run}: already trained on these requests with this recipe")
        return
    stamps.set("run", None)  # forgotten first: killed while training, a rerun trains again
    log(f"training the candidate on {int((training.requests['split'] == 'train').sum())} requests with the "
        f"serving bundle's recipe → {run}")
    train_run(training, run, recipe, overwrite=True)
    stamps.set("run", stamp)


def _candidate_name(sources: Sources, serving: Serving) -> str:
    """The candidate bundle's name: the zoo name it may be published under, else the serving bundle's."""
    from dwise_predict.bundles.manifest import NAME_PATTERN

    name = sources.name or serving.manifest.name
    return name if isinstance(name, str) and NAME_PATTERN.fullmatch(name) else "candidate"


def _candidate_stage(out: Path, stamps: Stamps, name: str, log: Callable[[str], None]) -> Path:
    """Export ``out/run`` as ``out/candidate`` unless it already was (the run's stamp), then verify
    it, always (hashes and parity in a fresh process); a candidate that fails stops the refresh."""
    from dwise_predict.bundles.manifest import BUNDLE_FILE
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.exports.verify import require_verified

    candidate = out / "candidate"
    if stamps.get("candidate") != stamps.get("run") or not (candidate / BUNDLE_FILE).is_file():
        log(f"exporting the candidate → {candidate}")
        stamps.set("candidate", None)
        export_bundle(out / "run", candidate, name=name, force=True)
        stamps.set("candidate", stamps.get("run"))
    log(f"verifying {candidate}")
    require_verified(candidate)
    return candidate


@dataclass(frozen=True)
class _Estimates:
    """One bundle's estimates of the held-out requests (arrays of shape (n,)) and the latency of each
    request, in seconds, when those estimates schedule them."""

    admission: np.ndarray
    refined: np.ndarray
    latency_s: np.ndarray


def compare_bundles(held_out, serving: Path, candidate: Path, sim_config, bootstrap: int = 1000,
                    seed: int = 0) -> dict:
    """Both bundles on the ``held_out`` requests: ``figures`` (side -> figure -> value or None) and
    ``differences`` (figure -> {"difference": candidate − serving, "interval": [lo, hi] or None}).

    Rank figures and the calibration ratio use the finished requests, each category resampled
    within itself, the same resamples for both sides; the latency uses every held-out request.
    """
    from dwise_predict.bundles.load import load_bundle
    from dwise_predict.metrics import bootstrap_mean_ci, percentile_interval, stratified_indices
    from dwise_predict.simulation.simulator import sim_requests_from_traces, simulate
    from dwise_predict.training.fit import Targets

    targets = Targets.of(held_out)
    categories = held_out.requests["category"].astype(str).to_numpy()
    sides = {}
    for side, path in (("serving", serving), ("candidate", candidate)):
        workload = sim_requests_from_traces(held_out, None, load_bundle(path))
        latency = simulate(workload, SCHEDULER, sim_config).latency_s
        sides[side] = _Estimates(workload.admission, workload.refined, latency)
    done = targets.events
    idx = stratified_indices(categories[done], bootstrap, seed)
    point = {side: _rank_figures(e, targets, categories, done, None) for side, e in sides.items()}
    resampled = {side: _rank_figures(e, targets, categories, done, idx) for side, e in sides.items()}
    figures = {side: {**{name: _number(values[0]) for name, values in point[side].items()},
                      "mean_latency_s": float(e.latency_s.mean())} for side, e in sides.items()}
    differences = {name: {"difference": _difference(figures, name), "interval": percentile_interval(
                              resampled["candidate"][name] - resampled["serving"][name], LEVEL)}
                   for name in RANK_FIGURES}
    latency = sides["candidate"].latency_s - sides["serving"].latency_s
    differences["mean_latency_s"] = {"difference": float(latency.mean()),
                                     "interval": list(bootstrap_mean_ci(latency, bootstrap, seed, LEVEL))}
    return {"figures": figures, "differences": differences}


def _rank_figures(estimates: _Estimates, targets, categories, done, idx) -> dict[str, np.ndarray]:
    """The rank figures and the calibration ratio of one bundle over the finished requests: on the
    data (``idx`` None: arrays of shape (1,)) or on each resample of ``idx`` (arrays of shape (n_boot,))."""
    from dwise_predict.metrics import rank_scores

    total, remaining, cats = targets.total[done], targets.remaining[done].astype(float), categories[done]
    admission, _ = rank_scores(estimates.admission[done], total, cats, idx)
    refined, within = rank_scores(estimates.refined[done], remaining, cats, idx)
    # median refined / actual over requests with rounds left (metrics.median_ratio), per resample
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(remaining > 0, estimates.refined[done] / remaining, np.nan)
    rows = np.arange(ratio.size)[None, :] if idx is None else idx
    with warnings.catch_warnings():  # a resample without a request that has rounds left: NaN, dropped later
        warnings.simplefilter("ignore", RuntimeWarning)
        calibration = np.nanmedian(ratio[rows], axis=1)
    return {"admission_rho": admission, "refined_rho": refined, "within_category_rho": within,
            "calibration_ratio": calibration}


def _number(value) -> float | None:
    return float(value) if np.isfinite(value) else None


def _difference(figures: dict, name: str) -> float | None:
    a, b = figures["candidate"][name], figures["serving"][name]
    return None if a is None or b is None else a - b


def decide(differences: dict) -> tuple[bool, str]:
    """Whether the candidate wins (:data:`RULE`), and why or why not, in one sentence."""
    rho, latency = differences["refined_rho"], differences["mean_latency_s"]
    if rho["interval"] is None or rho["difference"] is None:
        return False, "refined ρ is undefined on the held-out requests (an estimate or the rounds are constant)"
    rho_text = f"refined ρ {rho['difference']:+.3f} {_interval(rho['interval'])}"
    latency_text = f"simulated mean latency {latency['difference']:+.3f} s {_interval(latency['interval'])}"
    if not rho["interval"][0] > 0:
        return False, (f"the candidate does not rank the held-out requests better beyond its interval: {rho_text} "
                       "reaches 0")
    if latency["interval"][0] > 0:
        return False, f"the candidate ranks better ({rho_text}) but schedules worse beyond its interval: {latency_text}"
    return True, (f"the candidate ranks the held-out requests better ({rho_text}) and schedules them no worse "
                  f"({latency_text})")


def _interval(interval) -> str:
    return f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"


def _publish_stage(stamps: Stamps, candidate: Path, sources: Sources, serving: Serving, wins: bool, why: str,
                   publish: bool, log: Callable[[str], None]) -> dict:
    """``decision``, ``published`` (zoo, name, version, or None) and ``why`` of ``refresh.json``;
    a winning candidate is published when ``publish``, once (a rerun finds it in the zoo)."""
    from dwise_predict.bundles.manifest import SEAL_KEY, read_bundle_manifest
    from dwise_predict.bundles.zoo import read_index
    from dwise_predict.exports.zoo import publish as publish_bundle

    if not wins or not publish:
        off = "no zoo to publish into" if sources.zoo is None else "publishing was turned off"
        return {"decision": "not published", "published": None, "why": why if not wins else f"{why}; {off}"}
    manifest = read_bundle_manifest(candidate)
    name = sources.name or serving.manifest.name
    done = stamps.get("published")
    if done is None or done.get("seal") != manifest.raw[SEAL_KEY]:
        earlier = [e for e in read_index(sources.zoo, missing_ok=True)["bundles"] if e["name"] == name
                   and e.get("created") == manifest.created and e.get("metrics") == manifest.metrics]
        # publish verifies too; the candidate was verified above
        entry = earlier[-1] if earlier else publish_bundle(candidate, sources.zoo, name=name, verify=False)
        done = {"zoo": str(sources.zoo), "name": entry["name"], "version": entry["version"],
                "seal": manifest.raw[SEAL_KEY]}
        stamps.set("published", done)
    log(f"published {done['name']}@{done['version']} into {done['zoo']}")
    return {"decision": "published", "published": {k: done[k] for k in ("zoo", "name", "version")},
            "why": f"{why}: published as {done['name']}@{done['version']}"}
