#!/usr/bin/env bash
# Screenshots of HTML quantization reports with headless Chromium: shows that the page renders
# in a real browser (no network, nothing but the file), and gives the PNGs of docs/.
#
#   scripts/report/screenshot.sh REPORT.html OUT.png [WIDTHxHEIGHT]
#
# Needs Chromium (Debian: `apt-get install chromium`; the script installs nothing) and, for
# the size check, nothing else. Default window 1280x3000: the run, the plan, the calibration
# and the first plots. The browser gets a fresh profile, no GPU, no network services; a page
# that needed the network would show it (the report needs none).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 REPORT.html OUT.png [WIDTHxHEIGHT]" >&2
    exit 2
fi
page=$1
out=$2
size=${3:-1280x3000}
browser=""
for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
done
if [ -z "$browser" ]; then
    echo "error: no Chromium found; on Debian: apt-get install chromium" >&2
    exit 1
fi
[ -f "$page" ] || { echo "error: $page: no such file" >&2; exit 1; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
abs_page=$(cd "$(dirname "$page")" && pwd)/$(basename "$page")
abs_out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
# --virtual-time-budget: wait until the page has laid out (it has no script, so this is short).
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --disable-extensions --hide-scrollbars --virtual-time-budget=2000 \
    --user-data-dir="$profile" --window-size="${size/x/,}" \
    --screenshot="$abs_out" "file://$abs_page" 2>"$profile/stderr.txt" || {
    cat "$profile/stderr.txt" >&2
    exit 1
}
[ -s "$abs_out" ] || { echo "error: no screenshot written" >&2; cat "$profile/stderr.txt" >&2; exit 1; }
echo "screenshot: $out ($(stat -c %s "$abs_out") bytes)"
