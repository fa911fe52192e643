"""A model loaded in a worker process, so that losing a node never kills the caller (parent side).

llama.cpp's native RPC client aborts its process (SIGABRT) when a server dies or a link drops during
inference. `Worker.start` runs `load_llama` in a child Python process (`worker.child`) and talks to it
over its stdin and stdout in JSON lines (`worker.wire`). Why JSON lines over plain pipes rather than
`multiprocessing`: the child is a fresh interpreter started with `-m` (no re-import of the caller's
`__main__`, no pickled state), its stderr goes straight to a log file, every wait is a bounded
`queue.get` on a reader thread, and the protocol is readable in a log. The child never outlives the
parent (see `worker.child`).

When the child dies or stalls, the parent re-probes the plan's endpoints with the pure-Python probe
(bounded): a server that refuses, closes or does not complete a connect is lost, and `NodeLostError`
names it; otherwise `WorkerCrashedError` says how the child died. A cut link cannot stall the child for
long: it sets keepalive and TCP_USER_TIMEOUT (`link_timeout`) on its connections to the servers.

This module imports no llama_cpp: only the child does.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from orchestrator.core.errors import RpcfleetError, tail
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target, dial_addresses, targets_for
from orchestrator.engine.children import child_log_path, exit_description, spawn_child
from orchestrator.engine.runtime import run_sync
from orchestrator.engine.threads import start_thread
from orchestrator.llama.observed_placement import Placement
from orchestrator.llama.worker.child import PARENT_ENV
from orchestrator.llama.worker.load_progress import (
    LoadProgress,
    ProgressTracker,
    planned_bytes,
    progress_sample,
)
from orchestrator.llama.worker.wire import (
    Done,
    Event,
    NodeLostError,
    Token,
    WorkerCrashedError,
    WorkerError,
    WorkerTimeoutError,
    decode,
    devices_from_json,
    done_from_json,
    encode,
    error_from_child,
    placement_from_json,
)
from orchestrator.planning.plan import Plan, PlanDevice
from orchestrator.rpc.client import probe_endpoints
from orchestrator.rpc.records import Outcome, ProbeResult

__all__ = [
    "Done",
    "Event",
    "LoadProgress",
    "NodeLostError",
    "Token",
    "Worker",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerTimeoutError",
]

E = TypeVar("E", bound=RpcfleetError)

_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout, on the child's path
LOAD_TIMEOUT = 300.0  # seconds for the child to start and load
EVENT_TIMEOUT = 300.0  # seconds between two answers of a request (the first token includes the prompt)
WAIT_REPORT_S = 5.0  # seconds between two `on_wait` calls while a request's answer is awaited
LINK_TIMEOUT = 10.0  # seconds a connection to a server may leave data unacknowledged (the child's sockets)
PROBE_TIMEOUT = 2.0  # seconds per endpoint for the probe that finds the lost node

# Outcomes of a probe that mean the node is gone: nothing listens, the connect never completes (a cut
# link, a dead host), or the server hangs up. `busy` and `ok` answer: the node is alive.
LOST_OUTCOMES = frozenset({Outcome.REFUSED, Outcome.TIMEOUT, Outcome.CLOSED})

# Log lines worth showing when the worker dies (the rest is llama.cpp's chatter).
_TELLING = re.compile(r"error|fail|abort|crash|ggml-rpc|Traceback|Killed", re.IGNORECASE)


def default_log_path() -> Path:
    """A fresh worker log under `$RPCFLEET_HOME/logs` (`engine.children.child_log_path`)."""
    return child_log_path("worker")


def list_local_gpus(timeout: float = LOAD_TIMEOUT) -> list[PlanDevice]:
    """This machine's GPUs (`Worker.local_gpus`) from a worker started for that alone and closed at
    once: for a caller with no worker of its own (`plan`, `report`, serve's planning)."""
    with Worker.spawn(Path(os.devnull)) as worker:
        return worker.local_gpus(timeout)


class Worker:
    """One model loaded in a child process. Use `Worker.start`; close it (or use it as a context manager).

    One request at a time (llama.cpp's single context). Every wait is bounded: `load_timeout` for the
    load, `event_timeout` between two answers of a request.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        log_path: Path | None,
        *,
        event_timeout: float,
        link_timeout: float,
        probe_timeout: float,
    ) -> None:
        self._process = process
        self.plan: Plan | None = None
        self.targets: dict[str, Target] = {}
        self.log_path = log_path
        self.event_timeout = event_timeout
        self.link_timeout = link_timeout
        self.probe_timeout = probe_timeout
        self.placement: Placement | None = None
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._busy = threading.Lock()
        self._dead: RpcfleetError | None = None
        self._ready = False  # the child said `ready` (its imports are done)
        self._local_gpus: list[PlanDevice] = []  # this machine's GPUs, as the child listed them at `ready`
        assert process.stdout is not None
        start_thread(self._read, process.stdout, name="worker-reader")

    # -- starting
    @classmethod
    def start(
        cls,
        plan: Plan,
        model_path: str | Path | None = None,
        llama_kwargs: Mapping[str, Any] | None = None,
        log_path: Path | None = None,
        *,
        verbose: bool = True,
        load_timeout: float = LOAD_TIMEOUT,
        on_progress: Callable[[LoadProgress], None] | None = None,
        **options: Any,
    ) -> Worker:
        """Start a worker (`spawn`, for the options) and `load` the model: returns once it is loaded
        (`worker.placement` holds the placement and the load time)."""
        worker = cls.spawn(log_path, **options)
        try:
            worker.load(
                plan, model_path, llama_kwargs, verbose=verbose, timeout=load_timeout, on_progress=on_progress
            )
        except BaseException:
            worker.kill()
            raise
        return worker

    @classmethod
    def spawn(
        cls,
        log_path: Path | None = None,
        *,
        log_to_stderr: bool = False,
        event_timeout: float = EVENT_TIMEOUT,
        link_timeout: float = LINK_TIMEOUT,
        probe_timeout: float = PROBE_TIMEOUT,
    ) -> Worker:
        """Start the child; returns at once. The child imports llama_cpp and the loader meanwhile, so a
        caller that spawns before probing and planning hides that time; `load` then loads the model.

        The child's stderr (llama.cpp's log) goes to `log_path` (default: a fresh file under
        `$RPCFLEET_HOME/logs`), or to this process's stderr with `log_to_stderr`.
        """
        path = None if log_to_stderr else (log_path or default_log_path())
        env = {
            **os.environ,
            "GGML_NO_BACKTRACE": "1",
            PARENT_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
        }
        process = spawn_child(
            [sys.executable, "-m", "orchestrator.llama.worker.child"],
            env=env,
            log_path=path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        return cls(
            process, path, event_timeout=event_timeout, link_timeout=link_timeout, probe_timeout=probe_timeout
        )

    def load(
        self,
        plan: Plan,
        model_path: str | Path | None = None,
        llama_kwargs: Mapping[str, Any] | None = None,
        *,
        verbose: bool = True,
        timeout: float = LOAD_TIMEOUT,
        targets: Mapping[str, Target] | None = None,
        on_progress: Callable[[LoadProgress], None] | None = None,
        cache_hits: Mapping[str, int] | None = None,
    ) -> Placement:
        """Load `model_path` (default: the plan's) through `plan` in the child (once per worker); returns
        the placement. `llama_kwargs` go to `load_llama` and must be JSON (seed, n_threads...);
        `verbose`: llama.cpp's log into the worker's log.

        Raises the loader's errors (a refused endpoint keeps its type), `WorkerTimeoutError` past
        `timeout` (start-up included), `NodeLostError` when a node dies during the load; the child is
        killed on any error.

        `targets` gives a plan endpoint the address the child connects to (`Tunnels.targets`: an SSH
        forward for `rpc_transport: ssh`); the placement and every error name the plan's endpoints.

        `on_progress` gets a `LoadProgress` a few times a second while the weights travel (bytes per
        node, rates, ETA); the same goes to the log as `load_progress` events, one a second.
        `cache_hits`: per plan endpoint, bytes of tensors its cache holds (they are not sent).
        """
        if self.plan is not None:
            raise WorkerError("this worker has loaded a model already: start another")
        self.plan = plan
        self.targets = {t.endpoint: t for t in targets_for(plan.endpoints, targets)}
        request = {
            "op": "load",
            "plan": plan.to_json(),
            "dial": dial_addresses(self.targets.values()),
            "model": str(model_path if model_path is not None else plan.model_path),
            "llama_kwargs": dict(llama_kwargs or {}),
            "verbose": verbose,
            "link_timeout": self.link_timeout,
        }
        deadline = time.monotonic() + timeout
        try:
            self._send(request)
            answer = self._next(timeout, "starting") if not self._ready else {"event": "ready"}
            if not self._ready and answer.get("event") == "ready":
                self._take_ready(answer)
            tracker = ProgressTracker(planned_bytes(plan), dict(cache_hits or {}))
            while answer.get("event") in ("ready", "progress"):  # imports done, then the load's samples
                if answer.get("event") == "progress":
                    self._on_sample(answer, tracker, on_progress)
                answer = self._next(max(0.0, deadline - time.monotonic()), "loading the model")
            if answer.get("event") != "loaded":
                self.kill()
                raise self._record(self._unexpected(answer))
            self.placement = placement_from_json(answer.get("placement"))
        except ValueError as exc:
            self.kill()
            raise self._record(
                self._attach(WorkerError(f"the worker answered a malformed placement: {exc}"))
            ) from None
        except BaseException:
            self.kill()
            raise
        seconds = round(self.placement.load_seconds, 3)
        get_logger().info("worker_loaded", pid=self.pid, log=str(self.log_path), seconds=seconds)
        return self.placement

    def _on_sample(
        self,
        answer: Mapping[str, Any],
        tracker: ProgressTracker,
        on_progress: Callable[[LoadProgress], None] | None,
    ) -> None:
        """One `progress` sample: to `on_progress`, and to the log once a second and once when done."""
        try:
            progress = tracker.update(*progress_sample(answer))
        except ValueError as exc:
            raise self._record(
                self._attach(WorkerError(f"the worker sent a malformed progress event: {exc}"))
            ) from None
        if tracker.due_for_log(progress):
            get_logger().info("load_progress", pid=self.pid, **progress.as_log())
        if on_progress is not None:
            on_progress(progress)

    def wait_ready(self, timeout: float = LOAD_TIMEOUT) -> None:
        """Wait until the spawned child has done its imports (optional: `load` waits anyway)."""
        if not self._ready:
            answer = self._next(timeout, "starting")
            if answer.get("event") != "ready":
                self.kill()
                raise self._record(self._unexpected(answer))
            self._take_ready(answer)

    def _take_ready(self, answer: Mapping[str, Any]) -> None:
        try:
            self._local_gpus = devices_from_json(answer.get("local_gpus"))
        except ValueError as exc:
            self.kill()
            raise self._record(
                self._attach(WorkerError(f"the worker answered malformed local GPUs: {exc}"))
            ) from None
        self._ready = True

    def local_gpus(self, timeout: float = LOAD_TIMEOUT) -> list[PlanDevice]:
        """This machine's GPUs as llama.cpp sees them (CUDA0, Vulkan0...), with their free memory, as the
        child listed them once its imports were done (waits for that). The caller plans with them and
        never loads libllama itself: in a CUDA build, listing may create the GPU context that `Worker`
        exists to keep out of the caller."""
        self.wait_ready(timeout)
        return list(self._local_gpus)

    # -- requests
    def complete(
        self,
        prompt: str,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        stream: bool = True,
        on_wait: Callable[[float], None] | None = None,
    ) -> Iterator[Event]:
        """Generate from `prompt`: `Token` events as the text streams (unless `stream` is False), then one
        `Done`. Raises `NodeLostError` (a node died), `WorkerTimeoutError`, or `WorkerError` (the request
        was refused; the worker keeps serving). Stopping the iteration early cancels the generation.
        `on_wait` gets the seconds of silence every few seconds while no answer comes (the first token
        waits for the prompt's evaluation, and a fresh Vulkan server compiles its shaders then)."""
        request = {"op": "complete", "prompt": prompt}
        return self._request(request, max_tokens, temperature, seed, stream, on_wait)

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
        self,
        request: dict[str, Any],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        stream: bool,
        on_wait: Callable[[float], None] | None = None,
    ) -> Iterator[Event]:
        if self._dead is not None:
            raise self._dead
        if not self._busy.acquire(blocking=False):
            raise WorkerError("the worker is serving another request (one at a time)")
        options = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": stream}
        try:
            self._send({**request, **options})
        except BaseException:
            self._busy.release()
            raise
        return self._events(on_wait)

    def _events(self, on_wait: Callable[[float], None] | None = None) -> Iterator[Event]:
        finished = False
        try:
            while True:
                answer = self._next(self.event_timeout, "generating", on_wait)
                kind = answer.get("event")
                if kind == "token":
                    text = str(answer.get("text", ""))
                    if (
                        text
                    ):  # an empty one is the child's heartbeat (text held back): it only resets the wait
                        yield Token(text)
                elif kind == "done":
                    finished = True
                    yield done_from_json(answer)
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

    def _next(
        self, timeout: float, doing: str, on_wait: Callable[[float], None] | None = None
    ) -> dict[str, Any]:
        """The child's next answer within `timeout`; on its death or silence, the diagnosis. `on_wait`:
        called with the seconds waited so far, every WAIT_REPORT_S without an answer."""
        if self._dead is not None:
            raise self._dead
        started = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - started)
            wait = min(left, WAIT_REPORT_S) if on_wait is not None else left
            try:
                line = self._lines.get(timeout=max(0.0, wait))
                break
            except queue.Empty:
                if on_wait is None or wait >= left:
                    raise self._fail(doing, timeout) from None
                on_wait(time.monotonic() - started)
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
            return error_from_child(answer, self.log_path)
        return self._attach(WorkerError(f"the worker answered {answer.get('event')!r} unexpectedly"))

    # -- death and diagnosis
    def _fail(self, doing: str, timed_out: float | None) -> RpcfleetError:
        """The child died (timed_out None) or was silent for `timed_out` seconds: kill it, find the lost
        nodes, and remember the error (every later call raises it)."""
        if self._dead is not None:
            return self._dead  # stopped on purpose (kill, close): nothing to diagnose
        self._terminate()
        how = f"did not answer within {timed_out:g} s (killed)" if timed_out is not None else "died"
        how += f" ({exit_description(self._process.returncode)})" if timed_out is None else ""
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
                endpoints=tuple(r.endpoint for r in lost),
                probes=probes,
            )
        else:
            cls = WorkerTimeoutError if timed_out is not None else WorkerCrashedError
            err = cls(f"the worker {how} while {doing}; every node still answers", stderr=self._log_tail())
        get_logger().info("worker_failed", error=err.message, log=str(self.log_path))
        return self._record(self._attach(err))

    def _probe(self) -> list[ProbeResult]:
        t = self.probe_timeout
        if not self.targets:
            return []
        return run_sync(
            probe_endpoints(self.targets.values(), connect_timeout=t, read_timeout=t, deadline=t + 1)
        )

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
        return err.with_log(self.log_path)

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
