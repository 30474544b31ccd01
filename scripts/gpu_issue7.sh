#!/usr/bin/env bash
# Issue 7's decode grid and the CPU kernels' host figures on the lent GPU machine: one part per
# device call (each part fits its 10-minute limit). Run from the repository root with $OUT set;
# the JSON (hardware named inside) lands in $OUT, the merge into bench/results runs here after:
#
#   scripts/gpu_issue7.sh 30b      # Qwen3-30B-A3B: static split, LRU, LRU + q* at 8/16/32 GB cards
#   scripts/gpu_issue7.sh 36       # Qwen3.6-35B-A3B: all resident, the three policies at 8/16 GB
#   scripts/gpu_issue7.sh 36-32    # Qwen3.6 at 32 GB alone (with the 64.4 GB all-resident pool it
#                                  # runs out of an 80 GB card's memory; an H200 could run it in `36`)
#   scripts/gpu_issue7.sh grid     # 30b, then 36-32 and 36 in one call (about 510 s on an H100, more on a
#                                  # host whose gather is slow: stop 70's ran out of time in 36's last
#                                  # block; the 32 GB rows, the 1.5x target's, come before it; each
#                                  # JSON is saved row by row)
#   scripts/gpu_issue7.sh prefill  # both models' prefill rows alone (4k/8k/16k, double and single buffer);
#                                  # merge with offload_merge.py, which recomputes the 8k target from them
#   scripts/gpu_issue7.sh ab       # both models, 8/16/32 GB: lru+q* against lru+q*/flat, then lru+q* once
#                                  # more (lru+q*/again: the rows' own noise band; about 400 s)
#   scripts/gpu_issue7.sh behind   # both models, 8/16/32 GB: lru+q* against lru+q*/behind (fills behind the
#                                  # CPU), then lru+q*/again (about 400 s on an H100)
#   scripts/gpu_issue7.sh cpu      # the host's CPU kernels: the expert bench and the projections
#   scripts/gpu_issue7.sh gather   # the fill gather against the DMA over a grid of tiles (stop 68's
#                                  # H100 host gathered at 30-34 GB/s beside a 53 GB/s DMA)
#   scripts/gpu_issue7.sh engine   # the engine's decode with q* by call size against the flat rule
#   scripts/gpu_issue7.sh engine-behind  # the engine's decode with fills behind the CPU against without
#
#   python bench/offload_merge.py --label L --previous R --note "..." run_30b.json run_36.json run_36_32.json
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results go to}"
case "${1:-}" in 30b|36|36-32|grid|prefill|ab|behind|cpu|gather|engine|engine-behind) ;;
  *) echo "usage: scripts/gpu_issue7.sh 30b|36|36-32|grid|prefill|ab|behind|cpu|gather|engine|engine-behind" >&2; exit 2 ;; esac
export PYTHONPATH="$PWD/engine:$PWD/tests:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
PY=${PYTHON:-python}
policies="static/graph,lru,lru+q*,lru+q*/flat"
decode=(--no-prefill --no-tune)
case "${1:-}" in
  30b) "$PY" bench/gpu_offload.py --models qwen3-30b-a3b --budgets 8,16,32 --policies "$policies" \
         "${decode[@]}" --out "$OUT/run_30b.json" ;;
  36) "$PY" bench/gpu_offload.py --models qwen3.6-35b-a3b --budgets 8,16 --policies "all,$policies" \
        "${decode[@]}" --out "$OUT/run_36.json" ;;
  36-32) "$PY" bench/gpu_offload.py --models qwen3.6-35b-a3b --budgets 32 --policies "$policies" \
           "${decode[@]}" --out "$OUT/run_36_32.json" ;;
  grid) for part in 30b 36-32 36; do bash "$0" "$part"; done ;;
  prefill) "$PY" bench/gpu_offload.py --models qwen3-30b-a3b,qwen3.6-35b-a3b --no-decode --no-tune \
             --out "$OUT/run_prefill.json" ;;
  ab|behind) side=$([ "$1" = ab ] && echo flat || echo behind)
      for m in qwen3-30b-a3b qwen3.6-35b-a3b; do
        "$PY" bench/gpu_offload.py --models "$m" --budgets 8,16,32 --policies "lru+q*,lru+q*/$side,lru+q*/again" \
          "${decode[@]}" --out "$OUT/${1}_$m.json"
      done ;;
  cpu) "$PY" bench/cpu_expert_kernel.py --label "GPU host" --rounds 2 --prefetch 4096 --out "$OUT"
       "$PY" bench/cpu_linear.py --label "GPU host" --rounds 3 --tokens 1,2,4,8 \
         --settings "default; linear_far_pf=0; linear_pair_tokens=1048576" --out "$OUT/cpu_linear_host.json" ;;
  gather) "$PY" bench/gather_probe.py --out "$OUT/gather_probe.json" ;;
  engine|engine-behind) round=0
          other=$([ "$1" = engine ] && echo graphs/flat-speed || echo graphs+behind)
          for sides in "graphs,$other" "$other,graphs"; do   # each order once
            round=$((round + 1))
            "$PY" bench/engine_gpu_decode.py --steps 32 --fractions 0.25,0.5 --sides "$sides" \
              --out "$OUT/${1}_ab_round$round.json" | tail -10
          done ;;
esac
