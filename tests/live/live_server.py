"""SGLang 0.5.23's real HTTP server on this CPU, started, asked and stopped by the live tests.

The server runs from its own virtual environment (``.venv-sglang``, ``make sglang-env``: SGLang's
wheel, the torch it pins, and this project installed into it), never the tests' own. What it takes
on a CPU:

- ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's ``is_cpu()`` reads it; ``--device cpu`` alone imports
  vllm for the rotary embedding) and ``--device cpu --disable-cuda-graph --attention-backend
  torch_native``;
- the ``sgl_kernel`` stand-in of ``stand_ins/`` on the server's ``PYTHONPATH`` (why: its docstring);
- ``--dtype float32``: the checkpoint is bf16, but this CPU has no bf16 instructions (AVX2 only) and
  torch emulates them: a burst of 30 requests took 22 s in bf16, 3.9 s in fp32;
- ``--max-total-tokens 4096``: the KV pool's size, which a CPU cannot measure from free memory.

Each server runs in its own process group (``start_new_session``): :meth:`LiveServer.stop` and
:meth:`LiveServer.kill` end the whole tree (launcher, schedulers, data-parallel controller,
detokenizer) and wait until the group is empty, so no test leaves a process behind. Its output
(SGLang's log and the hook's start-up line, which the scheduler logs) goes to a file the test reads.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("DWISE_SGLANG_VENV", ROOT / ".venv-sglang"))
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
SGLANG_VERSION = "0.5.23"
START_TIMEOUT_S = 240.0  # ~22 s on an idle 2-core machine; several minutes while other tests load it
STOP_TIMEOUT_S = 60.0  # SIGTERM: SGLang drains, the recorders consolidate (~8 s here)
REQUEST_TIMEOUT_S = 120.0
MISSING = (f"{VENV} holds no SGLang {SGLANG_VERSION} with this project installed: run `make sglang-env` "
           "(about 6 GB; the live tests start SGLang's real server from it)")


def venv_ready(venv: Path = VENV) -> bool:
    """Whether ``venv`` has SGLang 0.5.23 and this project installed (files only: nothing is run)."""
    return ((venv / "bin" / "python").exists() and (venv / "bin" / "dwise-predict").exists()
            and any(venv.glob(f"lib/python3*/site-packages/sglang-{SGLANG_VERSION}.dist-info")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict:
    """The server's environment: this one without any ``DWISE_*`` variable (a stray one would
    engage the plugin) or ``PYTHONPATH``, plus SGLang's CPU mode, the stand-ins, no hub, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DWISE_") and k != "PYTHONPATH"}
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(STAND_INS), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def sglang_args(model: Path, port: int, *extra: str, algorithm: str = "LowConfidence") -> list[str]:
    """SGLang's own server arguments for the tiny model on this CPU (see the module docstring)."""
    return ["--model-path", str(model), "--device", "cpu", "--dllm-algorithm", algorithm, "--disable-cuda-graph",
            "--attention-backend", "torch_native", "--max-total-tokens", "4096", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def serve_argv(model: Path, port: int, hook: list[str], *extra: str) -> list[str]:
    """``dwise-predict serve HOOK-OPTIONS -- SGLANG-ARGS``, from the SGLang environment."""
    return [str(VENV / "bin" / "dwise-predict"), "serve", *hook, "--", *sglang_args(model, port, *extra)]


def launch_server_argv(model: Path, port: int, *extra: str) -> list[str]:
    """SGLang's own launcher (``python -m sglang.launch_server``): the plugin path."""
    return [str(VENV / "bin" / "python"), "-m", "sglang.launch_server", *sglang_args(model, port, *extra)]


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


@dataclass
class Reply:
    """One finished ``/generate`` request: when the client saw its end, and SGLang's ``meta_info``."""

    rid: str
    finished_at: float
    meta: dict
    text: str = ""


@dataclass
class LiveServer:
    """One SGLang server process tree. ``argv``/``env``: the launcher's command; ``log``: its output."""

    argv: list[str]
    env: dict
    log: Path
    port: int
    process: subprocess.Popen | None = None
    replies: dict = field(default_factory=dict)  # rid -> Reply, every request this object saw finish
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> LiveServer:
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.log.parent))
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered 200; :class:`ServerFailed` if the launcher exits first
        or ``timeout`` passes (the process tree is killed then)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise ServerFailed(f"the server exited with {self.process.returncode} before it was healthy:\n"
                                   f"{self.log_tail()}")
            try:
                if self._get("/health", 2.0)[0] == 200:
                    return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.5)
        self.kill()
        raise ServerFailed(f"the server was not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int | None:
        """The launcher's exit status once it and its whole group have ended, or None after ``timeout``."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return code if self._group_gone(max(0.0, timeout)) else None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM to the launcher alone (as ``kill``, systemd or Kubernetes send it) and wait for the
        whole tree; the launcher's exit status, or None when ``timeout`` passed and the tree was killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.wait_exit(timeout)
        if code is None:
            self.kill()
        return code

    def kill(self) -> None:
        """SIGKILL to the whole process group, then wait until it is empty (at most a few seconds)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._group_gone(10.0)

    def _group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def scheduler_pids(self) -> dict[int, str]:
        """pid -> process title of each SGLang scheduler of this server (``sglang::scheduler``,
        ``sglang::scheduler_DP<rank>``)."""
        import psutil

        found = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline()) or child.name()
            except psutil.Error:
                continue
            if title.startswith("sglang::scheduler"):
                found[child.pid] = title
        return found

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # --- requests ------------------------------------------------------------------------------------

    def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def metrics(self) -> str:
        """SGLang's ``/metrics`` page (Prometheus text; the server runs with ``--enable-metrics``)."""
        status, body = self._get("/metrics", 10.0)
        if status != 200:
            raise ServerFailed(f"/metrics answered {status}: {body[:300]!r}")
        return body.decode()

    def generate(self, text: str, max_new_tokens: int, rid: str, custom_params: dict | None = None) -> Reply:
        """A greedy ``/generate`` request under ``rid`` (``custom_params``: SGLang's sampling parameter of
        that name, e.g. the hook's ``dwise_category``); waits for its end and keeps its :class:`Reply`."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if custom_params is not None:
            params["custom_params"] = custom_params
        body = {"text": text, "rid": rid, "sampling_params": params}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise ServerFailed(f"/generate {rid} answered {response.status}: {payload[:300]!r}")
        out = json.loads(payload)
        reply = Reply(rid, time.monotonic(), out["meta_info"], out.get("text", ""))
        with self._lock:
            self.replies[rid] = reply
        return reply

    def start_generate(self, text: str, max_new_tokens: int, rid: str, custom_params: dict | None = None
                       ) -> threading.Thread:
        """:meth:`generate` on a thread of its own (started; join it). A failure is kept in the log."""
        thread = threading.Thread(target=self._generate_quietly, args=(text, max_new_tokens, rid, custom_params),
                                  daemon=True)
        thread.start()
        return thread

    def _generate_quietly(self, text: str, max_new_tokens: int, rid: str, custom_params: dict | None = None) -> None:
        try:
            self.generate(text, max_new_tokens, rid, custom_params)
        except (OSError, ServerFailed, ValueError) as err:
            with open(self.log.with_suffix(".client.log"), "a") as out:
                out.write(f"{rid}: {type(err).__name__}: {err}\n")

    def disconnect_mid_stream(self, text: str, max_new_tokens: int, rid: str, chunks: int = 2) -> int:
        """A streaming request whose client goes away after ``chunks`` chunks (SGLang aborts it).
        Returns the chunks read."""
        body = {"text": text, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        read = 0
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            while read < chunks:
                line = response.fp.readline()
                if not line:
                    break
                read += line.startswith(b"data:")
        finally:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        return read

    def client_errors(self) -> str:
        """What :meth:`start_generate` requests failed with (one line each), or ""."""
        path = self.log.with_suffix(".client.log")
        return path.read_text() if path.exists() else ""


def run_to_end(argv: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` in a process group of its own to its end: (exit status, stdout and stderr). After
    ``timeout`` seconds, or if anything of its group is left when it ends, the group is SIGKILLed
    (status None on a timeout)."""
    process = subprocess.Popen(argv, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        code = None
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if code is None:
        output, _ = process.communicate()
    return code, output
