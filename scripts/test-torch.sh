#!/usr/bin/env bash
# Runs the test suite against one torch release, in a virtual environment of its own
# (.venv-torch-VERSION, ignored by git), so that a second torch never replaces the first.
#   scripts/test-torch.sh 2.14.1 [pytest arguments]
set -euo pipefail
version=${1:?usage: scripts/test-torch.sh TORCH_VERSION [pytest args]}
shift
cd "$(dirname "$0")/.."
venv=".venv-torch-$version"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
# torch first and pinned: the package's range must not pick another release
"$venv/bin/pip" install -q "torch==$version"
"$venv/bin/pip" install -q -e ".[test]" "torch==$version"
"$venv/bin/python" -c "import torch, sys; print(f'testing with torch {torch.__version__}'); sys.exit(torch.__version__.split('+')[0] != '$version')"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
