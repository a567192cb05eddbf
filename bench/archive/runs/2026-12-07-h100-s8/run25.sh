# session 8, call 1: main's Triton code on CUDA: the conformance check in 12 parallel processes (one per op/mode, so
# Triton's compiles spread over the cores), and the gpu_only tests beside them. Correctness only: no timing here.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "commit $(cat .gpu/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
START=$SECONDS
n=0
for part in "--op reshape_and_cache" "--op dequantize" "--op golden" none fp8_per_tensor int8_per_token_head fp8_per_token_head fp8_e4m3fnuz_per_token_head int8_per_tensor fp8_e5m2_per_tensor int4_per_token_head int4_per_token_head_norot; do
  n=$((n+1)); case $part in --op*) args=$part;; *) args="--op paged_attention --mode $part";; esac
  echo "$n: $args" > $OUT/run25_check_$n.log
  (timeout 300 python3 -m kvzoo.cli check --impl triton-cuda -q --seed 25 $args >> $OUT/run25_check_$n.log 2>&1; echo "rc $? at $((SECONDS-START)) s" >> $OUT/run25_check_$n.log) &
done
(KVZOO_DISABLE_NUMBA=1 timeout 300 python3 -m pytest -m gpu_only -q -p no:cacheprovider tests/test_torch_ops.py tests/test_transformers_integration.py tests/test_plan.py tests/test_prepared_launch.py tests/test_triton_attention.py tests/test_triton_int4.py > $OUT/run25_gpu_tests.log 2>&1; echo "rc $? at $((SECONDS-START)) s" >> $OUT/run25_gpu_tests.log) &
wait
for f in $OUT/run25_check_*.log; do echo "== $(head -1 $f) | $(grep -E 'passed|failed|checks' $f | tail -1) | $(tail -1 $f)"; done
echo "== gpu tests: $(tail -2 $OUT/run25_gpu_tests.log | tr '\n' ' ')"
grep -h -E "FAIL|Error" $OUT/run25_check_*.log | head -20
