"""Run CLI commands and SIGKILL each one just before its N-th atomic rename (``os.replace``).

Every atomic write and directory swap of the package goes through ``os.replace``, so these are
exactly the moments where a crash can split old and new (``tests/test_faults.py`` counts them in
process first: the kill points to try).

:class:`KillServer` starts ``python tests/kill_on_rename.py`` once; that process imports the CLI and
forks one child per command. A fresh interpreter per command spent about 3 s of CPU importing torch,
LightGBM and the CLI, more than most commands killed here. The server runs no command itself (no
OpenMP pool to inherit, ``OMP_NUM_THREADS=1`` for its children), so each child starts as a fresh
process would, only without the imports. Its reply comes once every process holding the child's
output pipes has exited (the child's own worker processes too), as ``subprocess.run`` waits.
``stub`` names functions (``"module:name"``) the child replaces with one that does nothing and
returns None, for work a test leaves to others (``publish``'s verification: it writes nothing).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path


class KillServer:
    """The test side: ``run(kill_at, argv, cwd)`` returns a ``subprocess.CompletedProcess``."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env=env)

    def run(self, kill_at: int, argv: list, cwd: Path | None = None, stub: tuple[str, ...] = (),
            timeout_s: float = 300):
        argv = [str(a) for a in argv]
        request = {"kill_at": kill_at, "argv": argv, "cwd": None if cwd is None else str(cwd), "stub": list(stub)}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.close()
                raise TimeoutError(f"{argv} gave no answer within {timeout_s:.0f} s")
        reply = json.loads(self._process.stdout.readline())
        return subprocess.CompletedProcess(argv, reply["returncode"], reply["stdout"], reply["stderr"])

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()


def _run_killing_at(cli, kill_at: int, argv: list[str]) -> int:
    real_replace = os.replace
    count = 0

    def replace(src, dst, *args, **kwargs):
        nonlocal count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    return cli(argv)


def _child(cli, kill_at: int, argv: list[str], cwd: str | None, stub: list[str], out_w: int, err_w: int) -> None:
    """In the forked child: the command's stdio are the pipes, its directory ``cwd``; never returns."""
    import importlib

    code = 1
    try:
        for name in stub:
            module, _, attribute = name.partition(":")
            setattr(importlib.import_module(module), attribute, lambda *args, **kwargs: None)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's stdin carries requests, not input
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if cwd is not None:
            os.chdir(cwd)
        code = _run_killing_at(cli, kill_at, argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what interpreter exit runs (the server registered none)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_one(cli, kill_at: int, argv: list[str], cwd: str | None, stub: list[str]) -> dict:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        _child(cli, kill_at, argv, cwd, stub, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        open_fds = len(chunks)
        while open_fds:  # until every holder of either pipe has exited
            for key, _ in selector.select():
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    open_fds -= 1
    _, status = os.waitpid(pid, 0)
    return {"returncode": os.waitstatus_to_exitcode(status),
            "stdout": b"".join(chunks[out_r]).decode(errors="replace"),
            "stderr": b"".join(chunks[err_r]).decode(errors="replace")}


# what the server imports before it forks: the CLI and what the commands killed here import on use
PRELOAD = ("dwise_predict.collectors.collect", "dwise_predict.training.run", "dwise_predict.evaluation.evaluate",
           "dwise_predict.evaluation.characterize", "dwise_predict.exports.bundle", "dwise_predict.exports.verify",
           "dwise_predict.exports.zoo", "dwise_predict.bundles.zoo", "lightgbm", "torch._dynamo",
           "torch.fx.experimental.symbolic_shapes")


def serve() -> None:
    import importlib

    from dwise_predict.cli.app import main as cli

    for name in PRELOAD:
        importlib.import_module(name)

    for line in sys.stdin:
        request = json.loads(line)
        reply = _run_one(cli, request["kill_at"], request["argv"], request["cwd"], request["stub"])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
