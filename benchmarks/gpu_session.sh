#!/usr/bin/env bash
# Everything the GPU path measures, in one call on a machine with one GPU
# (about 5 minutes): what the machine is, the overhead table, the faults job
# (exactness, the GPU fault's exit, kill to full size with default settings)
# and, with PARTS naming it, the faults job at production size (1.6 GB of
# state per rank). Each part is its own process with its own time limit, so a
# part that fails or hangs leaves the others' figures.
#
#   OUT=results_dir bash benchmarks/gpu_session.sh                # on the GPU machine
#   DEVICE=cpu OUT=/tmp/gpu bash benchmarks/gpu_session.sh        # the same mechanics here
#   PARTS="overhead faults faults_large" OUT=... bash benchmarks/gpu_session.sh
#
# Writes at most 8 files into $OUT: machine.txt, then <part>.txt (JSON lines)
# and <part>.err (what it wrote to stderr) per part, and jobs.tar.gz (the faults
# jobs' events and output). Exit status: the first failing part's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?OUT must name the folder for the results}
mkdir -p "$out"
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
parts=${PARTS:-overhead faults}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
common=(--device "$device")
[ "$device" = cpu ] && common+=(--quick)

{
    date -u +%FT%TZ
    git rev-parse --short HEAD 2>/dev/null || true
    nproc
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader
    "$py" -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
} >"$out/machine.txt" 2>&1

jobs_dir=$(mktemp -d)
status=0
for part in $parts; do
    case $part in
    overhead) argv=(--skip faults) limit=240 ;;
    faults) argv=(--skip overhead --keep "$jobs_dir/faults") limit=300 ;;
    # the issue's state size: 32 layers of 2048 x 2048 with Adam, 1.6 GB per rank
    faults_large) argv=(--skip overhead --layers 32 --keep "$jobs_dir/faults_large") limit=420 ;;
    *)
        echo "gpu_session: unknown part '$part' in PARTS (known: overhead faults faults_large)" >&2
        exit 2
        ;;
    esac
    echo "gpu_session: $part (at most ${limit} s)" >&2
    timeout --kill-after=20 "$limit" "$py" benchmarks/gpu_state.py "${common[@]}" "${argv[@]}" \
        >"$out/$part.txt" 2>"$out/$part.err"
    rc=$?
    echo "{\"kind\": \"part\", \"part\": \"$part\", \"returncode\": $rc}" >>"$out/$part.txt"
    [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
done
# the jobs' events.jsonl, output.txt and the controllers' records, as one file
if [ -n "$(ls -A "$jobs_dir")" ]; then
    tar -czf "$out/jobs.tar.gz" -C "$jobs_dir" . 2>/dev/null || true
fi
rm -rf "$jobs_dir"
# the project's results speak of the repository, not of where it was checked out
sed -i "s#$PWD/##g" "$out"/*.txt "$out"/*.err 2>/dev/null || true
exit "$status"
