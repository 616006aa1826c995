#!/usr/bin/env bash
# `make wheel-demo` (CI's demo): the wheel in dist/ (`make wheel`) installed into a fresh virtual
# environment. First bare: the CLI, the SDK and every service import, the bundled examples
# validate, none of the optional packages (torch, scikit-learn, matplotlib, SeaweedFS) nor the
# test tools are there, and what needs an extra says which one. Then with [torch,poc]:
# `fedhive demo --local` from a temporary folder outside the repository, with a POC folder,
# namespace and gateway port of its own, so nothing comes from the source tree or from another
# POC. pip's cache is reused; torch==2.13.0 resolves through pip's configuration (the CPU wheel
# where one is configured). WHEEL_VENV (default build/wheel-venv) is removed first.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
venv=$repo/${WHEEL_VENV:-build/wheel-venv}
wheels=(dist/fedhive-*.whl)
if [ "${#wheels[@]}" -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "wheel-demo: expected one dist/fedhive-*.whl, found: ${wheels[*]} (run make wheel)" >&2
    exit 1
fi
wheel=$repo/${wheels[0]}
unset PYTHONPATH  # nothing but the virtual environment's site-packages
work=$(mktemp -d "${TMPDIR:-/tmp}/fedhive-wheel-demo.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
step() { echo "wheel-demo: [${SECONDS}s] $*"; }  # seconds since the start: where CI's time goes

step "fresh venv $venv, bare install of ${wheels[0]}"
rm -rf "$venv"
python3 -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q "$wheel"
"$venv/bin/fedhive" --help >/dev/null
examples=$("$py" - <<'EOF'
import importlib
import importlib.util
import sys
from pathlib import Path

import fedhive
from fedhive.poc.demo import EXAMPLES, find_examples

site = Path(fedhive.__file__).parents[1]
assert site.name == "site-packages", f"fedhive imported from {site}, not the virtual environment"
for service in ("job_store", "scheduler", "job_runner", "site_agent", "gateway"):
    module = importlib.import_module(f"fedhive_services.{service}.main")
    assert hasattr(module, "main"), module
importlib.import_module("fedhive.proto.v1.admin_pb2_grpc")
unwanted = ("torch", "sklearn", "matplotlib", "pytest", "hypothesis", "testcontainers", "mypy")
present = [name for name in unwanted if importlib.util.find_spec(name) is not None]
assert not present, f"the bare wheel brought in {present}"
assert not (Path(sys.executable).parent / "weed").exists(), "the bare wheel brought in weed"
bundled = find_examples(None)
assert bundled == site / "fedhive" / "examples", bundled
assert EXAMPLES == ("hello-numpy", "hello-pt"), EXAMPLES  # the ones validated below
print(bundled)
EOF
)
"$venv/bin/fedhive" validate "$examples/hello-numpy"
"$venv/bin/fedhive" validate "$examples/hello-pt"

# What needs an extra says which one, in one line, before it starts anything.
expect_hint() {  # expect_hint EXTRA COMMAND...: exit 2 and the line naming fedhive[EXTRA]
    local extra=$1 said rc=0
    shift
    said=$("$@" 2>&1) || rc=$?
    if [ "$rc" -ne 2 ] || ! grep -qF "pip install 'fedhive[$extra]'" <<<"$said"; then
        echo "wheel-demo: \`$*\` should exit 2 naming fedhive[$extra]; exit $rc: $said" >&2
        exit 1
    fi
    step "as expected: $said"
}
expect_hint torch "$venv/bin/fedhive" demo --local --dir "$work/poc"
expect_hint plot "$venv/bin/fedhive" --gateway 127.0.0.1:1 metrics 0 --plot "$work/curve.png"

step "install ${wheels[0]}[torch,poc]"
"$py" -m pip install -q "$wheel[torch,poc]"
port=$("$py" -c 'from fedhive.poc.s3server import free_ports; print(free_ports(1)[0])')
step "fedhive demo --local in $work (gateway port $port)"
if ! "$venv/bin/fedhive" demo --local --dir "$work/poc" --namespace wheel-demo --port "$port"
then
    for log in "$work"/poc/logs/*.log; do  # what the processes said, for the CI log
        [ -f "$log" ] && { echo "--- $log"; tail -n 20 "$log"; }
    done
    exit 1
fi
step "done: the wheel's demo completed both jobs"
