"""A hook that cannot work with the server it is given is refused before SGLang loads the model.

Each case starts SGLang's real server, by ``dwise-predict serve`` and by SGLang's own launcher with
the plugin, and expects it to stop with one line that names the problem and a non-zero status,
before the scheduler's "Load weight begin" (issue 56: before the fix, SGLang's warmup forward died
in the hook after the model loaded, and the launcher exited 137).
"""

from __future__ import annotations

import re

import pytest

import live_server

SLOTS = 4
TIMEOUT_S = live_server.START_TIMEOUT_S  # a refusal that comes only after the model loaded still ends in this


def _start(path: str, model, port: int, bundle, k: int, rows: int, log) -> live_server.LiveServer:
    extra = ("--max-running-requests", str(rows))
    if path == "serve":
        hook = ["--bundle", str(bundle), "--slots", str(SLOTS), "--k", str(k)]
        return live_server.LiveServer(live_server.serve_argv(model, port, hook, *extra), live_server.server_env(),
                                      log, port).start()
    env = live_server.server_env(DWISE_BUNDLE=str(bundle), DWISE_SLOTS=str(SLOTS), DWISE_K=str(k))
    return live_server.LiveServer(live_server.launch_server_argv(model, port, *extra), env, log, port).start()


def _refused(server: live_server.LiveServer) -> tuple[int | None, str]:
    code = server.wait_exit(TIMEOUT_S)
    if code is None:
        server.kill()
    return code, server.log_text()


CASES = {
    # the bundle's width against the model's (the narrow bundle names no model config: only its width tells)
    "width": ("narrow_bundle", 1, r"\b(width|hidden size)\D*32\b[^\n]*\b64\b"),
    # k*B = 8 resident requests, but the scheduler has 4 request rows
    "rows": ("ranking_bundle", 2, r"k\s*\*\s*B\D*8\b[^\n]*\b4\b"),
}
@pytest.mark.parametrize("path", ["serve", "plugin"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_hook_the_server_cannot_run_is_refused_before_the_model_loads(request, tiny_model, tmp_path, path, case):
    bundle_fixture, k, names_it = CASES[case]
    bundle = request.getfixturevalue(bundle_fixture)
    server = _start(path, tiny_model, live_server.free_port(), bundle, k, rows=SLOTS, log=tmp_path / "server.log")
    code, log = _refused(server)
    assert code not in (None, 0), f"exit status {code}:\n{log[-3000:]}"
    assert "Load weight begin" not in log, f"refused only after the model loaded (exit {code})"
    assert len(re.findall(names_it, log)) == 1, log[-3000:]  # said once, in one line
    assert "Traceback" not in log, log[-3000:]
