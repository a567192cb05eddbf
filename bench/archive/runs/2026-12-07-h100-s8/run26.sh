# session 8, call 2 (same warm machine): issue 45's host-time guard (35944df in .base against HEAD, interleaved,
# two rounds), then the e2e host profile at 16x4096 (host self time by op, DynamicCache and kvzoo int8).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "commit $(cat .gpu/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2; do
  for side in head base; do
    T0=$SECONDS
    if [ $side = base ]; then D=.base; else D=.; fi
    (cd $D && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/host_cost.py --calls 100 > $OUT/run26_host_${side}_$r.log 2>&1); echo "host $side $r rc $? $((SECONDS-T0)) s"
  done
done
grep -h -B2 -A14 "returns" $OUT/run26_host_head_1.log | head -22
T0=$SECONDS
KVZOO_BENCH_COMMIT=$(cat .gpu/COMMIT) timeout 150 python3 bench/probes/e2e_host_profile.py --shape 16x4096 --caches dynamic,kvzoo-int8 --new-tokens 9 --top 25 > $OUT/run26_profile.log 2>&1; echo "profile rc $? $((SECONDS-T0)) s"
grep -A3 "| cache" $OUT/run26_profile.log | head -12
