# session 8, call 4 (warm): the write checks by mode in parallel (run27's single write process ran out of time
# compiling), and the split/int4 Triton test files compiled on the GPU (numba cases left out).
export PYTHONPATH=/tmp/site:$PWD
START=$SECONDS; n=0
for m in none fp8_per_tensor int8_per_token_head fp8_per_token_head int8_per_tensor fp8_e5m2_per_tensor int4_per_token_head int4_per_token_head_norot k_int8_v_int4 k_int8_v_int4_norot k_fp8_v_int4 k_fp8_v_int4_norot; do
  n=$((n+1)); (timeout 200 python3 -m kvzoo.cli check --impl triton-cuda -q --seed 28 --op reshape_and_cache --mode $m > $OUT/w$n.log 2>&1; echo "rc $? at $((SECONDS-START)) s [$m]" >> $OUT/w$n.log) &
done
(timeout 210 python3 -m pytest -q -p no:cacheprovider tests/test_split_modes.py tests/test_triton_int4.py -k "not numba" > $OUT/t.log 2>&1; echo "rc $? at $((SECONDS-START)) s" >> $OUT/t.log) &
wait
for i in $(seq 1 $n); do echo "== $(grep -E 'passed|failed' $OUT/w$i.log | tail -1) | $(tail -1 $OUT/w$i.log)"; done
echo "== tests: $(tail -3 $OUT/t.log | tr '\n' ' ')"; grep -E "^FAILED" $OUT/t.log | head -10
cat $OUT/w*.log > $OUT/writes.log; rm $OUT/w*.log
