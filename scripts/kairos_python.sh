# Sourced by the reproduce scripts, from the checkout's root: sets $python, the interpreter that runs kairos.
# KAIROS_PYTHON=/path/to/python uses that interpreter (e.g. another checkout's .venv) instead of setting up .venv.
if [[ -z ${KAIROS_PYTHON:-} ]]; then
    bash scripts/setup.sh
fi
python=${KAIROS_PYTHON:-.venv/bin/python}
