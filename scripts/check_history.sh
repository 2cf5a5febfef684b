#!/usr/bin/env bash
# Fails when the tracked tree describes the history of the work instead of
# its present state: labels of work sessions, issue numbers, dates of runs
# in source files and scripts. Who changed what and when is git's record;
# benchmark pages date their measurements in prose, which is allowed there.
#
#   scripts/check_history.sh     (from anywhere in the checkout; .ci/run runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
# Checked once rewritten to describe the present state.
SKIP=(':!docs/ARCHITECTURE.md' ':!docs/BENCHMARKS.md')
ordinals='first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth'
labels="\\b($ordinals)[ -]session\\b|\\bsession [0-9]+\\b|\\bissues? #?[0-9]+\\b|\\(#[0-9]+\\)|\\bthe lead\\b"
dates='\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b'
code=('*.rs' '*.cu' '*.cpp' '*.h' '*.py' '*.sh' '*.toml' '*.js' '*.html' '*.css' '.ci/run')
fail=0
if git grep -nIiE "$labels" -- . "${SKIP[@]}" ':!scripts/check_history.sh'; then
    echo "history labels above (work sessions, issue numbers): describe the present state instead" >&2
    fail=1
fi
if git grep -nIE "$dates" -- "${code[@]}" ':!scripts/check_history.sh'; then
    echo "dates above in source files or scripts: a run's date belongs in its benchmark page or in git" >&2
    fail=1
fi
[ "$fail" = 0 ] && echo "no history labels or run dates in the tracked tree"
exit "$fail"
