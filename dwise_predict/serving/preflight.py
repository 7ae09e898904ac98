"""``dwise-predict serve --check``: every check that can run before SGLang loads the model, all reported.

``serve`` and the plugin refuse at the first launch that fails a check (:func:`.launcher.resolved`,
one line). ``--check`` resolves SGLang's arguments as the server will and reports every problem at
once, for serve's hook and, with ``DWISE_*`` variables set, for the plugin's — including the ways the
plugin can fail to engage that no code of ours could report from inside SGLang: an ``SGLANG_PLUGINS``
whitelist without it, an import that fails (SGLang logs it and serves on) — and the SGLang surface
the hook patches, against the SGLang installed here. A scheduler process the hook went into logs one
start-up line (:func:`.launcher.engaged_line`); a server whose schedulers do not is serving without it.
"""

from __future__ import annotations

import os

from dwise_predict.errors import ConfigError
from dwise_predict.serving.checks import plugin_loader_problems, surface_problems_here
from dwise_predict.serving.launcher import (HookConfig, describe, filled_config, option_fields, server_arguments,
                                            startup_findings)


def check(config: HookConfig | None, sglang_argv: list[str], environ=None) -> dict:
    """``serve --check``: SGLang's arguments resolved as the server will, and every check that can run
    before the model loads, each problem reported (not only the first), as plain JSON. ``serve``: the
    hook ``config`` against the served model and server (None: the flags ask for nothing); ``plugin``:
    with ``DWISE_*`` variables in ``environ`` (default ``os.environ``), whether SGLang's plugin loader
    would run the plugin and what it would install (:func:`plugin_report`); ``surface``: the SGLang
    names the hook patches, against the SGLang installed here. ``ok``: no problem anywhere. Starts
    nothing."""
    environ = os.environ if environ is None else environ
    _, view = server_arguments(sglang_argv, "dwise-predict serve --check (it resolves SGLang's arguments as the "
                                            "server will)")
    report = {"sglang_args": list(sglang_argv), "surface": surface_problems_here(),
              "serve": None if config is None else checked(config, view), "plugin": plugin_report(view, environ)}
    if report["serve"] is None and not report["plugin"]["asked"]:
        raise ConfigError("nothing to check: pass `bundle` or `record` (serve's hook), or set the plugin's DWISE_* "
                          "variables")
    report["ok"] = not report_problems(report)
    return report


def report_problems(report: dict) -> list[str]:
    """Every problem a :func:`check` report holds: the surface's, serve's, the plugin's."""
    return [*report["surface"], *(report["serve"] or {}).get("problems", []), *report["plugin"].get("problems", [])]


def checked(config: HookConfig, server_args) -> dict:
    """``config`` checked against SGLang's resolved ``server_args``: its ``problems`` (all of them),
    ``notes`` (what was not checked, and why), what was read of the server, and the hook it would
    install (None while there are problems)."""
    findings = startup_findings(config, server_args)
    hook = None if findings.problems else describe(filled_config(config, findings, server_args))
    served = {key: value for key, value in findings.served.items() if not key.startswith("hook_")}
    return {"hook": hook, "problems": findings.messages(), "notes": findings.notes, "server": served}


def plugin_report(server_args, environ) -> dict:
    """What ``python -m sglang.launch_server`` would do with the plugin variables of ``environ``:
    ``asked`` (a ``DWISE_*`` plugin variable is set), ``engaged`` (SGLang's plugin loader would run
    the plugin: :func:`~.checks.plugin_loader_problems`), and the plugin's config checked as
    :func:`checked` checks serve's, each problem naming the variable to change."""
    if not any(f"DWISE_{field.name.upper()}" in environ for field in option_fields()):
        return {"asked": False}
    problems = plugin_loader_problems()  # before importing the plugin: its import may be what fails
    if problems:
        return {"asked": True, "engaged": False, "problems": problems}
    from dwise_predict.serving.plugin import as_variables, config_from_environ

    try:
        config = config_from_environ(environ)
    except ConfigError as err:
        return {"asked": True, "engaged": True, "hook": None, "problems": [str(err)], "notes": []}
    report = checked(config, server_args)
    return {"asked": True, "engaged": True, **report, "problems": [as_variables(p) for p in report["problems"]],
            "notes": [as_variables(note) for note in report["notes"]]}
