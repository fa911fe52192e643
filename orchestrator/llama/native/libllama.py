"""Native registration of RPC endpoints through libllama's own ggml (process-wide, lock-guarded)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.log import get_logger
from orchestrator.core.target import Target
from orchestrator.llama.errors import DeviceMismatchError, RpcUnavailableError
from orchestrator.planning.plan import PlanDevice

# Read by ggml at library load (its terminate handler) and at abort time: without it an abort tries to
# attach gdb to the process. Set before llama_cpp is ever imported (it is imported lazily below).
os.environ.setdefault("GGML_NO_BACKTRACE", "1")


# The llama-cpp-python release this loader is written against, and the RPC protocol it speaks.
SUPPORTED_LLAMA_CPP = "0.3.36"


@dataclass(frozen=True)
class RegisteredEndpoint:
    endpoint: str
    server_reg: int  # ggml_backend_reg_t
    devices: tuple[int, ...]  # ggml_backend_dev_t, by the server's device index
    names: tuple[str, ...]  # RPC<k>
    descriptions: tuple[str, ...]


# One lock for the registry, the live-model counts and model construction (the params wrapper and the log
# callback are process-wide).
LOCK = threading.RLock()


REGISTRY: dict[str, RegisteredEndpoint] = {}


# Endpoints held by a live model of this process: its connection stays open for the model's life, so a
# probe from here would only see our own connection as "busy".
LIVE: dict[str, int] = {}


def registered_endpoints() -> dict[str, RegisteredEndpoint]:
    """The endpoints registered natively in this process (they stay until it exits)."""
    with LOCK:
        return dict(REGISTRY)


def live_endpoints() -> dict[str, int]:
    """Endpoints in use by models of this process that are not closed yet, with their model count."""
    with LOCK:
        return {k: v for k, v in LIVE.items() if v > 0}


class Native:
    """ggml entry points resolved from libllama's handle, with argtypes/restype set."""

    def __init__(self, llama_cpp_mod: Any) -> None:
        lib = llama_cpp_mod._lib
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t

        def fn(name: str, argtypes: list[Any], restype: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = argtypes, restype
            return f

        self.reg_by_name = fn("ggml_backend_reg_by_name", [cp], vp)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", [vp, cp], vp)
        self.reg_dev_count = fn("ggml_backend_reg_dev_count", [vp], sz)
        self.reg_dev_get = fn("ggml_backend_reg_dev_get", [vp, sz], vp)
        self.dev_name = fn("ggml_backend_dev_name", [vp], cp)
        self.dev_description = fn("ggml_backend_dev_description", [vp], cp)
        self.dev_by_name = fn("ggml_backend_dev_by_name", [cp], vp)
        self.dev_type = fn("ggml_backend_dev_type", [vp], ctypes.c_int)
        self.dev_count = fn("ggml_backend_dev_count", [], sz)
        self.dev_get = fn("ggml_backend_dev_get", [sz], vp)
        self.dev_memory = fn("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None)
        self.dev_buffer_type = fn("ggml_backend_dev_buffer_type", [vp], vp)
        self.buft_alignment = fn("ggml_backend_buft_get_alignment", [vp], sz)
        self.reg_count = fn("ggml_backend_reg_count", [], sz)
        self.reg_get = fn("ggml_backend_reg_get", [sz], vp)
        self.reg_name = fn("ggml_backend_reg_name", [vp], cp)
        self.load_all_from_path = fn("ggml_backend_load_all_from_path", [cp], None)
        self.dynamic_backends = _load_dynamic_backends(self, Path(lib._name).parent)

    def alignment(self, dev: int) -> int:
        return int(self.buft_alignment(self.dev_buffer_type(dev)))

    def memory(self, dev: int) -> tuple[int, int]:
        """(free, total) ggml reports for `dev`. For an RPC device this talks to its server over the
        registered connection: only for endpoints known to be up."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def add_server(self) -> Callable[[bytes], int | None]:
        reg = self.reg_by_name(b"RPC")
        if not reg:
            raise RpcUnavailableError(
                "llama-cpp-python was built without RPC (no 'RPC' backend)",
                hint='reinstall it with CMAKE_ARGS="-DGGML_RPC=ON"',
            )
        addr = self.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not addr:
            raise RpcUnavailableError("the RPC backend has no ggml_backend_rpc_add_server")
        return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)


_NATIVE: Native | None = None


def has_dynamic_backends(lib_dir: Path) -> bool:
    """Whether the binding was built with GGML_BACKEND_DL: its backend libraries (libggml-cpu...) are
    plugins exporting `ggml_backend_init`, loaded by `ggml_backend_load_all`, not linked."""
    for path in sorted(lib_dir.glob("libggml-*.so")):
        if path.name.startswith("libggml-base"):
            continue
        try:
            if hasattr(ctypes.CDLL(str(path)), "ggml_backend_init"):
                return True
        except OSError:
            continue
    return False


def _load_dynamic_backends(native: Native, lib_dir: Path) -> bool:
    """The drop-in spec's order: ggml's backends are loaded before any RPC registration. A build with dynamic
    backends needs `ggml_backend_load_all` (from the binding's library folder); a linked build has
    them already, and loading them again would register a second copy. Returns whether it loaded."""
    if not has_dynamic_backends(lib_dir):
        return False
    native.load_all_from_path(str(lib_dir).encode())
    get_logger().debug("ggml_backends_loaded", path=str(lib_dir), count=int(native.reg_count()))
    return True


@dataclass(frozen=True)
class GenerationTimings:
    """llama.cpp's own counters for the last completion (not the stream's chunks, which
    llama-cpp-python holds back while a token ends inside a UTF-8 character)."""

    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int  # tokens evaluated after the prompt
    generate_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0


def generation_timings(llm: Any) -> GenerationTimings:
    """Prompt and generation counters of `llm`'s last completion (llama_perf_context)."""
    perf = llama_cpp_module().llama_perf_context(llm._ctx.ctx)
    return GenerationTimings(
        prompt_tokens=int(perf.n_p_eval),
        prompt_seconds=perf.t_p_eval_ms / 1000,
        generated_tokens=int(perf.n_eval),
        generate_seconds=perf.t_eval_ms / 1000,
    )


_GPU_TYPES = (1, 2)  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2, ACCEL 3


def local_gpus() -> list[PlanDevice]:
    """This machine's GPUs as llama.cpp sees them (CUDA0, Vulkan0...), with their free memory, for
    the device list after the RPC devices. Empty without llama-cpp-python or without GPUs."""
    try:
        native = get_native()
    except RpcUnavailableError:
        return []
    found: list[PlanDevice] = []
    gpus = [native.dev_get(i) for i in range(native.dev_count())]
    gpus = [d for d in gpus if d and native.dev_type(d) in _GPU_TYPES]
    # llama.cpp uses integrated GPUs only when there is no discrete one.
    if any(native.dev_type(d) == 1 for d in gpus):
        gpus = [d for d in gpus if native.dev_type(d) == 1]
    for dev in gpus:
        free, total = native.memory(dev)
        name = (native.dev_name(dev) or b"").decode()
        found.append(
            PlanDevice(
                endpoint=None,
                index=len(found),
                name=name,
                description=(native.dev_description(dev) or b"").decode(),
                total=total,
                free=free,
                usable=free,
                alignment=native.alignment(dev),
            )
        )
    return found


def llama_cpp_module() -> Any:
    """The llama_cpp.llama_cpp module (imported here only), checked for version and RPC support."""
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as lc
    except ImportError as exc:
        raise RpcUnavailableError(
            f"llama-cpp-python is not installed ({exc})",
            hint=f'CMAKE_ARGS="-DGGML_RPC=ON" pip install llama-cpp-python=={SUPPORTED_LLAMA_CPP}',
        ) from exc
    if getattr(llama_cpp, "__version__", None) != SUPPORTED_LLAMA_CPP:
        get_logger().warning("llama_cpp_version_untested", version=getattr(llama_cpp, "__version__", None))
    if not lc.llama_supports_rpc():
        raise RpcUnavailableError(
            "llama-cpp-python was built without RPC", hint='reinstall it with CMAKE_ARGS="-DGGML_RPC=ON"'
        )
    return lc


def get_native() -> Native:
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = Native(llama_cpp_module())
    return _NATIVE


def register(endpoint: str, expected_devices: int, *, target: Target | None = None) -> RegisteredEndpoint:
    """Register `endpoint` natively (once per process). Call only after a successful preflight.
    `target`: the server `endpoint` dials (an SSH forward's), what errors name."""
    server = target or endpoint
    with LOCK:
        known = REGISTRY.get(endpoint)
        if known is not None:
            return known
        native = get_native()
        add = native.add_server()
        # Native: aborts the process if the server vanished since the preflight (a small window).
        server_reg = add(endpoint.encode())
        if not server_reg:
            raise DeviceMismatchError("the server reports no devices", host=server)
        count = native.reg_dev_count(server_reg)
        devices = tuple(int(native.reg_dev_get(server_reg, i)) for i in range(count))
        entry = RegisteredEndpoint(
            endpoint=endpoint,
            server_reg=int(server_reg),
            devices=devices,
            names=tuple(native.dev_name(d).decode() for d in devices),
            descriptions=tuple(native.dev_description(d).decode() for d in devices),
        )
        REGISTRY[endpoint] = entry
        get_logger().debug("rpc_registered", endpoint=endpoint, devices=entry.names)
        if count != expected_devices:
            raise DeviceMismatchError(
                f"registered {count} device(s) but the preflight saw {expected_devices}", host=server
            )
        return entry


@contextlib.contextmanager
def capture_log(lc: Any, sink: list[tuple[int, str]], verbose: bool) -> Iterator[None]:
    """Route llama.cpp's (and ggml's) log into `sink` while the block runs; echo it when verbose. The
    previous callback is restored afterwards."""

    def record(level: int, text: bytes, user_data: Any) -> None:
        decoded = text.decode("utf-8", "replace")
        sink.append((level, decoded))
        if verbose:
            sys.stderr.write(decoded)

    callback = lc.llama_log_callback(record)

    previous = None
    with contextlib.suppress(Exception):  # llama_log_get exists in 0.3.36; keep working without it
        prev_cb = lc.llama_log_callback()
        prev_ud = ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
        previous = (prev_cb, prev_ud)
    lc.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield
    finally:
        if previous is not None and previous[0]:
            lc.llama_log_set(previous[0], previous[1])
        else:
            import llama_cpp._logger as default_logger

            lc.llama_log_set(default_logger.llama_log_callback, ctypes.c_void_p(0))
