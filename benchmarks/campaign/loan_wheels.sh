#!/usr/bin/env bash
# Our wheels for a GPU loan, in ONE set with the vLLM bundle's (issue 43): the bundle (../shared/gpu/vllm_bundle.sh)
# already carries bitsandbytes 0.49.2 (slimmed to its cuda130 library) and pydantic 2.12.0 with pydantic-core 2.41.1,
# typing-inspection 0.4.2 and annotated-types 0.7.0. ../shared/gpu/fetch_wheels.sh brings bitsandbytes 0.50.2 and
# pydantic 2.14.4: two versions of one package in two --target folders on one PYTHONPATH break the install there.
# So the versions here are the bundle's, and with --with-bundle (a loan that brings vLLM) the packages the bundle
# carries are left out: what is left (~6 MiB) rides in the third call beside the last piece (47 MiB + the tree).
#
#   benchmarks/campaign/loan_wheels.sh [--with-bundle] [DIR]   # default DIR=.whl (ignored by git); prints the total size
#
# Without --with-bundle (a loan without vLLM) bitsandbytes 0.49.2 comes whole (~40 MiB: every CUDA build).
set -euo pipefail
bundle=0
[ "${1:-}" = "--with-bundle" ] && { bundle=1; shift; }
dir=${1:-.whl}
mkdir -p "$dir"
rm -f "$dir"/*.whl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# trl 1.16 (the hosts have none), datasets and its pure-Python needs, DeepSpeed's hjson; typing-extensions new enough
# for pydantic 2.12
pkgs=(trl==1.16.0 datasets dill multiprocess hjson typing-extensions==4.16.0)
[ "$bundle" = 1 ] || pkgs+=(bitsandbytes==0.49.2 pydantic==2.12.0 pydantic-core==2.41.1 annotated-types==0.7.0
                            typing-inspection==0.4.2)
[ "${WITH_WANDB:-0}" = 1 ] && pkgs+=(wandb==0.31.0)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" "${pkgs[@]}"
# DeepSpeed ships a source distribution only: a pure-Python wheel (its ops JIT-build on first use).
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$dir" deepspeed==0.19.8
for pkg in bitsandbytes pydantic pydantic_core; do   # one version of each in the set, the bundle's
  n=$(ls "$dir" | grep -c "^${pkg}-" || true)
  [ "$bundle" = 1 ] && [ "$n" != 0 ] && { echo "FAIL: $pkg is the bundle's; --with-bundle must not bring it"; exit 1; }
done
du -ch "$dir"/*.whl | tail -1
