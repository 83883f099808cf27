# Sourced first by the one-call GPU scripts that run on the device's copy of the tree: installs the carried
# wheels (.whl, scripts/fetch_gpu_wheels.sh) into /tmp/site, puts them and the tree on PYTHONPATH, names the GPU,
# and warns when SPECDEC_COMMIT is unset (the device copy has no git history for the records to name).
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
[ -n "$SPECDEC_COMMIT" ] || echo "warning: SPECDEC_COMMIT is unset: the records cannot name their commit (the device copy has no git history)"
