"""The DWISE hook as an SGLang plugin: ``DWISE_BUNDLE=bundle/ python -m sglang.launch_server ...``.

SGLang 0.5.23 runs every entry point of the ``sglang.srt.plugins`` group (``sglang/srt/plugins``:
``load_plugins``, in the launching process before it builds its server arguments, and again in each
child it starts) and then applies the hooks they registered with its ``HookRegistry``. This package
registers :func:`register` there (``pyproject.toml``). With no ``DWISE_*`` environment variable set
it does nothing. Otherwise it wraps ``Engine._launch_subprocesses``, the one function through which
both ``http_server.launch_server`` (``sglang serve``, ``python -m sglang.launch_server``) and the
offline ``sglang.Engine`` start their scheduler processes, so that the scheduler target they pass is
run by the launcher's :class:`~dwise_predict.serving.launcher.SchedulerEntry`, with the config read
from the environment and resolved against SGLang's resolved server arguments: the same entry, the
same config and the same patched methods as ``dwise-predict serve`` (which stays the one-command
path; it passes its own entry, which the wrapper leaves alone). It also wraps ``Engine.shutdown``
(:func:`shutdown_with_recordings`), which SGLang ends with a SIGKILL of every scheduler: with
``DWISE_RECORD`` set, each recording scheduler commits and consolidates first, as under
``launcher.engine()``.

Environment: every :class:`~dwise_predict.serving.launcher.HookConfig` option (all its fields but
the two SGLang's own flags fill, ``launcher.option_fields``) is ``DWISE_`` + its
name in capitals (:data:`VARIABLES`), read as ``dwise-predict serve`` reads the option of the same
name: ``DWISE_BUNDLE``, ``DWISE_RECORD``, ``DWISE_SLOTS``, ``DWISE_K``, ``DWISE_KV_BUDGET_TOKENS``,
``DWISE_KV_FRACTION``, ``DWISE_SLACK_BLOCKS``, ``DWISE_BLOCK_SIZE``, ``DWISE_MAX_BATCH``,
``DWISE_HIDDEN_SIZE``, ``DWISE_TOKENIZER``, ``DWISE_RECORD_EVERY``, ``DWISE_RECORD_FLUSH_S``,
``DWISE_PROMPT_CACHE``, ``DWISE_AGING``, ``DWISE_MAX_WAIT``, ``DWISE_FOLLOW``, ``DWISE_FOLLOW_ZOO``,
``DWISE_FOLLOW_POLL_S``, ``DWISE_ROLLBACK_AFTER``, ``DWISE_ROLLBACK_MARGIN`` (and ``DWISE_RESOLVER``, for tests);
set but empty, an optional one keeps its default. The package's other ``DWISE_*`` settings
(``DWISE_DEBUG``, ``DWISE_ZOO`` ...) do not engage the plugin; a name one letter or two from a
plugin variable does, and is refused. A misspelt name or a value of the wrong type stops the
launch with one line naming it: SGLang logs a plugin's own exception and carries on without it, so
the plugin raises nothing itself and checks when SGLang launches (a server that silently ran
without the hook would look like one that runs with it).

The wrapper is registered in the launching process (no ``multiprocessing`` parent) and wherever
SGLang's ``engine`` module is already imported (an ``Engine`` built in a child process), not in the
scheduler, detokenizer and data-parallel controller children, which would only import it for
nothing: their scheduler entry came from the launching process.
"""

from __future__ import annotations

import difflib
import inspect
import multiprocessing
import os
import re
import sys

from dwise_predict.errors import ConfigError, DwiseError
from dwise_predict.serving.launcher import HookConfig, SchedulerEntry, option_fields, resolved, stop_recordings

PREFIX = "DWISE_"
ENGINE_MODULE = "sglang.srt.entrypoints.engine"
TARGET = f"{ENGINE_MODULE}.Engine._launch_subprocesses"
SHUTDOWN = f"{ENGINE_MODULE}.Engine.shutdown"
HTTP_MODULE = "sglang.srt.entrypoints.http_server"
VARIABLES = {f"{PREFIX}{f.name.upper()}": f for f in option_fields()}  # DWISE_BUNDLE -> HookConfig.bundle


def _misspelt(environ) -> dict[str, str]:
    """``DWISE_*`` names in ``environ`` that are none of :data:`VARIABLES` but one letter or two from
    one of them (name -> the variable meant). Other ``DWISE_*`` names are the package's other
    settings (``DWISE_DEBUG``, ``DWISE_ZOO`` ...), not the plugin's."""
    return {name: close[0] for name in environ if name.startswith(PREFIX) and name not in VARIABLES
            and (close := difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.85))}


def engaged(environ=None) -> bool:
    """Whether ``environ`` (default ``os.environ``) asks for the hook: a plugin variable is set, or
    one misspelt (refused at launch, not ignored)."""
    environ = os.environ if environ is None else environ
    return any(name in VARIABLES for name in environ) or bool(_misspelt(environ))


def config_from_environ(environ=None) -> HookConfig | None:
    """The hook's config from the plugin variables of ``environ`` (default ``os.environ``), or None
    when it sets none (:func:`engaged`). Raises :class:`ConfigError` naming every misspelt variable,
    every value of the wrong type and the config's own problems (:meth:`HookConfig.problems`)."""
    environ = os.environ if environ is None else environ
    if not engaged(environ):
        return None
    problems = [f"{name} is no DWISE plugin variable: did you mean {meant}?"
                for name, meant in sorted(_misspelt(environ).items())]
    values = {}
    for name, value in sorted((n, v) for n, v in environ.items() if n in VARIABLES):
        field = VARIABLES[name]
        kind = int if "int" in field.type else float if "float" in field.type else str
        if value == "" and "None" in field.type:
            values[field.name] = None  # set but empty: the default of an optional field
            continue
        try:
            values[field.name] = kind(value)
        except ValueError:
            problems.append(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    config = HookConfig(**values)  # the values that parsed: their problems are reported with the rest
    problems += [as_variables(problem) for problem in config.problems()]
    if problems:
        raise ConfigError("DWISE plugin: " + "; ".join(problems))
    return config


def as_variables(message: str) -> str:
    """``message`` with each hook parameter it names (a :class:`HookConfig` field in backticks:
    `` `slots` ``, `` `block_size` `` ...) named as the variable that sets it here (``DWISE_SLOTS``,
    ``DWISE_BLOCK_SIZE`` ...), as the CLI names them by their flags; SGLang's flags
    (``--max-running-requests``) stay flags."""
    return re.sub(r"`([a-z][a-z0-9_]*)`", _variable, message)


def _variable(param: re.Match) -> str:
    variable = PREFIX + param.group(1).upper()
    return variable if variable in VARIABLES else param.group(0)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: wrap ``Engine._launch_subprocesses`` when a
    ``DWISE_*`` variable is set (see the module's docstring)."""
    if not engaged():
        return
    if multiprocessing.parent_process() is not None and ENGINE_MODULE not in sys.modules:
        return  # an SGLang child: its scheduler entry, if any, came from the launching process
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, launch_with_hook, HookType.AROUND)
    HookRegistry.register(SHUTDOWN, shutdown_with_recordings, HookType.AROUND)


def shutdown_with_recordings(original, *args, **kwargs):
    """``Engine.shutdown`` (which ``Engine`` also registers to run at exit) after every scheduler
    process of this process that records under ``DWISE_RECORD`` committed and consolidated its
    recording (:func:`~dwise_predict.serving.launcher.stop_recordings`: SIGTERM, then a wait of up
    to 60 s): SGLang's own shutdown goes straight to ``kill_process_tree``, a SIGKILL no recorder
    outlives. What still cannot be flushed is consolidated, and counted, by the next start."""
    try:
        config = config_from_environ()
    except ConfigError:
        config = None  # the launch refused these variables: no scheduler of ours records
    if config is not None and config.record is not None:
        stop_recordings(config.record)
    return original(*args, **kwargs)


def launch_with_hook(original, *args, **kwargs):
    """``Engine._launch_subprocesses`` with its ``run_scheduler_process_func`` run by a
    :class:`SchedulerEntry` configured from the environment (an entry already passed, by
    ``dwise-predict serve`` or ``launcher.engine``, is kept)."""
    call = inspect.signature(original).bind(*args, **kwargs)
    target = call.arguments["run_scheduler_process_func"]
    if not isinstance(target, SchedulerEntry):
        config = config_from_environ()
        if config is not None:
            from sglang.srt.arg_groups.model_override_base import resolved_view

            server_args = call.arguments["server_args"]
            server_args.resolve_once()  # what _launch_subprocesses does first; idempotent
            try:  # every check before SGLang loads the model, each naming the variable to change
                hooked = resolved(config, resolved_view(server_args))
            except DwiseError as err:
                refusal = f"DWISE plugin: {as_variables(str(err))}"
                if _launched_from_the_command_line():
                    raise SystemExit(f"error: {refusal}") from None  # one line on stderr, exit 1
                raise type(err)(refusal) from None  # a Python caller's sglang.Engine: a typed error it can catch
            call.arguments["run_scheduler_process_func"] = SchedulerEntry(hooked, target=target)
    return original(*call.args, **call.kwargs)


def _launched_from_the_command_line() -> bool:
    """Whether this launch came through SGLang's HTTP launcher (``python -m sglang.launch_server``,
    ``sglang serve``: a command line, where a refusal is one line and exit 1) rather than a Python
    caller's ``sglang.Engine`` (where it is an exception the caller may catch). SGLang's launcher
    calls ``Engine._launch_subprocesses`` from ``http_server.launch_server`` and catches nothing."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "launch_server" and frame.f_globals.get("__name__") == HTTP_MODULE:
            return True
        frame = frame.f_back
    return False
