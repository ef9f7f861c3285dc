#!/usr/bin/env bash
# Run the coverage-guided fuzz harnesses (tests/fuzz/) for as long as asked.
#
#   scripts/fuzz.sh [SECONDS_PER_HARNESS] [HARNESS...]     (default: 60 s each, every harness)
#
# Corpora grow in $FUZZ_WORK/<harness>/corpus (default /tmp/shardckpt-fuzz), seeded from
# tests/fuzz/corpus/<harness>; findings land in $FUZZ_WORK/<harness>/ as crash-*/timeout-*/oom-*.
# Every input must read or raise from shardckpt.errors; memory is capped with -rss_limit_mb
# (FUZZ_RSS_MB, default 512) and each input with -timeout (FUZZ_TIMEOUT, default 10 s).
# Exit status: 0 when no harness found anything.
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
seconds="${1:-60}"
shift || true
work="${FUZZ_WORK:-/tmp/shardckpt-fuzz}"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(cd "$here/tests/fuzz" && "$python" -c 'from harnesses import HARNESSES; print("\n".join(HARNESSES))')
fi
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
for name in "${names[@]}"; do
  script="$(cd "$here/tests/fuzz" && "$python" -c "from harnesses import HARNESSES; print(HARNESSES['$name'])")" || exit 2
  mkdir -p "$work/$name/corpus"
  echo "== $name: ${seconds}s (corpus $work/$name/corpus)"
  "$python" "$here/tests/fuzz/$script" -max_total_time="$seconds" -timeout="${FUZZ_TIMEOUT:-10}" \
    -rss_limit_mb="${FUZZ_RSS_MB:-512}" -print_final_stats=1 -artifact_prefix="$work/$name/" \
    "$work/$name/corpus" "$here/tests/fuzz/corpus/$name" 2>&1 | grep -a -E "^(Done|stat::|==|ERROR|SUMMARY)|Uncaught|Error"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "!! $name: finding (rc $rc), see $work/$name/"; status=1; fi
done
exit $status
