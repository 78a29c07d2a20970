#!/usr/bin/env bash
# The GPU check in one call (issues 33, 34): on the air-gapped GPU machine, from the repository
# root,
#
#     bash benchmarks/gpu_check.sh "$OUT"        # carry: .gpu-wheels (`make gpu-wheels` here)
#
# installs the wheelhouse into a folder of its own (pip --no-index --no-deps --target, then the
# trimmed Ray archive extracted into the same folder, then PYTHONPATH), runs the GPU tests, the
# Ray GPU test (a local cluster, actors on half the GPU each), then every part of
# benchmarks/gpu_bench.py, each under its own time budget (`timeout`): a part that runs out of
# time or memory is recorded as such and the next one runs. The budgets add up to at most 9 minutes; they are printed first. OUTDIR gets at
# most 6 files (exit status 1 if a step did not run to its end): gpu-check.md (summary table, then each part's markdown), gpu-check.log (this
# console), tests.log (the tests and the Ray test), bench.log (every part's output), install.log,
# env.txt.
#
# Environment: GPU_CHECK_PARTS (default: all, in the order below) picks steps, e.g.
# "install report-8b" for a rerun; GPU_CHECK_PYTHON (python3), GPU_CHECK_DEVICE (cuda),
# GPU_CHECK_WHEELS (.gpu-wheels), GPU_CHECK_SITE (/tmp/tl-gpu-site), GPU_CHECK_REPEATS (3),
# GPU_CHECK_BUDGET_SCALE (1; the dry run's slower CPU takes more), TL_DYNAMICS_GPU_SCALE=tiny
# (the shapes scaled down: `make gpu-dry-run`).
set -u
# (all of it is one function, parsed before it runs: editing this file mid-run changes nothing)
main() {
OUTDIR=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
REPO=$(pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${GPU_CHECK_PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-/tmp/tl-gpu-site}
REPEATS=${GPU_CHECK_REPEATS:-3}
SCALE=${GPU_CHECK_BUDGET_SCALE:-1}
WORK=$(mktemp -d /tmp/tl-gpu-check.XXXXXX)
ROOT=$WORK/models
ORDER=(install tests ray attach-gpt2 attach-1b attach-8b report-8b heads-1b stats-gpt2)
# (issue 34 took 60 s for ray and 10 more for install from the others: was 30/120/-/70/45/65/
# 110/40/60 s; none of them has been measured on the GPU yet)
declare -A BUDGET=(
  [install]=40 [tests]=100 [ray]=60 [attach-gpt2]=55 [attach-1b]=40 [attach-8b]=60
  [report-8b]=105 [heads-1b]=35 [stats-gpt2]=45
)
declare -A WHAT=(
  [install]="the wheelhouse and the trimmed Ray into $SITE, then import each package"
  [tests]="tests/test_device.py, tests/test_device_options.py, the torchrun-on-CUDA test, test_fused.py on CUDA"
  [ray]="tests/test_scale_ray.py -k gpu_share: a local Ray cluster, actors on half the GPU each"
  [attach-gpt2]="GPT-2-small fp32, each analysis attached <= 1.3x, all three <= 1.5x"
  [attach-1b]="Llama-3.2-1B shape bf16, all three attached <= 1.2x"
  [attach-8b]="Llama-3-8B shape bf16, 1 x 4,096, all three <= 1.3x within 80 GB"
  [report-8b]="report on the 8B shape at 2,048 tokens <= 120 s, page <= 30 MB"
  [heads-1b]="heads (atlas) on the 1B shape <= 3x"
  [stats-gpt2]="stats >= 70% of the forward's prompts per second"
)
PARTS=(${GPU_CHECK_PARTS:-${ORDER[@]}})
export PYTHONPATH="$SITE:$REPO" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PY SITE WHEELS
LOG=$OUTDIR/gpu-check.log
ROWS=$WORK/rows.txt
: >"$LOG" >"$ROWS" >"$OUTDIR/bench.log"
say() { echo "$*" | tee -a "$LOG"; }

TOTAL=0
for part in "${ORDER[@]}"; do TOTAL=$((TOTAL + BUDGET[$part])); done
say "GPU check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), device $DEVICE, python $PY," \
  "shapes ${TL_DYNAMICS_GPU_SCALE:-full}, budgets x$SCALE"
say "order and budgets (seconds; all steps add up to $TOTAL s = $((TOTAL / 60)) min $((TOTAL % 60)) s):"
for part in "${ORDER[@]}"; do
  mark=" "
  [[ " ${PARTS[*]} " == *" $part "* ]] || mark="-"
  say "  $mark $(printf '%-12s %4d s' "$part" "${BUDGET[$part]}")  ${WHAT[$part]}"
done
if [ "$TOTAL" -gt 540 ]; then
  say "the budgets add up to over 9 minutes: fix BUDGET in $0"
  exit 2
fi
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  say "no wheels in $WHEELS: run \`make gpu-wheels\` where PyPI is reachable and carry .gpu-wheels"
  exit 2
fi

budget() { awk -v b="${BUDGET[$1]}" -v s="$SCALE" 'BEGIN { printf "%d", b * s }'; }
status_of() { # exit code, log file -> what happened
  if [ "$1" -eq 0 ]; then echo "ok"
  elif [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "TIMEOUT after $2 s"
  elif grep -q -E "OutOfMemoryError|CUDA out of memory" "$3"; then echo "OUT OF MEMORY"
  else echo "FAILED (exit $1)"
  fi
}
declare -A STATUS
step() { # name, log file, command...: run under the step's budget, record how it ended
  local name=$1 log=$2 b start rc
  shift 2
  b=$(budget "$name")
  start=$(date +%s)
  say "==> $name (budget $b s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$b" "$@" >>"$log" 2>&1
  rc=$?
  STATUS[$name]="$(status_of "$rc" "$b" "$log"), $(($(date +%s) - start)) s"
  say "    $name: ${STATUS[$name]}"
  return "$rc"
}

{
  echo "date: $(date -u)"
  echo "repo: $(git -C "$REPO" log -1 --format='%h %s' 2>/dev/null || echo '(no git)')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|numpy|pandas|tokenizers|safetensors|huggingface|jaxtyping|einops|pytest) "
  ls -l "$WHEELS"
} >"$OUTDIR/env.txt" 2>&1

for part in "${PARTS[@]}"; do
  case $part in
  install)
    install() {
      rm -rf "$SITE" &&
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" "$WHEELS"/*.whl &&
        "$PY" benchmarks/gpu/wheels.py unpack "$WHEELS" "$SITE" &&
        "$PY" benchmarks/gpu/wheels.py imports
    }
    step install "$OUTDIR/install.log" bash -c "$(declare -f install); install" ||
      say "    the install failed: the steps after it will fail to import (see install.log)"
    ;;
  tests)
    tests=(tests/test_device.py tests/test_device_options.py
      "tests/test_scale.py::test_torchrun_on_cuda_byte_identical_to_one_process")
    # the CUDA tests of the fused statistics (their CPU compile test runs in the normal suite)
    tests+=(tests/test_fused.py::test_attached_forward_adds_no_host_sync_on_cuda
      tests/test_fused.py::test_compiled_collector_equals_eager_on_cuda)
    # the statistics eager here (no compile per test shape); test_fused.py compiles its own
    step tests "$OUTDIR/tests.log" env TL_DYNAMICS_COMPILE=never \
      "$PY" -m pytest "${tests[@]}" -q -p no:cacheprovider -rs
    say "    $(grep -E '(passed|failed|error|skipped)' "$OUTDIR/tests.log" | tail -1)"
    ;;
  ray)
    # Ray must import (else the test file would skip itself); its usage report stays off (no
    # network there); the statistics eager as in the tests step. The cluster's processes share
    # the driver's fate, so a time-out leaves none behind for the parts after it.
    ray_test() {
      "$PY" -c "import ray, ray.data; print('ray', ray.__version__, ray.__file__)" &&
        "$PY" -m pytest tests/test_scale_ray.py -k gpu_share -q -p no:cacheprovider -rs
    }
    step ray "$WORK/ray.log" env TL_DYNAMICS_COMPILE=never RAY_USAGE_STATS_ENABLED=0 \
      bash -c "$(declare -f ray_test); ray_test"
    { echo "===== ray ====="; cat "$WORK/ray.log"; echo "===== ray end ====="; } >>"$OUTDIR/tests.log"
    say "    $(grep -E '(passed|failed|error|skipped)' "$WORK/ray.log" | tail -1)"
    ;;
  attach-* | report-* | heads-* | stats-*)
    echo "===== $part =====" >>"$OUTDIR/bench.log"
    b=$(budget "$part")
    # statistics compiled from a shape's second pass (TL_DYNAMICS_COMPILE=auto), except for the
    # corpus of many lengths (GPU_CHECK_STATS_COMPILE, default never: a compile per recurring
    # length could take its whole budget; auto measures the compiled statistics there)
    compile=${TL_DYNAMICS_COMPILE:-auto}
    [ "$part" = stats-gpt2 ] && compile=${GPU_CHECK_STATS_COMPILE:-never}
    step "$part" "$OUTDIR/bench.log" env TL_DYNAMICS_COMPILE="$compile" \
      "$PY" benchmarks/gpu_bench.py --only "$part" \
      --device "$DEVICE" --repeats "$REPEATS" --threads 4 --timeout "$((b - 5))" --root "$ROOT" \
      --rows "$ROWS" --out "$WORK/$part.md"
    if ! grep -q "^ROW | $part |" "$ROWS"; then
      echo "ROW | $part | no figure | ${WHAT[$part]} | ${STATUS[$part]} |" >>"$ROWS"
    fi
    ;;
  *) say "unknown step $part (valid: ${ORDER[*]})" ;;
  esac
done

{
  echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), device $DEVICE, shapes ${TL_DYNAMICS_GPU_SCALE:-full})"
  echo
  grep -E "^(name|NVIDIA|python|torch) " "$OUTDIR/env.txt" | sed 's/^/    /'
  echo
  echo "| step | how it ended |"
  echo "|---|---|"
  for part in "${PARTS[@]}"; do echo "| $part | ${STATUS[$part]:-not run} |"; done
  echo
  echo "| part | measured | target | verdict |"
  echo "|---|---|---|---|"
  sed 's/^ROW //' "$ROWS"
  echo
  echo "Tests: $(sed '/^===== ray =====$/,/^===== ray end =====$/d' "$OUTDIR/tests.log" 2>/dev/null |
    grep -E '(passed|failed|error|skipped)' | tail -1)"
  echo "Ray test: $(grep -E '(passed|failed|error|skipped)' "$WORK/ray.log" 2>/dev/null | tail -1)"
  for part in "${PARTS[@]}"; do
    [ -f "$WORK/$part.md" ] && sed '1,/^$/d' "$WORK/$part.md" | sed '/^## Summary$/,$d'
  done
} >"$OUTDIR/gpu-check.md"
say ""
say "$(sed -n '/^| step/,/^Ray test:/p' "$OUTDIR/gpu-check.md")"
say "files in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
rm -rf "$WORK"
# exit status: 0 when every step ran to its end (a part's MISSES verdict is a figure, not a
# failure), 1 when one failed or ran out of time or memory
for part in "${PARTS[@]}"; do
  [[ ${STATUS[$part]:-} == ok* ]] || return 1
done
return 0
}
main "$@"
