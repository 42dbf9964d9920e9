#!/usr/bin/env bash
# Re-render docs/img/report.png: `pdsweep report` of the fixture run "mission"
# (tests/fixtures/make_runs.py), screenshot with headless Chromium (Debian: apt-get install
# chromium), downscaled to 880 px and 256 colours (~50 KB). Usage: scripts/report-screenshot.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" "$PY" tests/fixtures/make_runs.py "$tmp/runs" >/dev/null
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pdsweep report "$tmp/runs/mission" >/dev/null
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run \
  --user-data-dir="$tmp/profile" --hide-scrollbars --window-size=1100,1250 \
  --screenshot="$tmp/shot.png" "file://$tmp/runs/mission/report.html" >/dev/null 2>&1
mkdir -p docs/img
"$PY" - "$tmp/shot.png" docs/img/report.png <<'PYEOF'
import sys
from PIL import Image  # matplotlib's dependency (the report extra)
im = Image.open(sys.argv[1]).convert("RGB")
im = im.resize((880, im.height * 880 // im.width), Image.LANCZOS)
im.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(sys.argv[2], optimize=True)
PYEOF
echo "docs/img/report.png: $(stat -c %s docs/img/report.png) bytes"
