"""The hook checked against the server SGLang is about to start, in the launching process, before SGLang
loads the model: ``launcher.resolved`` runs these for ``serve``, ``launcher.engine()`` and the plugin,
and refuses in one line; ``serve --check`` reports them all.

What each check reads (never the weights):

- **dLLM**: ``--dllm-algorithm`` is set (without it SGLang serves the model autoregressively and no
  patched method ever runs).
- **hidden size**: the served model's ``config.json`` (a local ``--model-path``; ``hidden_size``, or its
  text config's for multimodal configs such as DiffusionGemma, as SGLang's ``get_hf_text_config``
  picks it; after ``--json-model-override-args``, which SGLang lays over the config), against the
  bundle's width and the hook's ``hidden_size``. A hub id is not fetched: skipped, with a note.
- **block size**: SGLang's own ``DllmConfig.from_server_args`` (``srt/dllm/config.py``: the
  architecture's block size, or ``--dllm-algorithm-config``'s ``block_size``; SGLang's argument
  resolution already ran it in this process), against the hook's ``block_size``; the bundle's is
  compared with the rest of its decoding (``launcher.check_served_algorithm``).
- **model identity**: the bundle's ``model.config_hash`` against the served config's (transformers'
  reading of ``config.json``, hashed as ``collect`` hashes it: ``names.config_hash``). A bundle
  trained on a live recording names no model: skipped, with a note. ``name`` and ``path`` are no
  identity (``names.py``); the weights' hash would read every weight file: not checked.
- **request rows**: ``k*B`` against the rows each scheduler gets (:func:`scheduler_rows`).

For ``serve --check`` also: the SGLang surface the hook patches, against the SGLang installed here
(:func:`surface_problems_here`), and whether SGLang's plugin loader would run this package's plugin
(:func:`plugin_loader_problems`): when it does not, no code of ours runs in SGLang's processes to say
so, and the scheduler's start-up line (``launcher.install_in_this_process``) is simply absent.

SGLang names read here, besides ``launcher``'s: ``dllm.config.DllmConfig.from_server_args``,
``plugins.load_plugins_by_group``, ``plugins._get_excluded_dists``, ``plugins.GENERAL_PLUGINS_GROUP``,
``entrypoints.engine.Engine._launch_subprocesses`` and ``managers.scheduler`` (imported).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dwise_predict.bundles.manifest import BundleIdentity
from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.files import read_json_object

PLUGIN = "dwise"  # this package's entry point in SGLang's plugin group (pyproject.toml)
# where SGLang's get_hf_text_config finds a multimodal model's language model config
TEXT_CONFIGS = ("text_config", "llm_config", "language_config", "thinker_config")


@dataclass
class Findings:
    """What the checks found.

    problems : (error type, one-line message) for each refusal, in the order found.
    notes : what was not checked, and why.
    served : what was read of the server, as plain JSON (model, hidden size, block size, rows).
    """

    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    served: dict = field(default_factory=dict)

    def refuse(self, kind: type, message: str) -> None:
        self.problems.append((kind, message))

    def messages(self) -> list[str]:
        return [message for _, message in self.problems]

    def raise_problems(self) -> None:
        """Every problem in one line, as the type of the first."""
        if self.problems:
            raise self.problems[0][0]("; ".join(self.messages()))


def model_config(view) -> dict | None:
    """The served model's ``config.json`` with ``--json-model-override-args`` laid over it (SGLang's
    ``get_config``: ``config.update(overrides)``), or None when ``--model-path`` is no local directory
    holding one (a hub id: not fetched)."""
    path = getattr(view, "model_path", None)
    file = Path(path) / "config.json" if path else None
    if file is None or not file.is_file():
        return None
    config = read_json_object(file, ConfigError, str(file), "serve a model directory with a valid config.json")
    overrides = getattr(view, "json_model_override_args", None) or {}
    if isinstance(overrides, str):
        overrides = json.loads(overrides or "{}")
    return {**config, **overrides}


def hidden_size(config: dict) -> int | None:
    """The width of the hidden states the hook pools: the language model's ``hidden_size``."""
    text = next((config[key] for key in TEXT_CONFIGS if isinstance(config.get(key), dict)), config)
    size = text.get("hidden_size", config.get("hidden_size"))
    return int(size) if size else None


def served_block_size(server_args) -> int | None:
    """The dLLM block size SGLang will run for ``server_args`` (its resolved view): SGLang's own
    ``DllmConfig.from_server_args``. None without a dLLM algorithm. Raises ``ImportError`` where
    SGLang is not installed, and what SGLang raises for a model or algorithm it refuses."""
    config = importlib.import_module("sglang.srt.dllm.config").DllmConfig.from_server_args(server_args)
    return None if config is None else int(config.block_size)


def scheduler_rows(view) -> tuple[int, str]:
    """The requests each scheduler (each attention-DP worker) of this server can hold at once, as far
    as its arguments decide it, and what decides it.

    SGLang's ``KVCacheConfigurator.resolve_max_num_reqs`` gives each worker ``max(1,
    --max-running-requests // attn_dp_size)`` request rows, at most half its KV token pool (bounded by
    ``--max-total-tokens``; memory profiling when the model loads may shrink the pool further, which
    only the scheduler sees). Without ``--max-running-requests`` the row pool is sized from memory,
    but ``DllmConfig`` sets a dLLM's ``max_running_requests`` to 1: one request at a time."""
    requested = getattr(view, "max_running_requests", None)
    if requested is None:
        return 1, "SGLang's dLLM default without --max-running-requests: one request at a time"
    attn_dp = int(getattr(view, "attn_dp_size", None) or 1)
    rows = max(1, int(requested) // attn_dp)
    pool = getattr(view, "max_total_tokens", None)
    if pool is not None and int(pool) // 2 < rows:
        return int(pool) // 2, f"at most half of --max-total-tokens {pool}"
    if attn_dp > 1:
        return rows, f"--max-running-requests {requested} // {attn_dp} attention-DP workers"
    return rows, f"--max-running-requests {requested}"


def rows_problem(slots: int, k: float, view) -> str | None:
    """Why ``k*B`` resident requests do not fit the rows each scheduler gets, naming what to change."""
    rows, basis = scheduler_rows(view)
    resident = slots * k
    if resident <= rows:
        return None
    if basis.startswith("at most half"):
        fix = f"raise --max-total-tokens to at least {2 * math.ceil(resident)}"
    else:
        fix = f"pass --max-running-requests {math.ceil(resident) * int(getattr(view, 'attn_dp_size', None) or 1)}"
    return (f"DWISE keeps up to k*B = {resident:g} requests resident in each scheduler (`slots`={slots} x "
            f"`k`={k:g}) but each scheduler holds {rows} ({basis}): {fix}, or lower `slots` or `k`")


def server_findings(config, trained: BundleIdentity | None, server_args) -> Findings:
    """The checks of a hook config (``launcher.HookConfig``) and its bundle's identity (``trained``, or
    None) against SGLang's resolved ``server_args``: dLLM, request rows, block size, hidden size and model
    identity (see the module's docstring). The algorithm is ``launcher.check_served_algorithm``'s."""
    findings = Findings()
    rows, basis = scheduler_rows(server_args)
    findings.served.update(model=getattr(server_args, "model_path", None), rows_per_scheduler=rows, rows_from=basis,
                           attn_dp_size=int(getattr(server_args, "attn_dp_size", None) or 1))
    if getattr(server_args, "dllm_algorithm", None) is None:
        findings.refuse(ConfigError, "SGLang would serve this model without a dLLM algorithm, where the hook never "
                                     "runs: pass --dllm-algorithm (LowConfidence, JointThreshold ...)")
    if (problem := rows_problem(config.slots, config.k, server_args)) is not None:
        findings.refuse(ConfigError, problem)
    served = model_config(server_args)
    if served is None:
        findings.notes.append(f"--model-path {findings.served['model']} is no local model directory (not fetched): "
                              "its hidden size, block size and identity are not checked before the model loads")
        return findings
    findings.served["architecture"] = (served.get("architectures") or [None])[0]
    if getattr(server_args, "dllm_algorithm", None) is not None:
        _check_block_size(findings, config.block_size, server_args)
    _check_width(findings, config, trained, served)
    if trained is not None:
        _check_identity(findings, trained, server_args)
    return findings


def _check_block_size(findings: Findings, block_size: int | None, server_args) -> None:
    try:
        served = served_block_size(server_args)
    except ImportError as err:
        findings.notes.append(f"SGLang's DllmConfig does not import here ({err}): the block size is checked only "
                              "by the hook, against each scheduler's DllmConfig")
        return
    except (RuntimeError, ValueError, OSError) as err:  # what DllmConfig raises for a model it cannot serve
        findings.refuse(ConfigError, f"SGLang refuses this dLLM server: {err}")
        return
    findings.served["block_size"] = served
    if block_size is not None and served is not None and int(block_size) != served:
        findings.refuse(ConfigError, f"`block_size`={block_size} but SGLang runs {findings.served['architecture']} "
                                     f"with block size {served}: leave `block_size` out")


def _check_width(findings: Findings, config, trained: BundleIdentity | None, served: dict) -> None:
    width = hidden_size(served)
    findings.served["hidden_size"] = width
    model = findings.served["model"]
    if width is None:
        findings.notes.append(f"{model}/config.json names no hidden_size: the width is not checked before load")
        return
    trained_width = None if trained is None else trained.hidden_size
    if trained_width is not None and trained_width != width:
        findings.refuse(BundleError, f"bundle {config.bundle} takes hidden states of width {trained_width} but the served "
                                     f"model {model} has hidden size {width}: serve the bundle with the model it was "
                                     "trained on, or export one for this model (`dwise-predict export`)")
    if config.hidden_size is not None and int(config.hidden_size) != width:
        findings.refuse(ConfigError, f"`hidden_size`={config.hidden_size} but the served model {model} has hidden "
                                     f"size {width}: leave `hidden_size` out")


def _check_identity(findings: Findings, trained: BundleIdentity, server_args) -> None:
    from dwise_predict.names import config_hash

    named = trained.model.config_hash
    if not named:
        findings.notes.append("the bundle names no model config (trained on a live recording?): model identity not "
                              "checked, only its width")
        return
    model = findings.served["model"]
    try:
        from transformers import AutoConfig

        loaded = AutoConfig.from_pretrained(model, trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    except (OSError, ValueError, KeyError, ImportError) as err:
        findings.notes.append(f"transformers cannot read {model}/config.json here ({type(err).__name__}): model "
                              "identity not checked")
        return
    served = config_hash(loaded.to_dict())
    findings.served["config_hash"] = served
    if served != named:
        findings.refuse(BundleError, f"the bundle was trained on another model ('{trained.model.name}', config hash {named[:12]}) "
                                     f"than {model} (config hash {served[:12]}): export a bundle trained on this model")


def surface_problems_here() -> list[str]:
    """The SGLang names the hook patches, against the SGLang installed here: its scheduler module
    imports (as each scheduler process will import it) and its source holds every ``SURFACE``
    entry with the parameters the hook expects. [] when all is there."""
    try:
        importlib.import_module("sglang.srt.managers.scheduler")
    except Exception as err:  # noqa: BLE001 - whatever SGLang's import chain raises on this machine is the finding
        return [f"SGLang's scheduler module does not import here ({type(err).__name__}: {err})"]
    from dwise_predict.serving.sglang import read_surface, surface_problems

    root = Path(list(importlib.import_module("sglang").__path__)[0]).parent
    return [f"SGLang here: {problem}" for problem in surface_problems(read_surface(root))]


def plugin_loader_problems() -> list[str]:
    """Why SGLang's plugin loader (``srt/plugins``: ``load_plugins`` in a launching process with this
    environment) would not run this package's plugin: not installed, left out by an ``SGLANG_PLUGINS``
    whitelist or by ``SGLANG_PLATFORM``, failing to import (SGLang logs that and serves without it),
    or the method it wraps missing. [] when it would. Runs SGLang's own ``load_plugins_by_group``."""
    from importlib.metadata import entry_points

    plugins = importlib.import_module("sglang.srt.plugins")
    found = {ep.name: ep for ep in entry_points(group=plugins.GENERAL_PLUGINS_GROUP)}
    if PLUGIN not in found:
        return [f"no '{PLUGIN}' entry point in SGLang's plugin group {plugins.GENERAL_PLUGINS_GROUP}: reinstall "
                "dwise-predict in SGLang's environment (pip install dwise-predict)"]
    excluded = plugins._get_excluded_dists()
    if PLUGIN not in plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP, excluded_dists=excluded):
        return [_not_loaded(found[PLUGIN], excluded)]
    engine = importlib.import_module("sglang.srt.entrypoints.engine").Engine
    if not isinstance(engine.__dict__.get("_launch_subprocesses"), classmethod):
        return ["SGLang's Engine has no classmethod _launch_subprocesses for the plugin to wrap: the plugin needs "
                "sglang==0.5.23"]
    return []


def _not_loaded(entry_point, excluded: set) -> str:
    """Why SGLang's loader skipped the plugin, in its own order: whitelist, platform, import."""
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and PLUGIN not in {name.strip() for name in allowed.split(",")}:
        return (f"SGLANG_PLUGINS={allowed} leaves out '{PLUGIN}': SGLang will not load the DWISE plugin and serves "
                f"without the hook; add {PLUGIN} to it")
    if entry_point.dist is not None and entry_point.dist.name in excluded:
        return (f"SGLANG_PLATFORM={os.environ.get('SGLANG_PLATFORM')} excludes {entry_point.dist.name}'s plugins: "
                "SGLang serves without the hook")
    try:
        entry_point.load()
    except Exception as err:  # noqa: BLE001 - SGLang catches any exception here and serves without the plugin
        return (f"the DWISE plugin does not import ({type(err).__name__}: {err}): SGLang logs this and serves "
                "without the hook")
    return "SGLang's plugin loader skipped the DWISE plugin: SGLang serves without the hook"
