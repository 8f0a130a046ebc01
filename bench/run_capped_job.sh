#!/usr/bin/env bash
# The production length mix through quantize_sala on a GPU capped at CAP GB, the way a user with
# a smaller GPU meets the limit: a torch process holds the rest of the device (CAP 0: uncapped).
# See docs/results.md ("The real job on a capped GPU").
#
#   BIN=DIR OUT=DIR bash bench/run_capped_job.sh CAP_GB gptq|nvfp4 TAG [quantize_sala flags...]
#
# BIN holds quantize_sala and make_fixture built with `--features cuda` and
# calib-production.jsonl (`make_calib --production-mix`); each may be xz-compressed (FILE.xz),
# and BIN/kcache.tgz, when present, is a kernel cache from an earlier run. make_fixture writes
# the full-size random-weight model to /tmp/sala-full-size unless it is there. OUT receives
# TAG.log (the command's log with GNU time's figures), TAG-report.json, TAG-gpumem.txt
# (nvidia-smi's used MiB every 2 s), TAG-rss.txt (the resident set by kind every 2 s),
# TAG-clocks.txt (SM clock, power, temperature and clock-limit reasons every 2 s),
# TAG-sha256.txt (the checkpoint's shards), TAG-holder.log and kcache.tgz. QTIMEOUT bounds the run.
set -u
CAP=$1; RECIPE=$2; TAG=$3; shift 3
B=${BIN:-.device-bin}
for f in $B/*.xz; do [ -f "${f%.xz}" ] || xz -dk "$f"; done
chmod +x $B/quantize_sala $B/make_fixture
[ -f $B/kcache.tgz ] && tar xzf $B/kcache.tgz
mkdir -p target
export CUDA_CACHE_PATH=$PWD/target/cuda-jit CUDA_CACHE_MAXSIZE=1073741824
MODEL=/tmp/sala-full-size
if [ ! -f $MODEL/model.safetensors.index.json ]; then
  t=$SECONDS
  $B/make_fixture --full-size $MODEL --config fixtures/minicpm-sala-9b-config.json > $OUT/make_fixture.log 2>&1
  echo "make_fixture rc=$? $((SECONDS - t)) s"
fi
rm -f /tmp/held
HOLDER=
if [ "$CAP" != "0" ]; then
  python3 - "$CAP" > $OUT/$TAG-holder.log 2>&1 <<'PY' &
import sys, time, torch
cap = float(sys.argv[1]) * 1e9
free, total = torch.cuda.mem_get_info()
hold = int(free - cap)
x = torch.empty(hold, dtype=torch.uint8, device='cuda')
free2, _ = torch.cuda.mem_get_info()
print(f"holding {hold/1e9:.2f} GB of {total/1e9:.2f} GB; free before {free/1e9:.2f} GB, after {free2/1e9:.2f} GB", flush=True)
open('/tmp/held', 'w').write('1')
time.sleep(3600)
PY
  HOLDER=$!
  for i in $(seq 60); do [ -f /tmp/held ] && break; sleep 1; done
  cat $OUT/$TAG-holder.log
fi
(while true; do echo "$SECONDS $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done) > $OUT/$TAG-gpumem.txt &
SAMPLER=$!
# The SM clock (MHz), board power (W), temperature (C) and active clock-limit reasons every 2 s:
# a long run can hold lower clocks than a short benchmark.
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader,nounits -l 2 > $OUT/$TAG-clocks.txt 2>&1 &
CLOCKS=$!
# The run's resident set by kind (kB): anonymous (heap, pinned staging), file-backed (mapped
# model and checkpoint pages), shared; every 2 s.
(while true; do
  pid=$(pgrep -x quantize_sala | head -1)
  [ -n "$pid" ] && echo "$SECONDS $(awk '/^(VmRSS|RssAnon|RssFile|RssShmem):/ {printf "%s %s ", $1, $2}' /proc/$pid/status 2>/dev/null)"
  sleep 2
done) > $OUT/$TAG-rss.txt &
RSS_SAMPLER=$!
rm -rf /tmp/q-out
t=$SECONDS
timeout --signal=INT --kill-after=10 ${QTIMEOUT:-540} /usr/bin/time -v $B/quantize_sala --device cuda --recipe $RECIPE \
  --input $MODEL --output /tmp/q-out --calib-data $B/calib-production.jsonl \
  --max-samples 96 --max-len 131072 "$@" > $OUT/$TAG.log 2>&1
rc=$?
echo "== $TAG rc=$rc wall=$((SECONDS - t)) s" | tee -a $OUT/$TAG.log
kill $SAMPLER $RSS_SAMPLER $CLOCKS 2>/dev/null; [ -n "$HOLDER" ] && kill $HOLDER 2>/dev/null
cp /tmp/q-out/quantization_report.json $OUT/$TAG-report.json 2>/dev/null
# The checkpoint's bytes, to compare runs under different caps.
(cd /tmp/q-out 2>/dev/null && sha256sum *.safetensors > $OUT/$TAG-sha256.txt)
tar czf $OUT/kcache.tgz target/sala-kernels target/autotune target/cuda-jit 2>/dev/null
ls -la $OUT
grep -v "^\s*$" $OUT/$TAG.log | tail -45
sort -k2 -n $OUT/$TAG-gpumem.txt | tail -1 | sed 's/^/peak nvidia-smi MiB used: /'
awk -F', ' '$1 ~ /^[0-9]+$/ {n++; s += $1; p += $2} END {if (n) printf "mean SM clock %.0f MHz, mean power %.0f W over %d samples\n", s / n, p / n, n}' $OUT/$TAG-clocks.txt
for k in VmRSS RssAnon RssFile RssShmem; do
  awk -v k="$k:" '{for (i = 2; i < NF; i++) if ($i == k && $(i+1) > m) {m = $(i+1); t = $1}} END {printf "peak %s %.2f GB at %s s\n", k, m / 1e6, t}' $OUT/$TAG-rss.txt
done
