#!/usr/bin/env bash
# The GPU check in one call, from the project root of a checkout on a machine with an NVIDIA GPU:
#
#   bash evals/bench/gpu_check.sh            # or: make gpu-check
#   bash evals/bench/gpu_check.sh --smoke    # the same pipeline on a CPU, tiny model (1-3 min)
#
# Writes $OUT/gpu-check.md (OUT defaults to out/gpu-check) and logs/ beside it; exits non-zero
# if any stage failed, timed out or was left without time. Arguments go to gpu_check.py
# (--help lists them). The full run fits in 8 minutes on an H200.
#
# A lent GPU machine has torch, triton and transformers but not the server's web stack, and no
# network. Run `bash ../shared/gpu/prepare-device.sh` here first: it writes .whl/ (wheels of
# fastapi, pydantic, uvicorn...) and .tok/ (the 49152-token SmolLM2 tokenizer), which travel with
# the checkout; this script installs the wheels into /tmp/site unless it runs the project's own
# .venv. For the test modules that need hypothesis or openai, carry those too:
#   EXTRA_WHEELS="llguidance hypothesis sortedcontainers openai httpx2 httpcore2 jiter truststore" \
#     bash ../shared/gpu/prepare-device.sh
# and the llguidance the runtime needs (1.9+, manylinux_2_31; docs/gpu-check.md has the command).
# The interpreter is $PYTHON, else .venv/bin/python if there is one, else python3; the checkout
# goes first on PYTHONPATH either way.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
[ -f pyproject.toml ] || { echo "gpu_check.sh: cannot find the project root" >&2; exit 2; }

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python  # a machine with `make install` done
else PY=python3
fi

start=$(date +%s)
if [ "$PY" != .venv/bin/python ] && compgen -G ".whl/*.whl" > /dev/null; then
  # --no-deps: only the carried wheels, never the machine's torch; --target keeps them apart.
  # By name from .whl/, so where two builds of a package travel (llguidance 1.9+ needs
  # manylinux_2_31, older ones 2_28) pip takes the newest this machine can run.
  names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1; done | sort -u)
  # shellcheck disable=SC2086  # one argument per name
  "$PY" -m pip install -q --no-index --find-links .whl --no-deps --no-compile --target /tmp/site \
    $names || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  echo "[setup] installed $(ls /tmp/site | grep -c dist-info$) packages from .whl/ in $(( $(date +%s) - start )) s: $(ls /tmp/site | grep dist-info$ | sed 's/.dist-info//' | tr '\n' ' ')" >&2
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# A CUDA library built here (`LITESERVE_CACHE=$PWD/.kernels runtime build-kernels`) serves a
# GPU machine without nvcc: the cuda backend finds it in the cache by its source hash.
[ -d .kernels ] && export LITESERVE_CACHE=$PWD/.kernels
[ -d .tok ] || echo "[setup] no .tok/: models get a small trained tokenizer, not the 49152-token one" >&2

export OUT=${OUT:-$PWD/out/gpu-check}
export GPU_CHECK_COMMAND="bash evals/bench/gpu_check.sh${*:+ $*}"
"$PY" evals/bench/gpu_check.py --out "$OUT" "$@"
rc=$?
if [ -f "$OUT/gpu-check.md" ]; then
  echo "===== $OUT/gpu-check.md =====" >&2
  cat "$OUT/gpu-check.md"
fi
echo "[gpu-check] exit $rc after $(( $(date +%s) - start )) s" >&2
exit $rc
