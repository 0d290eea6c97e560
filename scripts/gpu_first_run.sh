#!/usr/bin/env bash
# The first GPU run, prepared (issue 36): every phase of `python -m interlace.bench.gpu_validate`
# in its own process under its own timeout, each writing $OUT/<phase>.json at once; a failed or
# timed-out phase does not stop the next; the summary table (PASS / FAIL per target) prints last.
#
#   GPU:      OUT=<dir> bash scripts/gpu_first_run.sh        (at most 9 minutes; needs .whl/interlace-*.whl)
#   CPU:      DRY_RUN=1 OUT=<dir> bash scripts/gpu_first_run.sh   (tiny shapes, the interpreter; the tests run it)
#   a rerun:  PHASES="correctness bench8b" OUT=<dir> bash scripts/gpu_first_run.sh
#
# The project is installed from a wheel (the GPU machine has no registry and its python3 holds torch,
# triton and transformers): `python3 -m pip wheel --no-deps -w .whl .` here, `.whl` carried there.
# With DRY_RUN and no wheel in .whl/, one is built into a temporary folder.  PYTHONSAFEPATH=1: the
# repo root's ./interlace/ must not shadow the installed package (commands run in the repo root).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
DRY="${DRY_RUN:-}"
PHASES="${PHASES:-preflight ceilings kernel_tests correctness bench8b anatomy profile}"
exec > >(tee -a "$OUT/run.log") 2>&1

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/interlace-gpu-run.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
wheel=$(ls -t .whl/interlace-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  if [ -z "$DRY" ]; then echo "no .whl/interlace-*.whl: build it first (python3 -m pip wheel --no-deps -w .whl .)"; exit 2; fi
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$SCRATCH/whl" . || exit 2
  wheel=$(ls "$SCRATCH"/whl/interlace-*.whl)
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site" "$wheel" || exit 2
export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export INTERLACE_COMMIT="${INTERLACE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# the Triton and inductor caches of this run only
export TRITON_CACHE_DIR="$SCRATCH/triton" TORCHINDUCTOR_CACHE_DIR="$SCRATCH/inductor"

# seconds per phase, from the first GPU run (preflight 11 s, kernel tests 107 s, correctness 36 s,
# the 8B bench 40 s, anatomy 18 s, ceilings 5 s; the 8B profile 18-28 s) with room; the kernel tests took 141 s
# on the fourth run's machine and were cut at 140 (167 passed, none failed): 180 now. 555 in all (+ install),
# under the device's 10 minutes a command
declare -A LIMIT=([preflight]=30 [ceilings]=20 [kernel_tests]=180 [correctness]=70 [bench8b]=120 [anatomy]=45 [profile]=90)
flag=""
if [ -n "$DRY" ]; then
  flag="--dry-run"
  LIMIT=([preflight]=60 [ceilings]=60 [kernel_tests]=240 [correctness]=240 [bench8b]=240 [anatomy]=240 [profile]=240)
fi
echo "interlace GPU run: $(date -u +%FT%TZ) commit $INTERLACE_COMMIT wheel $(basename "$wheel") ${DRY:+(dry run)}"
for phase in $PHASES; do
  t=${LIMIT[$phase]:?unknown phase $phase}
  echo "=== $phase (limit ${t}s) $(date -u +%T)"
  start=$SECONDS
  timeout -k 10 "$t" "$PY" -m interlace.bench.gpu_validate --phase "$phase" --out "$OUT" $flag --timeout $((t - 10))
  rc=$?
  echo "=== $phase: exit $rc after $((SECONDS - start))s$([ $rc -eq 124 ] && echo ' (timed out)')"
done
"$PY" -m interlace.bench.gpu_validate --phase summary --out "$OUT" --phases $PHASES
