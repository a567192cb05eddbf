# session 8, call 3: the merged split-triton (Triton split modes) and rotation (int4 at any even head size) branches
# on CUDA: the conformance check in 16 parallel processes (one per op, per mode for attention), and the split/int4
# Triton tests compiled (not gpu_only: every test of those files, on the GPU). Correctness only.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "commit $(cat .gpu/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
START=$SECONDS
n=0
for part in "--op reshape_and_cache" "--op dequantize" "--op golden" none fp8_per_tensor int8_per_token_head fp8_per_token_head int8_per_tensor fp8_e5m2_per_tensor int4_per_token_head int4_per_token_head_norot k_int8_v_int4 k_int8_v_int4_norot k_fp8_v_int4 k_fp8_v_int4_norot; do
  n=$((n+1)); case $part in --op*) args=$part;; *) args="--op paged_attention --mode $part";; esac
  (timeout 280 python3 -m kvzoo.cli check --impl triton-cuda -q --seed 27 $args > $OUT/c$n.log 2>&1; echo "rc $? at $((SECONDS-START)) s [$args]" >> $OUT/c$n.log) &
done
(KVZOO_DISABLE_NUMBA=1 timeout 290 python3 -m pytest -q -x -p no:cacheprovider tests/test_split_modes.py tests/test_triton_int4.py > $OUT/t.log 2>&1; echo "rc $? at $((SECONDS-START)) s" >> $OUT/t.log) &
wait
for i in $(seq 1 $n); do echo "== $(grep -E 'passed|failed' $OUT/c$i.log | tail -1) | $(tail -1 $OUT/c$i.log)"; done
echo "== tests: $(tail -3 $OUT/t.log | tr '\n' ' ')"
grep -h -E "FAIL|Error|error" $OUT/c*.log | head -20; grep -E "^FAILED|Error" $OUT/t.log | head -10
cat $OUT/c*.log > $OUT/checks.log
