#!/usr/bin/env bash
# The GPU benchmarks in one command, for a lent GPU machine with no network (docs/benchmarks.md,
# "On a GPU"):
#   0. one 200 MB slot fill: one device copy out of the warm tier's mapping registered with
#      CUDA against the pinned staging buffer (bench.slot_fill), and that path's GPU test;
#   1. the seed scenario as one model family: 50 customers of 850 MB, the top 12 pinned, 15
#      slots in device memory, open-loop traffic (the top 12 send 80%), the warm tier in
#      /dev/shm;
#   2. a family miss of one 850 MB variant against a pinned host-to-device copy of the same
#      bytes (bench.family_swap, the family layout only), GPU memory before and after swaps.
# Results and logs go to $OUT (JSON, the control plane's log with Triton's, this script's log).
#
#   bash bench/device_run.sh prepare     # here, once: the packages the GPU machine lacks -> .whl/
#   bash bench/device_run.sh             # there: OUT set, .whl/ carried
#   SMALL=1 WHEELS=0 PYTHON=.venv/bin/python OUT=/tmp/devout bash bench/device_run.sh   # a CPU rehearsal
#
# The GPU machine has torch, numpy 2, grpcio, requests, prometheus-client, safetensors, click
# and pytest; .whl/ brings tritonclient (with python-rapidjson, and grpcio/protobuf at least
# the versions its generated code checks), psycopg, and the tritonserver tree of the
# nvidia-pytriton wheel (the binary, the python backend, the 3.12 stub and their libraries:
# 25 MB as tar.xz against the 55 MB wheel).  They go to /tmp/site on PYTHONPATH, after the
# device's own numpy and torch are found (nothing carried replaces them).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS_DIR=.whl
TREE=$WHEELS_DIR/pytriton-0.7.0-tree.tar.xz
PIP_312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
         --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
         --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
         --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

prepare() {
    local tmp
    tmp=$(mktemp -d)
    mkdir -p "$WHEELS_DIR"
    rm -f "$WHEELS_DIR"/*.whl "$TREE"
    python3 -m pip download -q "${PIP_312[@]}" -d "$WHEELS_DIR" tritonclient==2.73.0 \
        python-rapidjson==1.25 grpcio==1.85.3 protobuf==6.33.6 psycopg==3.3.9 psycopg-binary==3.3.9 \
        numpy==1.26.4
    python3 -m pip download -q "${PIP_312[@]}" -d "$tmp" nvidia-pytriton==0.7.0
    mkdir -p "$tmp/x" "$tmp/tree/pytriton/tritonserver/python_backend_stubs"
    (cd "$tmp/x" && unzip -q ../nvidia_pytriton-0.7.0-*.whl)
    # Only what the launcher finds (pytriton_root) and what the binaries link against.
    cp "$tmp/x/pytriton/__init__.py" "$tmp/tree/pytriton/"
    cp -a "$tmp/x/pytriton/tritonserver/"{bin,backends,caches} "$tmp/tree/pytriton/tritonserver/"
    cp -a "$tmp/x/pytriton/tritonserver/python_backend_stubs/3.12" "$tmp/tree/pytriton/tritonserver/python_backend_stubs/"
    cp -a "$tmp/x/nvidia_pytriton.libs" "$tmp/tree/"
    rm -f "$tmp"/tree/nvidia_pytriton.libs/libpython3-*  # the 3.13 stub's
    find "$tmp/tree" -name __pycache__ -prune -exec rm -rf {} +
    tar -C "$tmp/tree" -cf - . | xz -9 -T0 >"$TREE"
    rm -rf "$tmp"
    du -ch "$WHEELS_DIR"/* | tail -1
    echo "tracked files: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (64 MiB travel in all)"
}

if [ "${1:-}" = prepare ]; then
    prepare
    exit 0
fi

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench/results/device}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_run.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
T0=$(date +%s)
phase() { echo; echo "=== [$(($(date +%s) - T0))s] $*"; }

if [ "${SMALL:-0}" = 1 ]; then  # a rehearsal on a CPU machine: same steps, small sizes
    CUSTOMERS=16 VARIANT_MB=8 SLOTS=14 RATE=4 MIXED_S=20 HOT_S=5 BARE=2
    FS_VARIANTS=6 FS_ROUNDS=2 FS_HITS=50 FS_CYCLES=30
else
    CUSTOMERS=${CUSTOMERS:-50} VARIANT_MB=${VARIANT_MB:-850} SLOTS=${SLOTS:-15}
    RATE=${RATE:-20} MIXED_S=${MIXED_S:-90} HOT_S=${HOT_S:-15} BARE=${BARE:-3}
    FS_VARIANTS=${FS_VARIANTS:-6} FS_ROUNDS=${FS_ROUNDS:-3} FS_HITS=${FS_HITS:-100} FS_CYCLES=${FS_CYCLES:-60}
fi
SEED_TIMEOUT_S=${SEED_TIMEOUT_S:-270} FS_TIMEOUT_S=${FS_TIMEOUT_S:-100}

if [ "${WHEELS:-1}" = 1 ]; then
    phase "carried packages into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS_DIR"/*.whl
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site', filter='tar')" "$TREE"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # Triton 2.51's python-backend stub answers BYTES tensors (a family's status) empty under
    # numpy 2, which the GPU machine has; the production image pins numpy<2 too. So the
    # product runs from a venv whose packages are /tmp/site (numpy 1.26 first), then the
    # machine's own: the stubs take theirs from the first python3 on PATH (stub_environment),
    # and they ignore PYTHONPATH but read .pth files.
    "$PY" -m venv --without-pip /tmp/venv
    VENV_SITE=$(/tmp/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    { echo /tmp/site; "$PY" -c "import site; print(chr(10).join(site.getsitepackages()))"; } \
        >"$VENV_SITE/device-packages.pth"
    PY=/tmp/venv/bin/python
fi

phase "preflight"
uname -a
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
df -h /dev/shm /tmp . | sed 's/^/  /'
free -g | sed 's/^/  /'
"$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "torch", "grpc", "google.protobuf", "tritonclient", "rapidjson", "psycopg",
             "safetensors", "aiohttp", "prometheus_client", "click", "requests", "pynvml", "ml_dtypes"):
    mod = importlib.import_module(name)
    version = getattr(mod, "__version__", None) or getattr(mod, "VERSION", "")
    print(f"  {name:<18} {version!s:<14} {mod.__file__}")
import torch
print("  cuda:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
import tritonclient.grpc  # noqa: F401  (its generated code checks grpcio's and protobuf's versions)
import mmctl.main  # noqa: F401
import tests.product  # noqa: F401
EOF
# The python backend's stub for this interpreter, as `mmctl up` will pick it (launch.py).
STUB=$("$PY" -c "
import sys
from control_plane.triton.launch import pytriton_root
print(pytriton_root() / 'python_backend_stubs' / f'{sys.version_info.major}.{sys.version_info.minor}' / 'triton_python_backend_stub')")
BIN=$("$PY" -c "from control_plane.triton.launch import which_tritonserver; print(which_tritonserver())")
echo "tritonserver: $BIN"
echo "stub: $STUB"
for f in "$BIN" "$STUB"; do
    if [ ! -e "$f" ]; then echo "MISSING: $f"; exit 1; fi
    ldd "$f" | grep "not found" | sed "s|^|  $(basename "$f") lacks |" || true
done
if ldd "$STUB" | grep -q "libpython.*not found"; then
    # The stub embeds libpython: take the interpreter's own.
    LIBDIR=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
    echo "libpython not on the loader's path: LD_LIBRARY_PATH=$LIBDIR"
    export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    if ldd "$STUB" | grep "not found"; then exit 1; fi
fi
# The stub runs isolated (PYTHONPATH ignored) and takes its packages from the first python3
# on PATH, which mmctl up puts first (stub_environment): that one must import numpy and torch.
PYBIN=$("$PY" -c "import os, sys; print(os.path.dirname(sys.executable))")
env -i PATH="$PYBIN:/usr/bin:/bin" python3 -I -c \
    "import numpy, torch; print('stub python:', numpy.__version__, torch.__version__, torch.__file__)"

# The warm tier (the repository Triton serves from) in host DRAM: /dev/shm when it has room
# for every customer's weights, else fewer customers, said here and in the JSON.
WORK=${WORK:-/dev/shm/mms-bench}
NEED_MB=$(( (CUSTOMERS + 1) * ${VARIANT_MB%.*} + 4096 ))
AVAIL_MB=$(df -Pm "$(dirname "$WORK")" | awk 'NR == 2 {print $4}')
echo "warm tier: $CUSTOMERS x $VARIANT_MB MB needs ~$NEED_MB MB in $(dirname "$WORK"), $AVAIL_MB MB free"
if [ "$AVAIL_MB" -lt "$NEED_MB" ] && [ "$(id -u)" = 0 ] && [ "$(dirname "$WORK")" = /dev/shm ]; then
    mount -o remount,size=$((NEED_MB + 8192))M /dev/shm && echo "remounted /dev/shm with $((NEED_MB + 8192)) MB" || true
    AVAIL_MB=$(df -Pm /dev/shm | awk 'NR == 2 {print $4}')
fi
if [ "$AVAIL_MB" -lt "$NEED_MB" ]; then
    FIT=$(( (AVAIL_MB - 4096) / ${VARIANT_MB%.*} - 1 ))
    echo "NOTE: only $AVAIL_MB MB free for the warm tier: $FIT customers instead of $CUSTOMERS"
    CUSTOMERS=$FIT
    if [ "$CUSTOMERS" -lt $((SLOTS + 5)) ]; then echo "too few customers fit ($CUSTOMERS)"; exit 1; fi
fi

RC_FILL=0 RC_SEED=0 RC_FS=0
phase "0. one slot's fill: one device copy out of the registered mapping against the staging buffer (200 MB)"
timeout -s INT -k 15 300 "$PY" -m pytest -q -p no:cacheprovider --noconftest \
    tests/unit/test_pinned_mappings.py || RC_FILL=$?
timeout -s INT -k 15 300 "$PY" -m bench.slot_fill --size-mb 200 --repeats 10 --threads 1,4,16 \
    --out "$OUT/slot_fill.json" || RC_FILL=$?

phase "1. seed scenario: $CUSTOMERS customers x $VARIANT_MB MB as one family, top 12 pinned, $SLOTS slots, $RATE req/s for ${MIXED_S}s"
timeout -s INT -k 15 "$SEED_TIMEOUT_S" "$PY" -m bench.seed_scenario --layout family \
    --customers "$CUSTOMERS" --variant-mb "$VARIANT_MB" --slots "$SLOTS" --rate "$RATE" \
    --seconds "$MIXED_S" --hot-seconds "$HOT_S" --bare-loads "$BARE" --work-dir "$WORK" \
    --out "$OUT/seed_scenario.json" --log-out "$OUT/seed_control_plane.log" || RC_SEED=$?
rm -rf "$WORK"  # 42.5 GB of host DRAM, also after a failure

phase "2. family miss: $FS_VARIANTS variants x $VARIANT_MB MB, 4 slots, against a pinned host-to-device copy"
timeout -s INT -k 15 "$FS_TIMEOUT_S" "$PY" -m bench.family_swap --layouts family --light-fleet \
    --variants "$FS_VARIANTS" --size-mb "$VARIANT_MB" --slots 4 --rounds "$FS_ROUNDS" \
    --hits "$FS_HITS" --cycles "$FS_CYCLES" --work-dir "$WORK" --out "$OUT/family_swap.json" || RC_FS=$?
rm -rf "$WORK"

phase "summary (slot fill rc $RC_FILL, seed scenario rc $RC_SEED, family swap rc $RC_FS)"
"$PY" - "$OUT" <<'EOF' || true
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
seed = out / "seed_scenario_family.json"
if seed.exists():
    r = json.loads(seed.read_text())
    c = r["conditions"]
    print(f"seed scenario: {c['customers']} customers x {c['weight_bytes_per_customer'] / 1e6:.0f} MB, "
          f"{c['slots']} slots, {c['model']}, gpu {c['gpu']}; generate {c['generate_s']}s, up {c['up_s']}s, "
          f"pins {c['pin_all_12_s']}s")
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    for label, g in (("hot path", r["hot_path_frequent_only"]), ("frequent", r["mixed"]["frequent"]),
                     ("occasional", r["mixed"]["occasional"])):
        print(f"  {label:<11} n={g['requests']:<5} errors={g['errors']:<3} p50 {ms(g['p50_ms'])}, p99 {ms(g['p99_ms'])}")
    bare = r["load_only_p50_s"]
    print(f"  hit ratio {r['hit_ratio']:.3f}, loads/min {r['loads_per_minute']:.1f}, errors {r['errors']} "
          f"{r['error_messages'][:2]}, bare miss p50 {ms(bare * 1000 if bare else None)}, "
          f"answers ok {r['answers_ok']}, GPU MiB {r['gpu_used_mib']}")
fill = out / "slot_fill.json"
if fill.exists():
    r = json.loads(fill.read_text())
    print(f"slot fill of {r['conditions']['bytes'] / 1e6:.0f} MB on {r['conditions']['device']}:")
    for row in r["rows"]:
        print(f"  {row['what']:<66} {row['p50_ms']:>8.2f} ms")
fs = out / "family_swap.json"
if fs.exists():
    r = json.loads(fs.read_text())
    f, m = r["family"], r["memcpy"]
    print(f"family swap: miss p50/p99 {f['miss']['p50_ms']}/{f['miss']['p99_ms']} ms, hit p50 {f['hit']['p50_ms']} ms, "
          f"pinned h2d p50 {m.get('torch_pinned_h2d', {}).get('p50_ms')} ms, numpy memcpy p50 "
          f"{m['numpy_copyto']['p50_ms']} ms, slot {f['slot_bytes'] / 1e6:.0f} MB; cycles {f['cycles']['latency']['p50_ms']} ms p50, "
          f"GPU MiB {f['cycles']['gpu_used_before_mib']} -> {f['cycles']['gpu_used_after_mib']}")
EOF
# What comes back is capped at 16 MiB a file.
for f in "$OUT"/*; do
    if [ "$f" != "$OUT/device_run.log" ] && [ "$(stat -c %s "$f")" -gt $((15 << 20)) ]; then
        tail -c $((15 << 20)) "$f" >"$f.tail" && mv "$f.tail" "$f"
    fi
done
ls -la "$OUT"
phase "done"
STATUS=0
[ "$RC_FILL" = 0 ] && [ "$RC_SEED" = 0 ] && [ "$RC_FS" = 0 ] || STATUS=1
exec >&- 2>&-  # the log is whole once tee has read to the end
wait "$TEE_PID" || true
exit "$STATUS"
