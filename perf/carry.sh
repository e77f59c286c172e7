#!/usr/bin/env bash
# HERE (network to the package index): what perf/scale.sh needs on the 16-core device host, as two ignored paths
# to carry beside the working tree (together ~20 MiB):
#   .whl/         enginemeter's runtime wheels for the host's python3.12 (the list of scripts/gpu/fetch-wheels.sh's
#                 em component; scale.sh installs them into /tmp/site)
#   .device/ngx/  this machine's nginx (apt-get install -y nginx-light) with the libraries it links beyond glibc
# Then, in one device call:  NGINX_BIN=.device/ngx/nginx perf/scale.sh "$OUT/scale"   (carry: .whl, .device/ngx)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EM=$(sed -n 's/^EM="\(.*\)"$/\1/p' scripts/gpu/fetch-wheels.sh)
[ -n "$EM" ] || { echo "no EM list in scripts/gpu/fetch-wheels.sh" >&2; exit 1; }
mkdir -p .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --dest .whl --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp --abi cp312 --abi abi3 --abi none $EM uvloop
rm -f .whl/numpy-*.whl
ngx=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$ngx" ] || { echo "no nginx here: apt-get install -y nginx-light" >&2; exit 1; }
rm -rf .device/ngx; mkdir -p .device/ngx
cp "$ngx" .device/ngx/nginx
ldd "$ngx" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt)\.so' | xargs -I{} cp -L {} .device/ngx/
du -sh .whl .device/ngx
