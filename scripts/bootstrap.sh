# Sourced by run_train.sh and run_tests.sh: create .venv and install the project on first use.
# A stamp file records the pyproject.toml it was installed from, so a changed dependency list
# re-installs and an unchanged one costs nothing. [dev] includes [hf] (transformers, safetensors,
# tokenizers), so `--model.name hf` configs need no extra step.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.simplesharded-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || ! cmp -s "$ROOT/pyproject.toml" "$STAMP"; then
    echo "[bootstrap] installing simplesharded (editable) with dev extras" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev]"
    cp "$ROOT/pyproject.toml" "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
