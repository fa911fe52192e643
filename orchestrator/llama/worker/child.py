"""The worker process: loads one model through `load_llama` and serves requests until told to close.

Run as `python -m orchestrator.llama.worker.child` by `orchestrator.llama.worker.parent.Worker` (see
there for why). The first line on stdin is the load request; every later line is a request
(`worker.wire`). Its answers go to the protocol pipe: the original stdout, kept as a private descriptor,
while fd 1 is pointed at stderr (the log), so a stray native `printf` can never corrupt the protocol.

The child never outlives its parent: a watchdog thread reads stdin and exits the process at end of file
(the parent's end closes when it dies, however it dies) or when the process is re-parented. Not
PR_SET_PDEATHSIG: that fires when the *thread* that spawned the child exits, and a parent may start a
worker from a short-lived thread. Core dumps are off: a native abort (a lost node) is expected here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import select
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from orchestrator.core.target import Target, targets_for
from orchestrator.engine.children import connections_to, peers_of, socket_bytes_acked, tune_socket
from orchestrator.engine.threads import start_thread
from orchestrator.llama.worker.text_stream import TextStream
from orchestrator.llama.worker.wire import decode, devices_to_json, encode, placement_to_json

PARENT_ENV = "RPCFLEET_WORKER_PARENT"
_WATCH_INTERVAL = 0.5  # seconds between re-parenting checks of the watchdog


class _Channel:
    """Requests from stdin (a watchdog thread) and answers to the protocol pipe."""

    def __init__(self, out: IO[bytes], parent: int) -> None:
        self._out = out
        self._parent = parent
        self.requests: queue.Queue[dict[str, Any]] = queue.Queue()
        self.cancel = threading.Event()
        self._lock = threading.Lock()  # the load meter's thread and the main thread both send
        start_thread(self._watch, name="worker-watchdog")

    def send(self, **message: Any) -> None:
        with self._lock:
            self._out.write(encode(message))

    def _watch(self) -> None:
        stdin = sys.stdin.buffer
        pending = b""
        while True:
            if os.getppid() != self._parent:
                os._exit(0)  # the parent died and we were re-parented
            ready, _, _ = select.select([stdin], [], [], _WATCH_INTERVAL)
            if not ready:
                continue
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                os._exit(0)  # the parent closed our stdin (or died): nothing may outlive it
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    message = decode(line)
                except ValueError as exc:
                    self.send(event="error", type="WorkerError", message=f"bad request: {exc}")
                    continue
                if message.get("op") == "cancel":
                    self.cancel.set()
                else:
                    self.requests.put(message)


def tune_sockets(endpoints: list[tuple[str, int]], link_timeout: float) -> int:
    """Bound how long a dead link can stall the native client: on every TCP connection of this process to
    one of `endpoints`, keepalive probes and TCP_USER_TIMEOUT (data unacknowledged for `link_timeout`
    seconds aborts the connection; ggml-rpc then aborts the process, and the parent reports the node).
    Returns the number of connections tuned."""
    tuned = 0
    for _, sock in connections_to(set(endpoints)):
        try:
            tune_socket(sock, link_timeout)
            tuned += 1
        except OSError:
            continue
    return tuned


def bytes_acked(endpoints: Mapping[tuple[str, int], str]) -> dict[str, int]:
    """Per endpoint, the bytes its server has acknowledged on this process's connections to it."""
    sent = dict.fromkeys(endpoints.values(), 0)
    for peer, sock in connections_to(set(endpoints)) if endpoints else ():
        sent[endpoints[peer]] += socket_bytes_acked(sock)
    return sent


PROGRESS_INTERVAL = 0.25  # seconds between two `progress` events during a load


class _LoadMeter:
    """During a load, a thread that sends `progress` events: llama.cpp's fraction (set by its progress
    callback, `report`) and the bytes acknowledged per endpoint. A thread rather than the callback alone:
    the callback runs between tensors only, and one large tensor may take seconds on the wire."""

    def __init__(self, channel: _Channel, endpoints: Mapping[tuple[str, int], str]) -> None:
        self._channel = channel
        self._endpoints = dict(endpoints)
        self._fraction = 0.0
        self._started = time.monotonic()
        self._baseline = bytes_acked(self._endpoints)  # connections left from before (none in a worker)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self, fraction: float) -> None:
        self._fraction = fraction

    def _send(self) -> None:
        acked = bytes_acked(self._endpoints)
        sent = {ep: max(0, n - self._baseline.get(ep, 0)) for ep, n in acked.items()}
        seconds = round(time.monotonic() - self._started, 3)
        self._channel.send(event="progress", fraction=round(self._fraction, 5), seconds=seconds, sent=sent)

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL):
            self._send()

    def __enter__(self) -> _LoadMeter:
        self._thread = start_thread(self._run, name="worker-load-meter")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self._send()  # the last sample: every byte of the load


def endpoint_peers(targets: Sequence[Target]) -> dict[tuple[str, int], str]:
    """The (address, port) pairs a connection to each target has as its peer (names resolved), each
    naming the target's endpoint."""
    from orchestrator.rpc.records import parse_endpoint

    return peers_of({t.endpoint: (ep.host, ep.port) for t in targets for ep in [parse_endpoint(t.dial)]})


def _error_fields(exc: BaseException) -> dict[str, Any]:
    from orchestrator.core.errors import RpcfleetError

    if isinstance(exc, RpcfleetError):
        fields = {
            "type": type(exc).__name__,
            "message": exc.message,
            "hint": exc.hint,
            "host": exc.host,
            "dial": exc.target.dial if exc.target is not None else None,  # the parent words it alike
            "stderr": exc.stderr_tail,
        }
        outcome = getattr(exc, "outcome", None)  # a preflight refusal: the probe's outcome names the case
        if outcome is not None:
            fields["outcome"] = str(outcome)
        return fields
    return {"type": type(exc).__name__, "message": str(exc) or type(exc).__name__}


_TICK = 1.0  # seconds: a generation that shows no text (held back) still answers this often


class _Cancelled(Exception):
    """The parent cancelled the request: raised inside llama-cpp-python's loop to end it there."""


class _Generation:
    """One request: llama-cpp-python's non-streamed completion (its streaming path re-detokenizes every
    growing run of tokens that is not valid UTF-8 yet, once per token: cubic in the tokens), with three
    methods of the model replaced on the instance while it runs (`close` restores them):

    - `generate`, its token loop: counts the tokens, feeds each token's bytes once to a `TextStream`,
      whose ready text goes to `on_text` at once, and ends the loop at `max_tokens` or at a stop sequence
      (llama-cpp-python keeps sampling past both while the text ends inside a UTF-8 character: a random
      model's bytes can run to thousands of tokens) or when the parent cancels. While tokens come but no
      text does, an empty `token` answers at most every `_TICK` seconds, so that the parent's wait
      between two answers bounds a stall, not a long run of held-back text;
    - `detokenize`: llama-cpp-python decodes the completion so far after every token (quadratic: 8 s of
      2,000 tokens here); the same bytes, extended by the new tokens' pieces;
    - `create_completion`: tells the `TextStream` the request's stop sequences (a chat template adds its
      own when it calls this).

    The text is the `TextStream`'s, all of it streamed (`finish` sends the rest): the completion's tokens
    decoded at once, as llama-cpp-python's non-streamed text is."""

    def __init__(self, llm: Any, request: Mapping[str, Any], channel: _Channel, stream: bool) -> None:
        from llama_cpp.llama_tokenizer import LlamaTokenizer

        self.llm = llm
        self.channel = channel
        self.stream = stream
        after_bos = request["op"] == "complete" and request.get("prompt") == ""  # an empty prompt
        self.text = TextStream(strip_leading_space=after_bos)
        limit = request.get("max_tokens", 16)
        self.limit: int | None = limit if isinstance(limit, int) and limit > 0 else None
        self.prompt_tokens = 0
        self.tokens = 0  # generated, the end-of-generation token not counted (it is not text)
        self.ended: str | None = None  # why this loop ended the generation (else llama-cpp-python did)
        self.started = time.monotonic()
        self.first: float | None = None  # seconds to the first text
        self.answered = self.started
        self._generate = llm.generate
        self._detokenize = llm.detokenize
        self._create = llm.create_completion
        self._memo: tuple[list[int], int, bytes] | None = None  # a list detokenized, its length, its bytes
        llm.generate = self.generate
        llm.create_completion = self.create_completion
        if isinstance(llm.tokenizer_, LlamaTokenizer):  # another joins pieces otherwise: left as it is
            llm.detokenize = self.detokenize

    def close(self) -> None:
        for name in ("generate", "detokenize", "create_completion"):
            with contextlib.suppress(AttributeError):
                delattr(self.llm, name)  # back to the class's methods

    def on_text(self, piece: str) -> None:
        if self.first is None:
            self.first = time.monotonic() - self.started
        if self.stream:
            self.channel.send(event="token", text=piece)
            self.answered = time.monotonic()

    def finish(self) -> str:
        """The whole text, once llama-cpp-python returned; its end goes out as the last token."""
        rest = self.text.finish()
        if rest:
            self.on_text(rest)
        return self.text.sent

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        stop = kwargs.get("stop")
        self.text.set_stops([stop] if isinstance(stop, str) else stop or [])
        return self._create(*args, **kwargs)

    def detokenize(self, tokens: list[int], prev_tokens: Any = None, special: bool = False) -> bytes:
        memo = self._memo
        if special or not tokens:
            return bytes(self._detokenize(tokens, prev_tokens=prev_tokens, special=special))
        if memo is not None and memo[0] is tokens and len(tokens) >= memo[1]:
            raw = memo[2]  # the same list, appended to since (llama-cpp-python's completion_tokens)
        else:
            raw, memo = b"", (tokens, 0, b"")
        raw += b"".join(self._detokenize([t]) for t in tokens[memo[1] :])
        self._memo = (tokens, len(tokens), raw)
        # LlamaModel.detokenize's rule: a text that starts with a BOS loses its first space
        bos = tokens[0] == self.llm.token_bos() and raw[:1] == b" "
        return raw[1:] if bos else raw

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        import llama_cpp.llama_cpp as lc

        vocab = self.llm._model.vocab
        self.prompt_tokens = len(tokens)
        room = self.llm.n_ctx() - len(tokens)
        limit = room if self.limit is None else min(self.limit, room)
        seen = list(tokens)  # prev_tokens: a tokenizer that needs the context gets it (GGUF's does not)
        gen = self._generate(tokens, *args, **kwargs)
        sent = None
        try:
            while True:
                if self.channel.cancel.is_set():
                    raise _Cancelled
                if self.tokens >= limit or self.text.stopped:
                    self.ended = "stop" if self.text.stopped else "length"
                    return
                try:
                    token = gen.send(sent)
                except StopIteration:
                    return
                if not lc.llama_vocab_is_eog(vocab, token):  # sampled, but not part of the completion
                    self.tokens += 1
                    ready = self.text.feed(self._detokenize([token], prev_tokens=seen))
                    seen.append(token)
                    if ready:
                        self.on_text(ready)
                if time.monotonic() - self.answered >= _TICK:
                    self.answered = time.monotonic()
                    self.channel.send(event="token", text="")
                sent = yield token
        finally:
            gen.close()


def _generate(llm: Any, request: dict[str, Any], channel: _Channel) -> None:
    from orchestrator.llama.native.libllama import generation_timings

    common = {
        "max_tokens": request.get("max_tokens", 16),
        "temperature": request.get("temperature", 0.0),
        "seed": request.get("seed"),
        "stream": False,
    }
    channel.cancel.clear()
    run = _Generation(llm, request, channel, bool(request.get("stream", True)))
    try:
        if request["op"] == "chat":
            choice = llm.create_chat_completion(request["messages"], **common)["choices"][0]
        else:
            choice = llm.create_completion(request["prompt"], **common)["choices"][0]
        finish = run.ended or choice.get("finish_reason")
        text = run.finish()
    except _Cancelled:
        finish, text = "cancelled", run.text.sent
    finally:
        run.close()
    timings = generation_timings(llm)
    channel.send(
        event="done",
        text=text,
        finish_reason=finish,
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.tokens,
        prompt_seconds=round(timings.prompt_seconds, 6),
        decode_seconds=round(timings.generate_seconds, 6),
        decode_tokens=timings.generated_tokens,
        first_token_seconds=round(run.first or 0.0, 6),
        seconds=round(time.monotonic() - run.started, 6),
    )


def serve(channel: _Channel) -> int:
    from orchestrator.core.errors import RpcfleetError
    from orchestrator.llama.native.libllama import local_gpus
    from orchestrator.llama.native.loader import load_llama
    from orchestrator.llama.observed_placement import placement_of
    from orchestrator.planning.plan import Plan

    with contextlib.suppress(ImportError):  # loads the libraries, calls nothing that can abort
        import llama_cpp  # noqa: F401
    # The imports are done (the parent may have probed meanwhile). This machine's GPUs are listed here,
    # not in the parent: listing loads libllama, and on a GPU machine may create a device context.
    channel.send(event="ready", local_gpus=devices_to_json(local_gpus()))
    load = channel.requests.get()
    if load.get("op") == "close":  # a worker that only listed the GPUs (`list_local_gpus`)
        return 0
    try:
        plan = Plan.from_json(load["plan"])
        targets = {ep: Target(ep, str(dial)) for ep, dial in dict(load.get("dial") or {}).items()}
        peers = endpoint_peers(targets_for(plan.endpoints, targets))
        with _LoadMeter(channel, peers) as meter:
            llm = load_llama(
                plan,
                load["model"],
                targets=targets,
                verbose=bool(load.get("verbose")),
                on_progress=meter.report,
                **load.get("llama_kwargs", {}),
            )
    except (RpcfleetError, ValueError, TypeError, KeyError) as exc:
        channel.send(event="error", **_error_fields(exc))
        return 1
    endpoints = list(peers)
    link_timeout = float(load.get("link_timeout", 10.0))
    tuned = tune_sockets(endpoints, link_timeout)
    channel.send(
        event="loaded", pid=os.getpid(), placement=placement_to_json(placement_of(llm)), sockets=tuned
    )
    while True:
        request = channel.requests.get()
        op = request.get("op")
        if op == "close":
            llm.close()
            return 0
        if op not in ("complete", "chat"):
            channel.send(event="error", type="WorkerError", message=f"unknown op {op!r}")
            continue
        tune_sockets(endpoints, link_timeout)  # connections a server re-opened since the last request
        try:
            _generate(llm, request, channel)
        except Exception as exc:  # a bad request (too long a prompt...): answer it and keep serving
            channel.send(event="error", **_error_fields(exc))


def main() -> None:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    parent = int(os.environ.get(PARENT_ENV, "0")) or os.getppid()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # fd 1 is now the log: native prints cannot reach the protocol pipe
    sys.stdout = sys.stderr
    channel = _Channel(out, parent)
    code = serve(channel)
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: native threads (RPC dispatchers) may still hold the GIL


if __name__ == "__main__":
    main()
