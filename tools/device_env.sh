# Source this first in every command on the GPU machine (no internet there):
#   source tools/device_env.sh
# Installs the carried wheels (.whl: pydantic & co., absent from that image) and
# mm3 itself (with its entry points) into /tmp/site, then puts it on PYTHONPATH.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
set +e
