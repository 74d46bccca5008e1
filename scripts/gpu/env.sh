# Sourced by the GPU scripts (scripts/gpu/*.sh), run from the repository root on the GPU machine
# with `.whl` carried (../shared/tools/gpu-wheels fetches it): installs those wheels, puts them and
# the checkout on PYTHONPATH, keeps Triton's kernel cache in the checkout (ignored; reused while
# the machine stays warm) and makes $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
