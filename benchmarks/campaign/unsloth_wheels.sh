#!/usr/bin/env bash
# The wheel set for Unsloth's GRPO on our offline GPU hosts (issue 44; docs/unsloth.md): unsloth 2026.10.9 and what it
# imports that such a host lacks (Python 3.12, torch 2.11+cu130, transformers 5.17, accelerate, peft, triton, numpy,
# pandas, pyarrow, psutil and the image's other packages, ../.library device KINDS.md list of 2026-11-17). Its own
# site directory, so the worker gets trl 1.15 and datasets 4.x while our rows keep trl 1.16 and datasets 5.
#
#   benchmarks/campaign/unsloth_wheels.sh [DIR]     # default DIR=.whl-unsloth (must be git-ignored); prints the total size
#
# One device call carries 64 MiB with the tree: the script fails above 58 MiB. On the host (carry: [".whl-unsloth"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/unsloth_site .whl-unsloth/*.whl \
#     && export UNSLOTH_SITE=/tmp/unsloth_site && python3 benchmarks/bench_unsloth.py --preflight
# Not in the set, on purpose: bitsandbytes and pydantic (../shared/gpu/fetch_wheels.sh's .whl set, on PYTHONPATH
# there: bitsandbytes alone is 43 MB), xformers (optional: Unsloth falls back to torch's SDPA, as our rows use),
# diffusers (diffusion models only), shtab (tyro 1.x no longer needs it).
# Measured here 2026-11-27: 17 wheels, 39.1 MiB (unsloth 27.3, hf_transfer 3.4, torchao 3.2, unsloth_zoo 2.8).
set -euo pipefail
dir=${1:-.whl-unsloth}
limit_mib=58
mkdir -p "$dir"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# unsloth + unsloth_zoo: the trainer patches and kernels; trl 1.15.0: the newest Unsloth accepts (<= 1.15.0)
# torchao, cut_cross_entropy, msgspec, tyro (+ docstring-parser, typeguard, typing-extensions >= 4.14): unsloth_zoo's
# needs; hf_transfer, json5, structlog, nest-asyncio: unsloth's; datasets < 5 (Unsloth's pin) + dill, multiprocess
# at datasets 4.8's bounds (dill < 0.4.2, multiprocess < 0.70.20); xxhash, fsspec, httpx are on the host
pkgs=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 torchao==0.18.0 cut_cross_entropy==25.1.1
      msgspec==0.22.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
      hf_transfer==0.1.9 json5==0.17.3 structlog==26.1.0 nest-asyncio==1.6.0 datasets==4.8.5 dill==0.4.1
      multiprocess==0.70.19)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" "${pkgs[@]}" 2>&1 | grep -v "is ignored" >&2 || true
# every pin must have arrived (pip's exit status is lost in the pipe above)
for p in "${pkgs[@]}"; do
  name=${p%%==*}; ver=${p#*==}
  ls "$dir"/* 2>/dev/null | grep -qi "/${name//-/_}-${ver}-" || { echo "error: $p did not download" >&2; exit 1; }
done
# each wheel's Requires-Dist (Python 3.12 on Linux x86_64) must be in the set or on the host, or named above
python3 - "$dir" <<'EOF'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
HOST = set("torch transformers accelerate peft triton numpy pandas pyarrow psutil packaging tqdm torchvision protobuf "
           "sentencepiece huggingface_hub typer rich pyyaml click certifi einops pillow regex filelock requests wheel "
           "jinja2 httpx xxhash fsspec safetensors tokenizers".split())
KNOWN_ABSENT = {"bitsandbytes", "pydantic", "xformers", "diffusers"}  # see the header
env = dict(python_version="3.12", python_full_version="3.12.3", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix", implementation_name="cpython", extra="")
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels}
missing = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name not in have | HOST | KNOWN_ABSENT:
            missing.setdefault(name, []).append(w.name.split("-")[0])
if missing:
    sys.exit("error: needed, but neither in the set nor on the host: "
             + "; ".join(f"{n} (by {', '.join(b)})" for n, b in sorted(missing.items())))
print(f"requirements: every Requires-Dist of the {len(wheels)} wheels is in the set or on the host, "
      f"except {', '.join(sorted(KNOWN_ABSENT))} (see the header)")
EOF
kib=$(du -ck "$dir"/*.whl | tail -1 | cut -f1)
mib=$(awk -v k="$kib" 'BEGIN { printf "%.1f", k / 1024 }')
echo "$(ls "$dir"/*.whl | wc -l) wheels, $mib MiB in $dir"
awk -v m="$mib" -v l="$limit_mib" 'BEGIN { exit !(m > l) }' && {
  echo "error: $mib MiB is over $limit_mib MiB: one device call carries 64 MiB with the tree" >&2; exit 1; }
echo "host: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/unsloth_site $dir/*.whl" \
     "&& export UNSLOTH_SITE=/tmp/unsloth_site"
