#!/usr/bin/env bash
# Re-resolve requirements.txt's ranges to the newest versions in a fresh virtual environment, run the suite there,
# and write requirements.lock from it. It reports which packages moved and which tests the move changed: a test that
# fails under the new versions is rerun under the current lock (.venv, made from requirements.lock), and one that
# passes there was changed by a new version. The lock is only replaced when the new environment passes the suite
# (or with --force, to record a lock whose failures are being fixed). scripts/held.txt holds the versions kept back,
# each with its reason.
#   bash scripts/relock.sh [--force] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
force=0; [ "${1:-}" = --force ] && { force=1; shift; }
work=$(mktemp -d /tmp/a2-relock.XXXX)
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q -U pip
"$work/venv/bin/pip" install -q -r requirements.txt -c scripts/held.txt
{
  echo "# Exact versions of every package a2 installs, transitive ones included: what CI and the README install."
  echo "# Written by scripts/relock.sh from a fresh resolve of requirements.txt (the ranges a2 supports), holding"
  echo "# scripts/held.txt's versions, on"
  echo "# $(uname -sm), Python $("$work/venv/bin/python" -c 'import platform; print(platform.python_version())'), $(date -u +%F)."
  "$work/venv/bin/pip" freeze --all | grep -v '^pip=='
} > "$work/requirements.lock"

echo "== packages that moved (current lock -> new resolve)"
python3 - requirements.lock "$work/requirements.lock" <<'PY'
import re, sys
def pins(path):
    rows = (l.strip() for l in open(path) if l.strip() and not l.startswith("#"))
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (r.split("==") for r in rows)}
old, new = pins(sys.argv[1]), pins(sys.argv[2])
moved = [f"{n}: {old.get(n, '-')} -> {new.get(n, '-')}" for n in sorted(old.keys() | new.keys()) if old.get(n) != new.get(n)]
print("\n".join(moved) or "none")
PY

echo "== the suite under the new versions"
set +e
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$work/venv/bin/python" -m pytest -q -p no:cacheprovider -rf "$@" | tee "$work/suite.log"
rc=${PIPESTATUS[0]}
set -e
failed=$(grep -E '^FAILED ' "$work/suite.log" | sed -E 's/^FAILED ([^ ]+).*/\1/' | sort -u || true)
if [ -n "$failed" ]; then
  echo "== failures rerun under the current lock (.venv)"
  [ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -r requirements.lock; }
  for t in $failed; do
    if OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q -p no:cacheprovider "$t" >/dev/null 2>&1; then
      echo "changed by a new version: $t"
    else
      echo "fails under the current lock too: $t"
    fi
  done
fi
if [ "$rc" = 0 ] || [ "$force" = 1 ]; then
  cp "$work/requirements.lock" requirements.lock
  echo "== requirements.lock written (suite exit $rc)"
else
  echo "== requirements.lock kept; the new resolve is at $work/requirements.lock (suite exit $rc)"
fi
exit "$rc"
