#!/bin/bash
# The offline wheelhouse the GPU check installs from, made here (where the package registry is
# reachable), for a GPU machine that reaches nothing:
#   bash benchmarks/gpu_wheels.sh            (writes .whl/, ignored by git)
# The GPU image (CPython 3.12 and the packages of benchmarks/gpu_image.txt) lacks DeepSpeed and DeepSpeed's hjson and pydantic (with
# pydantic-core, annotated-types, typing-inspection). DeepSpeed ships no wheel: it is built here
# as a pure one (its ops build at first use). The versions are this environment's, the ones the
# CPU suite ran. Checked before it says done: every wheel installs for the target (pip's dry run
# with --no-index and the target's platform tags), every requirement of ours and DeepSpeed's is
# met by the image or the wheelhouse, and the pure wheels install and import here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WHL=.whl
TARGET=(--python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --only-binary=:all:)

version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$WHL" && mkdir -p "$WHL"
echo "gpu_wheels: DeepSpeed $(version deepspeed), built as a pure wheel"
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-binary deepspeed -w "$WHL" \
    "deepspeed==$(version deepspeed)"
echo "gpu_wheels: DeepSpeed's dependencies the image lacks, for CPython 3.12 manylinux"
deps=()
for name in hjson pydantic pydantic-core annotated-types typing-inspection; do
    deps+=("$name==$(version $name)")
done
$PY -m pip download -q --no-deps "${TARGET[@]}" -d "$WHL" "${deps[@]}"
echo "gpu_wheels: dr_scale"
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$WHL" .

echo "gpu_wheels: checking the wheelhouse against the target"
$PY -m pip install -q --dry-run --ignore-installed --no-index --no-deps --find-links "$WHL" \
    "${TARGET[@]}" --target /tmp/gpu_wheels_dry_run "$WHL"/*.whl
$PY - "$WHL" benchmarks/gpu_image.txt <<'EOF'
"""Every requirement of the wheels (extras aside) is met by the image or the wheelhouse."""
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The GPU image's packages (benchmarks/gpu_image.txt: one place for them)
IMAGE = {canonicalize_name(Requirement(line).name)
         for line in Path(sys.argv[2]).read_text().splitlines()
         if line.strip() and not line.startswith("#")}
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
           implementation_name="cpython", extra="")
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {canonicalize_name(w.name.split("-")[0]) for w in wheels} | IMAGE
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if (req.marker is None or req.marker.evaluate(env)) and \
                        canonicalize_name(req.name) not in have:
                    missing.append(f"{wheel.name} needs {req}")
if missing:
    sys.exit("gpu_wheels: neither the GPU image nor .whl/ has: " + "; ".join(missing))
print(f"gpu_wheels: {len(wheels)} wheels, every requirement met by the image or the wheelhouse")
EOF
# The pure wheels install and import here (pydantic-core is CPython 3.12's: this Python's own
# of the same version stands in for it).
rm -rf /tmp/gpu_wheels_pure
$PY -m pip install -q --no-index --no-deps --target /tmp/gpu_wheels_pure \
    $(ls "$WHL"/*.whl | grep -v pydantic_core)
(cd /tmp && PYTHONPATH=/tmp/gpu_wheels_pure $PY -c "
import deepspeed, dr_scale, pydantic, hjson
assert deepspeed.__file__.startswith('/tmp/gpu_wheels_pure'), deepspeed.__file__
assert dr_scale.__file__.startswith('/tmp/gpu_wheels_pure'), dr_scale.__file__
print('gpu_wheels: the pure wheels import: deepspeed', deepspeed.__version__)") 2>&1 \
    | grep -v "real_accelerator"
du -sh "$WHL" | sed 's/^/gpu_wheels: done, /'
