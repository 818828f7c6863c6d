#!/usr/bin/env bash
# The Kubeflow Pipelines SDK (kfp 2.17.3) for tests/test_kubeflow.py, in its own virtual environment:
# kfp pins protobuf < 7 and requests 2.33.0, petatrain's environment does not resolve with them.
# petatrain goes in without its dependencies (petatrain.kubeflow needs only kfp).
#   kfp.sh install     create the environment (once; ~15 s on a fresh machine) and print its python
set -euo pipefail
VERSION=2.17.3
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HOME_DIR="${PETATRAIN_KFP_HOME:-${TMPDIR:-/tmp}/petatrain-kfp}"
VENV="$HOME_DIR/venv-$VERSION"

install() {
  mkdir -p "$HOME_DIR"
  exec 9>"$HOME_DIR/install.lock"
  flock 9
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import kfp" 2>/dev/null; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "kfp==$VERSION"
  fi
  # petatrain.kubeflow (the standard library and kfp only), from this checkout
  # (without the caller's PYTHONPATH: the steps run without it, from what is installed)
  if ! env -u PYTHONPATH "$VENV/bin/python" -c "import petatrain.kubeflow as k, sys; sys.exit(k.__file__ != '$ROOT/src/petatrain/kubeflow.py')" 2>/dev/null; then
    "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  fi
  echo "$VENV/bin/python"
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: kfp.sh install" >&2; exit 2 ;;
esac
