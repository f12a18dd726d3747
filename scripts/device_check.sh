#!/usr/bin/env bash
# The GPU checks in one run on one GPU, in under 10 minutes, installing nothing:
# (on one H100: about 36 + 43 + 55 + 158 s; each step's limit leaves room for a slower card)
#   1. the `gpu`-marked tests (tests/test_gpu.py and any other test marked gpu);
#   2. benchmarks/gpu.py (saving and restoring a GPU-resident state against DCP);
#   3. benchmarks/restore.py --device cuda (restore into device tensors, 3 GiB, beside
#      dcp.load, torch.load and safetensors);
#   4. benchmarks/trainer_overhead.py --device cuda, where that file exists;
# then one table of what passed and the numbers. Python: $PY, else the repository's .venv
# if there is one, else the system python3, which must already have torch with CUDA. Where
# that python cannot import tiercheck, the wheels in $WHEELS (default ./.whl, made here by
# scripts/device_wheels.sh and carried to the GPU machine) are installed into the run's
# folder, without the network.
#
#   bash scripts/device_check.sh            # results under ./device-check-<time>/
#   OUT=/some/dir bash scripts/device_check.sh
#   CUDA_VISIBLE_DEVICES=1 bash scripts/device_check.sh   # another GPU
#   DEVICE=cpu QUICK=1 bash scripts/device_check.sh        # a dry run of the script, no GPU
#   SKIP="gpu_bench trainer_overhead" bash scripts/device_check.sh  # leave those steps out
#   STEPS="trainer_overhead restore_bench" bash scripts/device_check.sh  # these, in this order
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py="${PY:-$here/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
out="${OUT:-$here/device-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
export TIERCHECK_BENCH_DISK="$out/disk"
export PIP_NO_INDEX=1  # nothing from the network, even by accident
if ! "$py" -c "import tiercheck.backends" 2>/dev/null; then
    wheels="${WHEELS:-$here/.whl}"
    if ! ls "$wheels"/tiercheck-*.whl >/dev/null 2>&1; then
        echo "device_check: $py cannot import tiercheck and $wheels holds no wheels" \
            "(make them with scripts/device_wheels.sh)" >&2
        exit 2
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$out/site" \
        "$wheels"/*.whl || exit 2
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "import tiercheck.backends" || exit 2
fi

device="${DEVICE:-cuda}"
if [ "$device" != cpu ]; then
    if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "device_check: $py has no torch with CUDA, or there is no GPU here" >&2
        exit 2
    fi
    "$py" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
fi
if [ -n "${QUICK:-}" ]; then
    gpu_size=(--state-mib 4 --repeats 1)
    restore_size=(--quick)
else
    gpu_size=(--repeats 3)
    restore_size=(--tensors 192 --tensor-mib 16 --repeats 3)  # 3 GiB
fi

status=0
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, record rc and seconds
    local name="$1" limit="$2"
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "$name skip -" >>"$out/steps.txt"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$out/steps.txt"
    tail -n 15 "$out/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

: >"$out/steps.txt"
# the test files with gpu-marked tests (collecting only those is faster than the whole tree)
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
xdist=()
"$py" -c "import xdist" 2>/dev/null && xdist=(-n 0)
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
run_gpu_tests() {
    step gpu_tests 120 "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" -m gpu \
        --junitxml="$out/gpu_tests.xml" "${gpu_files[@]}"
}
run_gpu_bench() {
    step gpu_bench 100 "$py" benchmarks/gpu.py --device "$device" "${gpu_size[@]}" \
        --out "$out/gpu.json"
}
run_restore_bench() {
    step restore_bench 120 "$py" benchmarks/restore.py --device "$device" "${restore_size[@]}" \
        --no-default-store --out "$out/restore.json"
}
run_trainer_overhead() {
    step trainer_overhead 240 "$py" benchmarks/trainer_overhead.py --device "$device" \
        "${quick[@]}" --out "$out/trainer_overhead.json" --plot "$out/trainer_overhead.png"
}
# STEPS: the order (the first ones first where the whole run has a deadline of its own)
for name in ${STEPS:-gpu_tests gpu_bench restore_bench trainer_overhead}; do
    "run_$name"
done

"$py" - "$out" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for line in (out / "steps.txt").read_text().split("\n"):
    if not line.strip():
        continue
    name, rc, secs = line.split()
    what = "not here" if rc == "-" else ("ok" if rc == "0" else f"FAILED (rc {rc})")
    if rc == "skip":
        what = "skipped"
    if rc == "124" or rc == "137":
        what = "TIMED OUT"
    rows.append((name, what, "-" if secs == "-" else f"{secs} s", ""))


def numbers(path: Path, keys: list[str]) -> str:
    if not path.exists():
        return "no results"
    data = json.loads(path.read_text())
    parts = []
    metrics = data.get("metrics", {})
    for k in keys:
        if k in metrics:
            parts.append(f"{k} {metrics[k]['median'] * 1e3:.0f} ms")
    for label, r in data.get("ratios", {}).items():
        parts.append(f"{label}: {r:.2f}x")
    if "restore_shm_gb_per_s" in data:
        parts.append(f"restore {data['restore_shm_gb_per_s']:.1f} GB/s")
    if "tc_shm_s" in metrics and "state_bytes" in data:
        rate = data["state_bytes"] / metrics["tc_shm_s"]["median"] / 1e9
        parts.append(f"{data['state_bytes'] / 2**30:.2f} GiB from shm at {rate:.1f} GB/s")
    for mode, r in data.get("modes", {}).items():  # trainer_overhead.json
        if mode != "none":
            parts.append(
                f"{mode} mean {r['mean_x']:.3f}x max {r['max_x']:.2f}x failed {r['failed']}"
            )
    if "base_commit" in data:
        parts.append(f"base shm+LMDB / torch.save+fsync {data['base_commit']['ratio']:.2f}x")
    return "; ".join(parts) if parts else json.dumps(data)[:300]


detail = {}
xml = out / "gpu_tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    t, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    detail["gpu_tests"] = f"{t - f - e - s} passed, {f + e} failed, {s} skipped"
detail["gpu_bench"] = numbers(out / "gpu.json", ["tc_staged_s", "tc_restore_shm_s"])
detail["restore_bench"] = numbers(out / "restore.json", ["tc_shm_s", "dcp_load_s", "memcpy_s"])
detail["trainer_overhead"] = numbers(out / "trainer_overhead.json", [])
width = max(len(r[0]) for r in rows)
print()
print(f"{'check':{width}}  {'result':10}  {'time':>6}  numbers")
for name, what, secs, _ in rows:
    print(f"{name:{width}}  {what:10}  {secs:>6}  {detail.get(name, '')}")
print(f"(logs and JSON in {out})")
EOF
exit "$status"
