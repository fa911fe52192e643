"""A model loaded in a worker process, so that losing a node never kills the caller (parent side).

llama.cpp's native RPC client aborts its process (SIGABRT) when a server dies or a link drops during
inference. `Worker.start` runs `load_llama` in a child Python process (`worker_child`) and talks to it
over its stdin and stdout in JSON lines (`worker_wire`). Why JSON lines over plain pipes rather than
`multiprocessing`: the child is a fresh interpreter started with `-m` (no re-import of the caller's
`__main__`, no pickled state), its stderr goes straight to a log file, every wait is a bounded
`queue.get` on a reader thread, and the protocol is readable in a log. The child never outlives the
parent (see `worker_child`).

When the child dies or stalls, the parent re-probes the plan's endpoints with the pure-Python probe
(bounded): a server that refuses, closes or does not complete a connect is lost, and `NodeLostError`
names it; otherwise `WorkerCrashedError` says how the child died. A cut link cannot stall the child for
long: it sets keepalive and TCP_USER_TIMEOUT (`link_timeout`) on its connections to the servers.

This module imports no llama_cpp: only the child does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from orchestrator.core import errors as core_errors
from orchestrator.core.errors import LoaderError, RpcfleetError, tail
from orchestrator.core.log import get_logger
from orchestrator.core.paths import rpcfleet_home
from orchestrator.llama import errors as llama_errors
from orchestrator.llama.placement import Placement
from orchestrator.llama.worker_child import PARENT_ENV
from orchestrator.llama.worker_wire import decode, encode, placement_from_json
from orchestrator.planning.plan import Plan
from orchestrator.rpc.client import probe_endpoints
from orchestrator.rpc.protocol import Outcome, ProbeResult

E = TypeVar("E", bound=RpcfleetError)

_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout, on the child's path
LOAD_TIMEOUT = 300.0  # seconds for the child to start and load
EVENT_TIMEOUT = 300.0  # seconds between two answers of a request (the first token includes the prompt)
LINK_TIMEOUT = 10.0  # seconds a connection to a server may leave data unacknowledged (the child's sockets)
PROBE_TIMEOUT = 2.0  # seconds per endpoint for the probe that finds the lost node
KEEP_LOGS = 20  # worker logs kept under $RPCFLEET_HOME/logs

# Outcomes of a probe that mean the node is gone: nothing listens, the connect never completes (a cut
# link, a dead host), or the server hangs up. `busy` and `ok` answer: the node is alive.
LOST_OUTCOMES = frozenset({Outcome.REFUSED, Outcome.TIMEOUT, Outcome.CLOSED})

# Log lines worth showing when the worker dies (the rest is llama.cpp's chatter).
_TELLING = re.compile(r"error|fail|abort|crash|ggml-rpc|Traceback|Killed", re.IGNORECASE)


class WorkerError(LoaderError):
    """The worker process failed, was refused a request, or could not be started."""

    log_path: Path | None = None


class NodeLostError(WorkerError):
    """A node of the plan stopped answering while the worker used it (`endpoints`: the lost ones)."""

    endpoints: tuple[str, ...] = ()
    probes: tuple[ProbeResult, ...] = ()


class WorkerCrashedError(WorkerError):
    """The worker died, but every node still answers (a bug, memory, a signal from outside)."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer within its timeout (it was killed) and every node still answers."""


@dataclass(frozen=True)
class Token:
    """A piece of generated text, as it streams."""

    text: str


@dataclass(frozen=True)
class Done:
    """The end of a request: the whole text and llama.cpp's counts and timings (seconds)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float  # llama.cpp's prompt evaluation time
    decode_seconds: float  # llama.cpp's generation time
    decode_tokens: int  # the tokens llama.cpp evaluated one by one in that time
    first_token_seconds: float  # from the request to the first piece of text, in the child
    seconds: float  # the whole request, in the child

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed, llama.cpp's own: tokens evaluated one by one over the time it took."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


Event = Token | Done


def default_log_path() -> Path:
    """A fresh log under `$RPCFLEET_HOME/logs`; beyond the newest `KEEP_LOGS`, those untouched for an
    hour are removed (a younger one may belong to a worker still running)."""
    folder = rpcfleet_home() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    logs = sorted(folder.glob("worker-*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in logs[KEEP_LOGS - 1 :]:
        if time.time() - stale.stat().st_mtime > 3600:
            stale.unlink(missing_ok=True)
    return folder / f"worker-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code: a private loop
        return pool.submit(asyncio.run, coro).result()


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def _error_from_child(message: Mapping[str, Any], log_path: Path | None) -> RpcfleetError:
    """The child's error event as the error class it names (loader refusals keep their type)."""
    name = str(message.get("type", ""))
    cls = getattr(llama_errors, name, None) or getattr(core_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RpcfleetError)) or issubclass(
        cls, core_errors.InputError
    ):
        cls = WorkerError
    text = str(message.get("message", "the worker failed"))
    if cls is WorkerError and name not in ("", "WorkerError"):
        text = f"{name}: {text}"
    err = cls(text, host=message.get("host"), hint=message.get("hint"), stderr=message.get("stderr"))
    if isinstance(err, WorkerError):
        err.log_path = log_path
    return err


class Worker:
    """One model loaded in a child process. Use `Worker.start`; close it (or use it as a context manager).

    One request at a time (llama.cpp's single context). Every wait is bounded: `load_timeout` for the
    load, `event_timeout` between two answers of a request.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        plan: Plan,
        log_path: Path | None,
        *,
        event_timeout: float,
        probe_timeout: float,
    ) -> None:
        self._process = process
        self.plan = plan
        self.log_path = log_path
        self.event_timeout = event_timeout
        self.probe_timeout = probe_timeout
        self.placement: Placement | None = None
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._busy = threading.Lock()
        self._dead: RpcfleetError | None = None
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), name="worker-reader", daemon=True).start()

    # -- starting
    @classmethod
    def start(
        cls,
        plan: Plan,
        model_path: str | Path | None = None,
        llama_kwargs: Mapping[str, Any] | None = None,
        log_path: Path | None = None,
        *,
        load_timeout: float = LOAD_TIMEOUT,
        **options: Any,
    ) -> Worker:
        """Start a worker, load `model_path` (default: the plan's) through `plan`, and return once it is
        loaded (`worker.placement` holds the placement and the load time). `spawn` for the options.

        Raises the loader's errors (a refused endpoint keeps its type), `WorkerTimeoutError` past
        `load_timeout`, `NodeLostError` when a node dies during the load.
        """
        worker = cls.spawn(plan, model_path, llama_kwargs, log_path, **options)
        try:
            worker.wait_loaded(load_timeout)
        except BaseException:
            worker.kill()
            raise
        return worker

    @classmethod
    def spawn(
        cls,
        plan: Plan,
        model_path: str | Path | None = None,
        llama_kwargs: Mapping[str, Any] | None = None,
        log_path: Path | None = None,
        *,
        log_to_stderr: bool = False,
        verbose: bool = True,
        event_timeout: float = EVENT_TIMEOUT,
        link_timeout: float = LINK_TIMEOUT,
        probe_timeout: float = PROBE_TIMEOUT,
    ) -> Worker:
        """Start the child and send it the load; returns at once (`wait_loaded` waits for the load).

        The child's stderr (llama.cpp's log when `verbose`) goes to `log_path` (default: a fresh file
        under `$RPCFLEET_HOME/logs`), or to this process's stderr with `log_to_stderr`. `llama_kwargs` go
        to `load_llama` and must be JSON (seed, n_threads, chat_format...).
        """
        path = None if log_to_stderr else (log_path or default_log_path())
        request = {
            "op": "load",
            "plan": plan.to_json(),
            "model": str(model_path if model_path is not None else plan.model_path),
            "llama_kwargs": dict(llama_kwargs or {}),
            "verbose": verbose,
            "link_timeout": link_timeout,
        }
        env = {
            **os.environ,
            "GGML_NO_BACKTRACE": "1",
            PARENT_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
        }
        log: IO[bytes] | None = path.open("ab") if path is not None else None
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.llama.worker_child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the parent only
            )
        finally:
            if log is not None:
                log.close()
        worker = cls(process, plan, path, event_timeout=event_timeout, probe_timeout=probe_timeout)
        try:
            worker._send(request)
        except BaseException:
            worker.kill()
            raise
        return worker

    def wait_loaded(self, timeout: float = LOAD_TIMEOUT) -> Placement:
        """Wait for the load `spawn` sent (see `start` for the errors); the child is killed on an error."""
        try:
            answer = self._next(timeout, "loading the model")
            if answer.get("event") != "loaded":
                self.kill()
                raise self._record(self._unexpected(answer))
            self.placement = placement_from_json(answer.get("placement"))
        except ValueError as exc:
            self.kill()
            raise self._record(
                self._attach(WorkerError(f"the worker answered a malformed placement: {exc}"))
            ) from None
        get_logger().info(
            "worker_loaded", pid=self.pid, log=str(self.log_path), seconds=self.placement.load_seconds
        )
        return self.placement

    # -- requests
    def complete(
        self,
        prompt: str,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        stream: bool = True,
    ) -> Iterator[Event]:
        """Generate from `prompt`: `Token` events as the text streams (unless `stream` is False), then one
        `Done`. Raises `NodeLostError` (a node died), `WorkerTimeoutError`, or `WorkerError` (the request
        was refused; the worker keeps serving). Stopping the iteration early cancels the generation."""
        request = {"op": "complete", "prompt": prompt}
        return self._request(request, max_tokens, temperature, seed, stream)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        stream: bool = True,
    ) -> Iterator[Event]:
        """Like `complete`, for chat messages (`{"role": ..., "content": ...}`, the model's chat template)."""
        request = {"op": "chat", "messages": [dict(m) for m in messages]}
        return self._request(request, max_tokens, temperature, seed, stream)

    def _request(
        self, request: dict[str, Any], max_tokens: int, temperature: float, seed: int | None, stream: bool
    ) -> Iterator[Event]:
        if self._dead is not None:
            raise self._dead
        if not self._busy.acquire(blocking=False):
            raise WorkerError("the worker is serving another request (one at a time)")
        try:
            self._send(
                {
                    **request,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": seed,
                    "stream": stream,
                }
            )
        except BaseException:
            self._busy.release()
            raise
        return self._events()

    def _events(self) -> Iterator[Event]:
        finished = False
        try:
            while True:
                answer = self._next(self.event_timeout, "generating")
                kind = answer.get("event")
                if kind == "token":
                    yield Token(str(answer.get("text", "")))
                elif kind == "done":
                    finished = True
                    yield _done(answer)
                    return
                else:
                    finished = True  # an error answer ends the request; the worker keeps serving
                    raise self._unexpected(answer)
        finally:
            if not finished and self._dead is None:
                self._cancel()
            self._busy.release()

    def _cancel(self) -> None:
        """The caller stopped reading: cancel in the child and skip to the request's end (bounded)."""
        try:
            self._send({"op": "cancel"})
            while self._next(self.event_timeout, "cancelling").get("event") == "token":
                pass
        except WorkerError:
            pass  # recorded in self._dead

    # -- the pipe
    def _read(self, stdout: IO[bytes]) -> None:
        try:
            for line in stdout:
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            self._lines.put(None)
            stdout.close()

    def _send(self, message: Mapping[str, Any]) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(encode(message))
            stdin.flush()
        except (BrokenPipeError, ValueError):
            raise self._fail("sending a request", None) from None

    def _next(self, timeout: float, doing: str) -> dict[str, Any]:
        """The child's next answer within `timeout`; on its death or silence, the diagnosis."""
        if self._dead is not None:
            raise self._dead
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(doing, timeout) from None
        if line is None:
            raise self._fail(doing, None)
        try:
            return decode(line)
        except ValueError as exc:
            self.kill()
            raise self._record(
                self._attach(WorkerError(f"the worker answered malformed JSON: {exc}"))
            ) from None

    def _unexpected(self, answer: Mapping[str, Any]) -> RpcfleetError:
        if answer.get("event") == "error":
            return _error_from_child(answer, self.log_path)
        return self._attach(WorkerError(f"the worker answered {answer.get('event')!r} unexpectedly"))

    # -- death and diagnosis
    def _fail(self, doing: str, timed_out: float | None) -> RpcfleetError:
        """The child died (timed_out None) or was silent for `timed_out` seconds: kill it, find the lost
        nodes, and remember the error (every later call raises it)."""
        if self._dead is not None:
            return self._dead  # stopped on purpose (kill, close): nothing to diagnose
        self._terminate()
        how = f"did not answer within {timed_out:g} s (killed)" if timed_out is not None else "died"
        how += f" ({_signal_name(self._process.returncode)})" if timed_out is None else ""
        probes = tuple(self._probe())
        lost = tuple(r for r in probes if r.outcome in LOST_OUTCOMES)
        err: WorkerError
        if lost:
            names = ", ".join(f"{r.endpoint} ({r.outcome})" for r in lost)
            err = NodeLostError(
                f"lost {names} while {doing}: the worker {how}",
                hint="check the node (rpcfleet status), then run again once it is back, or without it "
                "(-l '!HOST')",
                stderr=self._log_tail(),
            )
            err.endpoints = tuple(r.endpoint for r in lost)
            err.probes = probes
        elif timed_out is not None:
            err = WorkerTimeoutError(
                f"the worker {how} while {doing}; every node still answers", stderr=self._log_tail()
            )
        else:
            err = WorkerCrashedError(
                f"the worker {how} while {doing}; every node still answers", stderr=self._log_tail()
            )
        get_logger().info("worker_failed", error=err.message, log=str(self.log_path))
        return self._record(self._attach(err))

    def _probe(self) -> list[ProbeResult]:
        if not self.plan.endpoints:
            return []
        t = self.probe_timeout
        results: list[ProbeResult] = _run_sync(
            probe_endpoints(self.plan.endpoints, connect_timeout=t, read_timeout=t, deadline=t + 1)
        )
        return results

    def _log_tail(self) -> str | None:
        """The lines of the log's end that say what went wrong (llama.cpp's abort, a failed send)."""
        if self.log_path is None or not self.log_path.exists():
            return None
        with self.log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            text = f.read().decode("utf-8", "replace")
        telling = [line for line in text.splitlines() if _TELLING.search(line)]
        return tail("\n".join(telling), 3) or tail(text, 3) or None

    def _attach(self, err: WorkerError) -> WorkerError:
        err.log_path = self.log_path
        if self.log_path is not None:
            where = f"the worker's log: {self.log_path}"
            err.hint = f"{err.hint}; {where}" if err.hint else where
        return err

    def _record(self, err: E) -> E:
        self._dead = err
        return err

    # -- life
    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.poll() is None

    def kill(self) -> None:
        """Kill the child now and reap it; later requests raise `WorkerError`."""
        self._terminate()
        if self._dead is None:
            self._record(self._attach(WorkerError("the worker was stopped")))

    def _terminate(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):  # a broken pipe: the child is gone anyway
                self._process.stdin.close()

    def close(self, timeout: float = 5.0) -> None:
        """Unload and stop the child (killed if it does not exit within `timeout`). Idempotent."""
        if self._process.poll() is None and self._dead is None:
            try:
                self._send({"op": "close"})
                self._process.wait(timeout)
            except (WorkerError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()  # an error or Ctrl-C: do not wait for a generation to finish


def _done(answer: Mapping[str, Any]) -> Done:
    def number(key: str) -> float:
        value = answer.get(key, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    finish = answer.get("finish_reason")
    return Done(
        text=str(answer.get("text", "")),
        finish_reason=finish if isinstance(finish, str) else None,
        prompt_tokens=int(number("prompt_tokens")),
        completion_tokens=int(number("completion_tokens")),
        prompt_seconds=number("prompt_seconds"),
        decode_seconds=number("decode_seconds"),
        decode_tokens=int(number("decode_tokens")),
        first_token_seconds=number("first_token_seconds"),
        seconds=number("seconds"),
    )
