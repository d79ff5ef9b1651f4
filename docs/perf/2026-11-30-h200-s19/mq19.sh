# Session 19 call 6: MQA / GQA-16 rows of the final tree (wgmma kernel with the prefetch).
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
Q1="--q-heads 32 --kv-heads 1"
for row in "--batch 64 --context 4096" "--batch 96 --context 4096" "--batch 48 --context 8192" \
           "--batch 32 --context 32768" "--batch 128 --context 8192"; do B "" $Q1 $row; done
B "" --q-heads 32 --kv-heads 2 --batch 64 --context 4096
B "" --batch 1 --context 32768
B "" --kv-dtype fp8_e4m3 --batch 1 --context 32768
