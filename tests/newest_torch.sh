#!/usr/bin/env bash
# The Inductor lowering's tests (and the other torch.compile tests) under another torch
# release, in a virtual environment of its own, beside the machine's torch.
#
#   bash tests/newest_torch.sh [VERSION [FALLBACK]]     (default: 2.15.0, no fallback)
#
# VERSION comes from PyPI (a CUDA build: about 5.8 GB in the venv, about 4 minutes on CI's
# machine); FALLBACK, when given, is installed instead if VERSION cannot be (no download),
# and the script says so. The venv is $CSA_TORCH_VENV, default /tmp/csa-ops-torch-VERSION,
# kept for the next run (a second run installs nothing new). Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.15.0}"
fallback="${2:-}"
venv="${CSA_TORCH_VENV:-${TMPDIR:-/tmp}/csa-ops-torch-$version}"

# This machine's pip configuration may cap torch at the release that lies on its disk
# (a constraint file): these installs ask for a newer one, so they take no constraints.
pip_install() { PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "$@"; }

start=$SECONDS
python3 -m venv "$venv"
if ! pip_install "torch==$version"; then
    if [[ -z "$fallback" ]]; then
        echo "newest_torch: torch $version did not install" >&2
        exit 1
    fi
    echo "newest_torch: torch $version did not install; testing torch $fallback instead" >&2
    version="$fallback"
    pip_install "torch==$version"
fi
# torch first, then the package and its test extras: the resolver keeps the torch above.
pip_install -e ".[test]"
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
echo "newest_torch: torch $installed in $venv ($((SECONDS - start)) s to install," \
     "$(du -sm "$venv" | cut -f1) MB)"
"$venv/bin/python" -c "import csa_ops.lowering as L; assert L.available, 'not registered'"

# Every test file that compiles the op: the lowering itself, torch.compile of the op and
# the block, its registration at the first trace, and the demo (eager, compiled, reference).
"$venv/bin/python" -m pytest -q -n 2 --dist worksteal -p no:cacheprovider \
    tests/test_lowering.py tests/test_op_compile.py tests/test_import.py \
    tests/test_first_use.py::test_demo_runs_without_warnings
