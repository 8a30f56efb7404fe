#!/usr/bin/env bash
# versionwatch's GPU check (issue #16): the tests marked `cuda` on a machine with a GPU.
#
#   bash tools/gpu_check.sh [REPO]  REPO: a versionwatch checkout (default: the current folder)
#
# Runs `python -m pytest -q tests/test_cuda.py tests/test_repair.py tests/test_native.py -k cuda` with REPO's
# src/ first on the path, under a 270 s limit (the whole script stays under 5 minutes),
# then prints a summary: the GPU, torch, and each test's outcome (skips with their reason;
# the NCCL test needs 2 GPUs and skips on one). The log and a JUnit XML go to $OUT when it
# is set (the device tool brings them back), else to a temporary folder.
# The exit status is pytest's (0: all passed or skipped), 2 for a wrong REPO, 3 when torch
# sees no GPU (there every test would only skip; GPU_CHECK_ALLOW_CPU=1 runs them anyway,
# to try the script itself on a machine without one).
#
# On the nvidia-h200 device machine: python3 there holds torch with CUDA and pytest, so
# nothing needs installing; from the checkout that travels, e.g.
#   run(command="bash tools/gpu_check.sh", timeout_s=300)

set -u
REPO=$(cd "${1:-.}" && pwd) || exit 2
PY=${PYTHON:-python3}
DEST=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
LIMIT=${GPU_CHECK_LIMIT:-270}

cd "$REPO" || exit 2
if [ ! -f src/versionwatch/__init__.py ] || [ ! -f tests/test_cuda.py ]; then
    echo "gpu_check: $REPO is not a versionwatch checkout (no src/versionwatch, tests/test_cuda.py)"
    exit 2
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Some of test_repair's setups compile: keep inductor's cache out of the checkout.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/gpu_check_inductor}

echo "== gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $REPO, $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
"$PY" - <<'EOF'
import os
import sys

import torch

import versionwatch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"versionwatch from {os.path.dirname(versionwatch.__file__)}")
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
if n == 0:
    print("gpu_check: torch sees no GPU: every test would skip")
    sys.exit(0 if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" else 3)
EOF
status=$?
[ $status -eq 0 ] || exit $status

start=$(date +%s)
set -o pipefail
timeout -k 10 "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    --junitxml="$DEST/gpu_check.xml" \
    tests/test_cuda.py tests/test_repair.py tests/test_native.py -k cuda 2>&1 | tee "$DEST/gpu_check.log"
rc=$?
set +o pipefail
elapsed=$(( $(date +%s) - start ))

echo
echo "== gpu_check summary"
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "pytest ran past ${LIMIT} s and was stopped (exit $rc)"
fi
"$PY" - "$DEST/gpu_check.xml" "$elapsed" "$rc" <<'EOF'
import collections
import os
import sys
import xml.etree.ElementTree as ET

path, elapsed, rc = sys.argv[1], sys.argv[2], sys.argv[3]
if not os.path.exists(path):
    print(f"no JUnit XML ({path}): pytest did not finish; exit status {rc}, {elapsed} s")
    sys.exit(0)
outcomes = collections.Counter()
# Parametrized cases with the same outcome and reason make one line (the 40 programs).
groups: dict[tuple[str, str, str], int] = collections.Counter()
for case in ET.parse(path).getroot().iter("testcase"):
    name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    outcomes[kind] += 1
    child = case.find(kind)
    why = (child.get("message") or "").splitlines()[0][:200] if child is not None else ""
    groups[(kind, name.partition("[")[0], why)] += 1
print(", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) or "no tests collected",
      f"in {elapsed} s; pytest exit status {rc}")
for (kind, name, why), n in groups.items():
    print(f"  {kind:8} {name}" + (f" (x{n})" if n > 1 else "") + (f": {why}" if why else ""))
EOF
echo "log: $DEST/gpu_check.log, JUnit XML: $DEST/gpu_check.xml"
exit $rc
