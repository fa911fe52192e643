# ruff: noqa: E501 (the patches hold C++ text as it appears in llama.cpp)
"""Build-time patches to the vendored llama.cpp: each one named, its text hashed into the build key and
recorded in the manifest (`patches`), so an artifact says exactly how it differs from upstream.

A patch is a literal replacement of one anchor in one file, applied to the freshly extracted source of
a build folder of its own (never to the sdist). Applying is idempotent: a source that already holds the
replacement is left alone, so an incremental rebuild in the same folder does not patch twice.

Which patches a source must take: `keepalive` and `exit-status` are required in the pinned llama.cpp
(`REQUIRED_IN`: a build of it without them is refused, never shipped), optional only for an older one
laid out differently (llama-cpp-python 0.3.16's server, the version-skew tests'). `status` names a server
whose manifest lacks them (`lacking`). `build: on_node` applies the same patches on the node
(`artifacts.node_build`).

- `keepalive`: every accepted RPC connection gets SO_KEEPALIVE (15 s idle, 5 s interval, 3 probes) and
  TCP_USER_TIMEOUT (30 s). The vendored server serves one client at a time and sets only TCP_NODELAY,
  so a client that vanished without a FIN (a cut cable, a laptop closed, a controller behind NAT that
  lost its mapping) held it until someone proved the client gone. With the patch the kernel proves it:
  an idle dead client is dropped after 15 + 3 x 5 = 30 s, one that stopped acknowledging data after
  30 s, and the server accepts the next client, without rpcfleet or privileges. A live client, even idle
  for hours, answers the probes in its kernel and is never cut.
- `exit-status`: the vendored rpc-server returns 0 when `ggml_backend_rpc_start_server` returns, which
  it does only when it could not serve (its bind failed: an address not up yet at boot, a taken port).
  The process supervisor never retries a clean exit, so an address that appeared a second late left the
  server down, and systemd showed a failed bind as a clean stop. With the patch that end is status 1:
  the process supervisor retries it (`operations.supervise`: it stops at a port another program holds),
  the systemd unit shows it `failed` (`operations.systemd`).
- `warm-wait`: a server with a cache (`-c`) asked for a file it lacks waits while rpcfleet warms its
  cache: the warm stream first writes `.warm-wait` in the cache folder, holding its shell's pid, and
  removes it when it ends. So a load can start as soon as the warm does and trail it tensor by tensor,
  each tensor read from the cache as it lands, instead of starting after the whole warm or sending the
  tensor a second time. The wait ends when the file lands, the mark goes, the mark's process is gone
  (a warm killed before its trap ran) or after WARM_WAIT_MAX_S; then, as stock, a missing file is a
  miss and the client sends the tensor itself.
- `hash-manifest`, `hash-manifest-set-tensor`, `hash-manifest-set-tensor-async` (the client's side): where
  llama.cpp's RPC client hashes a weight tensor for the servers' cache (both its paths, the buffer's
  set_tensor and the backend's async one), it first looks the tensor up in the manifest rpcfleet wrote for
  its file (`caches.manifest`): the tensor's data must lie in a read-only file mapping of the process
  (`/proc/self/maps`), that path must still be the mapped file, the file's device, inode, size, mtime and
  ctime must be the manifest's, and the manifest must hold an entry at exactly that offset and size; then
  its hash is used, else the bytes are hashed as stock. The lookup code is `hash_manifest.cpp` beside this
  file. The client finds the manifests through `$GGML_RPC_HASH_MANIFESTS`, which rpcfleet sets for the
  engines it starts; without it the client hashes as stock. The wire and the server are unchanged.
- `cache-read`, `cache-read-declare`, `cache-read-define` (the server's side: `clients=False`, the
  clients' builds never serve and do not take them): stock, a cache hit (SET_TENSOR_HASH) is read into a
  new zero-filled vector of the tensor's size and copied from it into the weights' buffer, three passes
  over fresh memory per byte. With the patch a hit opens the cache file and reads it straight into a
  host buffer (a CPU server's), or maps it and sets the tensor from the mapping (a GPU's buffer); a file
  that cannot be opened, read or mapped is answered as a miss, and the client sends the tensor.
- `vulkan-layer-settings`: Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which the
  instance creation of ggml-vulkan uses only to turn on a validation layer's best-practice checks; the
  block is compiled only where the headers have it, else the instance is created without those settings.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.core.errors import ArtifactError

KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
USER_TIMEOUT_MS = 30_000
WARM_WAIT_MAX_S = 600  # the longest one request waits for one file being warmed
WARM_WAIT = "warm-wait"  # the patch's name, as manifests list it
WARM_WAIT_MARK = ".warm-wait"  # in a cache folder while a warm streams into it (operations/cache_stream.py)
# The llama-cpp-python versions whose source must take the server's own patches (below).
REQUIRED_IN: tuple[str, ...] = (DEFAULT_LLAMA_CPP_PYTHON_VERSION,)
# What a server needs to free itself of a vanished client and to report a failed bind: `status` warns
# when the installed manifest lacks one.
SERVER_PATCHES: tuple[str, ...] = ("keepalive", "exit-status")
# The backend whose patches the clients rpcfleet builds take (the binding's wheel, llama-server): they
# run on the controller's CPU.
CLIENT_BACKEND = "cpu"


@dataclass(frozen=True)
class SourcePatch:
    """Replace `anchor` (which must occur once) in `path` (relative to vendor/llama.cpp) by `replacement`.

    `backends`: the backends it applies to (empty: all). `optional`: a source without the anchor (an
    older llama.cpp, laid out differently) is built without it, and its manifest does not list it;
    `required_in`: the llama-cpp-python versions whose source must take it even so. `clients`: whether
    the clients' builds (the binding's wheel, llama-server) take it; a patch to the server's side alone
    does not change their keys."""

    name: str
    path: str
    anchor: str
    replacement: str
    backends: tuple[str, ...] = ()
    optional: bool = False
    required_in: tuple[str, ...] = ()
    clients: bool = True

    @property
    def digest(self) -> str:
        data = "\0".join((self.path, self.anchor, self.replacement)).encode()
        return hashlib.sha256(data).hexdigest()[:12]

    @property
    def label(self) -> str:
        """How the manifest records it: `name@digest`."""
        return f"{self.name}@{self.digest}"

    def applies_to(self, backend: str) -> bool:
        return not self.backends or backend in self.backends


_KEEPALIVE_ANCHOR = """    if (!set_no_delay(client_socket_fd)) {
        GGML_LOG_ERROR("Failed to set TCP_NODELAY\\n");
        return nullptr;
    }
"""

_KEEPALIVE = (
    _KEEPALIVE_ANCHOR
    + f"""#ifndef _WIN32
    {{
        // rpcfleet keepalive patch: a client that vanished without a FIN frees the server by itself.
        int on = 1, idle = {KEEPALIVE_IDLE_S}, interval = {KEEPALIVE_INTERVAL_S}, probes = {KEEPALIVE_PROBES};
        if (setsockopt(client_socket_fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on)) != 0) {{
            GGML_LOG_ERROR("Failed to set SO_KEEPALIVE\\n");
        }}
#  ifdef TCP_KEEPIDLE
        setsockopt(client_socket_fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
#  elif defined(TCP_KEEPALIVE)
        setsockopt(client_socket_fd, IPPROTO_TCP, TCP_KEEPALIVE, &idle, sizeof(idle));
#  endif
#  ifdef TCP_KEEPINTVL
        setsockopt(client_socket_fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
#  endif
#  ifdef TCP_KEEPCNT
        setsockopt(client_socket_fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
#  endif
#  ifdef TCP_USER_TIMEOUT
        unsigned int user_timeout_ms = {USER_TIMEOUT_MS};
        setsockopt(client_socket_fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
#  endif
        (void) idle; (void) interval; (void) probes;
    }}
#endif
"""
)

_EXIT_STATUS_ANCHOR = """    start_server_fn(endpoint.c_str(), cache_dir, params.n_threads, devices.size(), devices.data());
    return 0;
"""

_EXIT_STATUS = """    start_server_fn(endpoint.c_str(), cache_dir, params.n_threads, devices.size(), devices.data());
    // rpcfleet exit-status patch: the server returns only when it could not serve (a failed bind)
    return 1;
"""

_WARM_WAIT_ANCHOR = """    fs::path cache_file = fs::path(cache_dir) / hash_str;
    std::error_code ec;
    if (!fs::exists(cache_file, ec)) {
        return false;
    }
"""

_WARM_WAIT = (
    """    fs::path cache_file = fs::path(cache_dir) / hash_str;
    std::error_code ec;
    {
        // rpcfleet warm-wait patch: while a warm of this cache lives (its mark holds its pid), wait.
"""
    + f'        fs::path marker = fs::path(cache_dir) / "{WARM_WAIT_MARK}";\n'
    + f"        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds({WARM_WAIT_MAX_S});\n"
    + """        while (!fs::exists(cache_file, ec) && std::chrono::steady_clock::now() < deadline) {
            std::ifstream marked(marker);
            long pid = 0;
            if (!(marked >> pid) || pid <= 0 || !fs::exists(fs::path("/proc") / std::to_string(pid), ec)) {
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    if (!fs::exists(cache_file, ec)) {
        return false;
    }
"""
)

_LAYER_SETTINGS_ANCHOR = """    VkBool32 enable_best_practice = layer_settings;
    std::vector<vk::LayerSettingEXT> settings = {
        {
            "VK_LAYER_KHRONOS_validation",
            "validate_best_practices",
            vk::LayerSettingTypeEXT::eBool32,
            1,
            &enable_best_practice
        },
    };
    vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);
    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);
"""

_LAYER_SETTINGS = (
    "#ifdef VK_EXT_layer_settings  // rpcfleet patch: headers older than Vulkan 1.3.261 lack it\n"
    + _LAYER_SETTINGS_ANCHOR
    + "#else\n"
    + "    (void) layer_settings;\n"
    + "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n"
    + "#endif\n"
)

CACHE_READ = "cache-read"  # the patch's name, as manifests list it

_CACHE_READ_DECLARE_ANCHOR = """    bool get_cached_file(uint64_t hash, std::vector<uint8_t> & data);
"""
_CACHE_READ_DECLARE = """    // rpcfleet cache-read patch: given `fd`, the file is opened (*fd) instead of read into `data`.
    bool get_cached_file(uint64_t hash, std::vector<uint8_t> & data, int * fd = nullptr);
"""

_CACHE_READ_DEFINE_ANCHOR = """bool rpc_server::get_cached_file(uint64_t hash, std::vector<uint8_t> & data) {
"""
_CACHE_READ_DEFINE = """#ifndef _WIN32
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

bool rpc_server::get_cached_file(uint64_t hash, std::vector<uint8_t> & data, int * fd) {
"""

# set_tensor_hash's checks of the request (deserialize, bounds), kept as they are between its new head
# and tail.
_SET_TENSOR_HASH_CHECKS = """    struct ggml_init_params params {
        /*.mem_size   =*/ ggml_tensor_overhead(),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx_ptr { ggml_init(params) };
    GGML_ASSERT(ctx_ptr != nullptr);
    ggml_context * ctx = ctx_ptr.get();
    ggml_tensor * tensor = deserialize_tensor(ctx, &request.tensor);
    if (tensor == nullptr || tensor->buffer == nullptr) {
        GGML_LOG_ERROR("[%s] error deserializing tensor\\n", __func__);
        return false;
    }
    LOG_DBG("[%s] buffer: %p, data: %p, offset: %" PRIu64 ", size: %zu, hash: %" PRIx64 "\\n",
            __func__, (void*)tensor->buffer, tensor->data, request.offset, size, request.hash);

    // sanitize tensor->data
    {
        const size_t p0 = (size_t) ggml_backend_buffer_get_base(tensor->buffer);
        const size_t p1 = p0 + ggml_backend_buffer_get_size(tensor->buffer);

        if (request.tensor.data + request.offset < p0
         || request.tensor.data + request.offset >= p1
         || size > (p1 - request.tensor.data - request.offset)) {
            GGML_LOG_ERROR("[%s] tensor data region (data=0x%" PRIx64 ", offset=%" PRIu64 ", size=%zu, hash=0x%" PRIx64 ") out of buffer bounds [0x%zx, 0x%zx)\\n",
                           __func__, request.tensor.data, request.offset, size, request.hash, p0, p1);
            return false;
        }
    }
"""

# stock set_tensor_hash, whole (the patch keeps it where there is no POSIX file API)
_STOCK_SET_TENSOR_HASH = (
    """bool rpc_server::set_tensor_hash(const rpc_msg_set_tensor_hash_req & request, rpc_msg_set_tensor_hash_rsp & response)
{
    std::vector<uint8_t> cached_file;
    if (!get_cached_file(request.hash, cached_file)) {
        response.result = 0;
        return true;
    }
    size_t size = cached_file.size();
"""
    + _SET_TENSOR_HASH_CHECKS
    + """    ggml_backend_tensor_set(tensor, cached_file.data(), request.offset, size);
    response.result = 1;
    return true;
}
"""
)

# From the read at the end of get_cached_file to the end of set_tensor_hash, which follows it.
_CACHE_READ_ANCHOR = (
    """    std::ifstream ifs(cache_file, std::ios::binary);
    ifs.seekg(0, std::ios::end);
    size_t size = ifs.tellg();
    ifs.seekg(0, std::ios::beg);
    data.resize(size);
    ifs.read((char *)data.data(), size);
    return true;
}

"""
    + _STOCK_SET_TENSOR_HASH
)

_CACHE_READ = (
    """#ifndef _WIN32
    if (fd != nullptr) {
        *fd = open(cache_file.c_str(), O_RDONLY | O_CLOEXEC);
        return *fd >= 0;
    }
#endif
    std::ifstream ifs(cache_file, std::ios::binary);
    ifs.seekg(0, std::ios::end);
    size_t size = ifs.tellg();
    ifs.seekg(0, std::ios::beg);
    data.resize(size);
    ifs.read((char *)data.data(), size);
    return true;
}

#ifndef _WIN32
// rpcfleet cache-read patch: `size` bytes of `fd` from its start into `dst`; false on a short file.
static bool rpcfleet_read_all(int fd, uint8_t * dst, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t got = pread(fd, dst + done, size - done, (off_t) done);
        if (got <= 0) {
            return false;
        }
        done += (size_t) got;
    }
    return true;
}

// rpcfleet cache-read patch: a hit is set from the cache file itself, not from a zero-filled copy of it.
bool rpc_server::set_tensor_hash(const rpc_msg_set_tensor_hash_req & request, rpc_msg_set_tensor_hash_rsp & response)
{
    int fd = -1;
    std::vector<uint8_t> unused;
    struct stat st {};
    if (!get_cached_file(request.hash, unused, &fd) || fstat(fd, &st) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        response.result = 0;  // a miss: the client sends the tensor
        return true;
    }
    struct closer { int fd; ~closer() { close(fd); } } closes { fd };
    size_t size = (size_t) st.st_size;
"""
    + _SET_TENSOR_HASH_CHECKS
    + """    if (size == 0) {
        response.result = 1;
        return true;
    }
    // A host buffer (a CPU server's) takes the file's bytes where they belong; any other (a GPU's) is set
    // from the file's mapping, the page cache itself.
    if (ggml_backend_buffer_is_host(tensor->buffer)) {
        response.result = rpcfleet_read_all(fd, (uint8_t *) tensor->data + request.offset, size) ? 1 : 0;
        return true;
    }
    void * mapped = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) {
        response.result = 0;
        return true;
    }
    ggml_backend_tensor_set(tensor, mapped, request.offset, size);
    munmap(mapped, size);
    response.result = 1;
    return true;
}
#else
"""
    + _STOCK_SET_TENSOR_HASH
    + "#endif\n"
)

# The whole FNV-1a function, so the lookup and its wrapper land right after it (file scope).
_FNV_ANCHOR = """static uint64_t fnv_hash(const uint8_t * data, size_t len, uint64_t hash = 0xcbf29ce484222325ULL) {
    const uint64_t fnv_prime = 0x100000001b3ULL;

    for (size_t i = 0; i < len; ++i) {
        hash ^= data[i];
        hash *= fnv_prime;
    }
    return hash;
}
"""

HASH_MANIFEST = "hash-manifest"  # the patch's name, as manifests list it
HASH_MANIFEST_ENV = "GGML_RPC_HASH_MANIFESTS"  # the folder the patched client reads manifests from
HASH_LOG_ENV = "GGML_RPC_HASH_LOG"  # a file the patched client appends one line per weight tensor to

_HASH_MANIFEST = (
    _FNV_ANCHOR
    + Path(__file__).with_name("hash_manifest.cpp").read_text()
    + """
// rpcfleet hash-manifest patch: what both hashing paths of the client call instead of fnv_hash.
static uint64_t rpc_weight_hash(const void * data, size_t size) {
    uint64_t hash = 0;
    const char * why = nullptr;
    const bool listed = rpcfleet_manifest::lookup(data, size, hash, why);
    if (!listed) {
        hash = fnv_hash((const uint8_t *) data, size);
    }
    rpcfleet_manifest::note(listed ? "manifest" : "hashed", why, size, hash);
    return hash;
}
"""
)

# The two call sites differ only in what follows (the async one carries its TODO).
_SET_TENSOR_HASH_ANCHOR = """        request->hash = fnv_hash((const uint8_t*)data, size);
        rpc_msg_set_tensor_hash_rsp response;
        ctx->dispatcher->send(RPC_CMD_SET_TENSOR_HASH"""

_SET_TENSOR_HASH_ASYNC_ANCHOR = """        request->hash = fnv_hash((const uint8_t*)data, size);
        rpc_msg_set_tensor_hash_rsp response;
        // TODO: make this async
"""


def _from_manifest(anchor: str) -> str:
    return anchor.replace(
        "fnv_hash((const uint8_t*)data, size);",
        "rpc_weight_hash(data, size);  // rpcfleet hash-manifest patch",
    )


PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch(
        "keepalive",
        "ggml/src/ggml-rpc/transport.cpp",
        _KEEPALIVE_ANCHOR,
        _KEEPALIVE,
        optional=True,  # llama.cpp before the transport split (protocol 2, the skew tests' server)
        required_in=REQUIRED_IN,
    ),
    SourcePatch(
        "exit-status",
        "tools/rpc/rpc-server.cpp",
        _EXIT_STATUS_ANCHOR,
        _EXIT_STATUS,
        optional=True,  # an older llama.cpp lays its server out differently (the skew tests' server)
        required_in=REQUIRED_IN,
    ),
    SourcePatch(
        WARM_WAIT,
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _WARM_WAIT_ANCHOR,
        _WARM_WAIT,
        optional=True,  # an older llama.cpp reads its cache differently (the skew tests' server)
    ),
    SourcePatch(
        HASH_MANIFEST,
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _FNV_ANCHOR,
        _HASH_MANIFEST,
        optional=True,  # an older llama.cpp's client (the skew tests' server) is never rpcfleet's client
        required_in=REQUIRED_IN,
    ),
    SourcePatch(
        f"{HASH_MANIFEST}-set-tensor",
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _SET_TENSOR_HASH_ANCHOR,
        _from_manifest(_SET_TENSOR_HASH_ANCHOR),
        optional=True,
        required_in=REQUIRED_IN,
    ),
    SourcePatch(
        f"{HASH_MANIFEST}-set-tensor-async",
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _SET_TENSOR_HASH_ASYNC_ANCHOR,
        _from_manifest(_SET_TENSOR_HASH_ASYNC_ANCHOR),
        optional=True,
        required_in=REQUIRED_IN,
    ),
    SourcePatch(
        f"{CACHE_READ}-declare",
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _CACHE_READ_DECLARE_ANCHOR,
        _CACHE_READ_DECLARE,
        optional=True,  # an older llama.cpp reads its cache differently (the skew tests' server)
        required_in=REQUIRED_IN,
        clients=False,
    ),
    SourcePatch(
        f"{CACHE_READ}-define",
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _CACHE_READ_DEFINE_ANCHOR,
        _CACHE_READ_DEFINE,
        optional=True,
        required_in=REQUIRED_IN,
        clients=False,
    ),
    SourcePatch(
        CACHE_READ,
        "ggml/src/ggml-rpc/ggml-rpc.cpp",
        _CACHE_READ_ANCHOR,
        _CACHE_READ,
        optional=True,
        required_in=REQUIRED_IN,
        clients=False,
    ),
    SourcePatch(
        "vulkan-layer-settings",
        "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        _LAYER_SETTINGS_ANCHOR,
        _LAYER_SETTINGS,
        backends=("vulkan",),
        optional=True,  # an older ggml-vulkan has no layer settings at all
    ),
)


def patches_for(backend: str, version: str | None = None) -> tuple[SourcePatch, ...]:
    """The patches of a `backend` build; for llama-cpp-python `version`, those it requires are no
    longer optional (labels, and so build keys, do not change)."""
    chosen = tuple(p for p in PATCHES if p.applies_to(backend))
    if version is None:
        return chosen
    return tuple(replace(p, optional=False) if version in p.required_in else p for p in chosen)


def client_patches(version: str | None = None) -> tuple[SourcePatch, ...]:
    """The patches of the clients' builds (the binding's wheel, llama-server): CLIENT_BACKEND's, less
    those to the server's side alone."""
    return tuple(p for p in patches_for(CLIENT_BACKEND, version) if p.clients)


def lacking(labels: Iterable[str]) -> tuple[str, ...]:
    """Pure: the names of SERVER_PATCHES a manifest's `patches` (labels) does not list."""
    names = {label.partition("@")[0] for label in labels}
    return tuple(name for name in SERVER_PATCHES if name not in names)


def patch_texts(
    texts: Mapping[str, str], patches: Sequence[SourcePatch]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Pure: apply `patches` to the source files `texts` (path relative to vendor/llama.cpp -> text; a
    missing file is ""). Returns the files that changed (their new text) and the labels of the patches
    that apply (already applied counts). A required patch whose anchor is missing, or an anchor found
    twice, is an error."""
    current = dict(texts)
    changed: dict[str, str] = {}
    applied: list[str] = []
    for patch in patches:
        text = current.get(patch.path, "")
        if patch.replacement in text:
            applied.append(patch.label)
            continue
        count = text.count(patch.anchor)
        if count == 0 and patch.optional:
            continue
        if count != 1:
            raise ArtifactError(
                f"patch {patch.name}: {patch.path} holds its anchor {count} times (expected once)",
                hint="this llama.cpp differs from the one the patch was written for",
            )
        current[patch.path] = changed[patch.path] = text.replace(patch.anchor, patch.replacement)
        applied.append(patch.label)
    return changed, tuple(applied)


def apply_patches(llama_dir: Path, patches: Sequence[SourcePatch]) -> tuple[str, ...]:
    """Apply `patches` to the vendored llama.cpp at `llama_dir` (`patch_texts`); the labels of those that
    apply. Nothing is written when one is refused."""
    texts: dict[str, str] = {}
    for patch in patches:
        try:
            texts[patch.path] = (llama_dir / patch.path).read_text()
        except FileNotFoundError:
            texts[patch.path] = ""
    changed, applied = patch_texts(texts, patches)
    for path, text in changed.items():
        (llama_dir / path).write_text(text)
    return applied


def lacking_note(names: Sequence[str]) -> str:
    """What `status` says of a server built without SERVER_PATCHES `names` (its manifest's word)."""
    effects = {
        "keepalive": "a client that vanishes without a FIN holds it until its TCP gives up (hours)",
        "exit-status": "a failed bind ends it with status 0, which no supervisor restarts",
    }
    said = "; ".join(effects[name] for name in names if name in effects)
    return (
        f"built without the {', '.join(names)} patch{'es' if len(names) > 1 else ''} (its manifest): {said}; "
        "a server rpcfleet builds from the pinned source has them"
    )


def _main(argv: Sequence[str]) -> int:
    """`python -m orchestrator.artifacts.patches labels` prints the labels of the patches the binding's
    wheel takes (scripts/setup.sh keys the wheel by them); `... apply DIR` applies them to the vendored
    llama.cpp at DIR. Standard library only: set-up runs it before any dependency is installed."""
    chosen = client_patches(DEFAULT_LLAMA_CPP_PYTHON_VERSION)
    if list(argv) == ["labels"]:
        print(" ".join(p.label for p in chosen))
        return 0
    if len(argv) == 2 and argv[0] == "apply":
        try:
            print(" ".join(apply_patches(Path(argv[1]), chosen)))
        except (ArtifactError, OSError) as exc:
            print(f"patching {argv[1]} failed: {exc}", file=sys.stderr)
            return 1
        return 0
    print(
        "usage: python -m orchestrator.artifacts.patches labels | apply VENDORED_LLAMA_CPP", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
