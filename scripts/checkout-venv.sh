#!/usr/bin/env bash
# checkout-venv.sh SHARED_VENV [CHECKOUT]: give a checkout its own small virtual environment, .venv.
#
# The shared venv (built once by setup.sh, keyed by the dependency versions) holds every dependency and
# stays read-only here. The checkout's .venv is a plain venv without packages of its own: a .pth file
# puts this checkout (first) and the shared venv's site-packages on its path, and its bin/ has the shared
# venv's commands (pytest, mypy, lint-imports, ruff...) running on the .venv's python, plus `rpcfleet`.
# So every checkout runs its own code, whichever checkout ran setup first. About 0.2 s to make; a
# second run only compares a stamp.
set -euo pipefail

SHARED=$(cd "$1" && pwd)
ROOT=$(cd "${2:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)
DEST="$ROOT/.venv"
STAMP="$DEST/.rpcfleet-checkout-venv"
want="shared=$SHARED root=$ROOT"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$DEST/bin/python" ]; then
  exit 0
fi
# An older set-up linked .venv to the shared venv itself: replace the link, never what it points to.
if [ -L "$DEST" ]; then rm -f "$DEST"; fi
rm -rf "$DEST"
"$SHARED/bin/python" -m venv --without-pip "$DEST"

site=$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shared_site=$("$SHARED/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The checkout first, then the shared packages (addsitedir also runs their own .pth files).
printf '%s\nimport site; site.addsitedir(%s)\n' "$ROOT" "'$shared_site'" >"$site/rpcfleet-checkout.pth"

for tool in "$SHARED"/bin/*; do
  name=$(basename "$tool")
  case "$name" in python* | activate* | Activate.ps1 | pip*) continue ;; esac
  [ -e "$DEST/bin/$name" ] && continue
  if head -c 2 "$tool" | grep -q '^#!' && head -n 1 "$tool" | grep -q "^#!$SHARED/bin/python"; then
    # A console script: the same body on this checkout's python.
    { echo "#!$DEST/bin/python"; tail -n +2 "$tool"; } >"$DEST/bin/$name"
    chmod +x "$DEST/bin/$name"
  else
    ln -s "$tool" "$DEST/bin/$name"  # a native binary (ruff) or a shell script
  fi
done
printf '#!%s\nfrom orchestrator.cli import run\n\nrun()\n' "$DEST/bin/python" >"$DEST/bin/rpcfleet"
chmod +x "$DEST/bin/rpcfleet"
echo "$want" >"$STAMP"
