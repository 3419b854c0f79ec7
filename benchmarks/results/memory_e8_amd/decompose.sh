# The E8 layer's peak under each priming and glibc policy; one JSON line per measurement.
CASE='{"num_experts": 8, "num_tokens": 512, "top_k": 2, "hidden": 1024, "intermediate": 256, "shared_intermediate": 256}'
for dtype in fp32 bf16; do for impl in moe_gmm hf_grouped_mm; do for prime in tiny full; do for env in "" "MALLOC_MMAP_THRESHOLD_=131072"; do
  env $env PYTHONPATH=src python -m moe_gmm.bench.memory moe_layer "{\"case\": $CASE, \"dtype\": \"$dtype\", \"impl\": \"$impl\"}" --threads 2 --prime $prime \
    | python -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({'case': 'E8-k2-T512', 'dtype': '$dtype', 'impl': '$impl', **r}))"
done; done; done; done
