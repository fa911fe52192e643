#!/usr/bin/env bash
# install-shim.sh BIN_DIR CHECKOUT: put an `rpcfleet` command on PATH (called by setup.sh).
#
# The shim runs the checkout the current directory is in (any checkout whose set-up made a .venv), and
# otherwise CHECKOUT, the one set up last: several clones on one machine each run their own code when you
# are inside them, as with `.venv/bin/rpcfleet`. A file named rpcfleet in BIN_DIR that this script did not
# write (a `pip install`, say) is left alone. Prints one line: what it did, or why it did nothing.
set -euo pipefail

BIN=$1
CHECKOUT=$(cd "$2" && pwd)
case $CHECKOUT in *\'*) echo "not installed: the path $CHECKOUT has a quote"; exit 0 ;; esac
SHIM="$BIN/rpcfleet"
MARK="# rpcfleet shim (scripts/install-shim.sh)"

if [ -e "$SHIM" ] && ! grep -qF "$MARK" "$SHIM" 2>/dev/null; then
  echo "left alone: $SHIM (not written by rpcfleet's set-up)"
  exit 0
fi
mkdir -p "$BIN"
tmp=$(mktemp "$BIN/.rpcfleet.XXXXXX")
cat >"$tmp" <<EOF
#!/bin/sh
$MARK
# Runs the rpcfleet checkout that contains the current directory, else the one set up last.
dir=\$PWD
while [ -n "\$dir" ]; do
  if [ -x "\$dir/.venv/bin/rpcfleet" ] && [ -f "\$dir/scripts/install-shim.sh" ]; then
    exec "\$dir/.venv/bin/rpcfleet" "\$@"
  fi
  dir=\${dir%/*}
done
exec '$CHECKOUT/.venv/bin/rpcfleet' "\$@"
EOF
chmod 0755 "$tmp"
mv -f "$tmp" "$SHIM"
echo "installed: $SHIM (runs $CHECKOUT outside a checkout)"
