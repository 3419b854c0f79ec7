# The E8 layer's resident memory on one machine: what stays allocated after its steps, and its
# peak under glibc, jemalloc and tcmalloc (those installed), host cache on and off.
# Run from the repository root with the venv's python first on PATH:
#   bash benchmarks/results/memory_e8_intel/run.sh
set -e
HERE=benchmarks/results/memory_e8_intel
cc -O1 -shared -fPIC $HERE/held_allocations.c -o /tmp/held_allocations.so -ldl -lpthread
for dtype in fp32 bf16; do
  LD_PRELOAD=/tmp/held_allocations.so PYTHONPATH=src:. python $HERE/held_after_step.py $dtype /tmp/held_$dtype.txt
done | tee $HERE/held.txt

CASE='{"num_experts": 8, "num_tokens": 512, "top_k": 2, "hidden": 1024, "intermediate": 256, "shared_intermediate": 256}'
: > $HERE/allocators.jsonl
for allocator in glibc jemalloc tcmalloc; do
  case $allocator in
    glibc) preload="" ;;
    jemalloc) preload=$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -1); [ -n "$preload" ] || continue ;;
    tcmalloc) preload=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1); [ -n "$preload" ] || continue ;;
  esac
  for dtype in fp32 bf16; do for cache in default 0; do
    cache_env=""; [ $cache = 0 ] && cache_env="MOE_GMM_HOST_CACHE_MB=0"
    env ${preload:+LD_PRELOAD=$preload} $cache_env PYTHONPATH=src:. python -m moe_gmm.bench.memory moe_layer \
      "{\"case\": $CASE, \"dtype\": \"$dtype\", \"impl\": \"moe_gmm\"}" --threads 2 \
      | python -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({'allocator': '$allocator', 'host_cache': '$cache', 'dtype': '$dtype', **r}))" \
      >> $HERE/allocators.jsonl
  done; done
done
python - $HERE/allocators.jsonl <<'PY' | tee $HERE/allocators.md
import json, sys
print("| allocator | host cache | fp32 peak / budget | bf16 peak / budget |")
print("|---|---|---:|---:|")
rows = [json.loads(line) for line in open(sys.argv[1])]
for key in dict.fromkeys((r["allocator"], r["host_cache"]) for r in rows):
    by = {r["dtype"]: r for r in rows if (r["allocator"], r["host_cache"]) == key}
    cells = [f"{by[d]['ratio']:.2f} ({by[d]['peak_bytes'] / 2**20:.1f} MiB)" for d in ("fp32", "bf16")]
    print(f"| {key[0]} | {key[1]} | {cells[0]} | {cells[1]} |")
PY
