#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (Python 3.12, x86-64, no internet there) into .whl/,
# to be carried with the device call and installed there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
for pkg in fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
           typing-inspection==0.4.2 uvicorn==0.55.0 opentelemetry-api==1.45.2 typing_extensions==4.16.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pkg"
done
ls -la .whl
# a smoke test of the set, as the device will import it (pure-Python parts only; pydantic_core is cp312)
for w in .whl/*.whl; do unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' ; done | sort -u
