#!/usr/bin/env bash
# Peak RSS and time at each documented size limit (h3quant.limits), side by side in one run:
#   verify --model at the whole-model row limit (16,384 rows) and at 1/4 of it (tiny widths:
#     memory grows with rows x width; attention runs in bounded score blocks, never rows^2);
#   per-block verify at the --tokens maximum (16,384) and at 1/4 of it (tiny widths);
#   convert --to w4a8 of one full-size block with --workers 1, 8 and 64 (the maximum);
#   a header naming block index 10^12: refused by validate and convert from the header alone.
# usage: bash bench/bench_limits.sh [DIR]   (h3quant on PATH, e.g. .venv/bin in front; GNU time)
set -euo pipefail
DIR=${1:-/tmp/h3quant-bench-limits}
mkdir -p "$DIR"
cd "$DIR"
t() {  # label, then the command
    local label=$1; shift
    local rc=0
    /usr/bin/time -o time.txt -f "%e s, peak RSS %M KB" "$@" >/dev/null 2>err.txt || rc=$?
    echo "$label: $(cat time.txt | tail -1), exit $rc"
}
h3quant synth tiny.safetensors --preset tiny --blocks 2 --seed 3 --overwrite -q
h3quant convert tiny.safetensors tiny_int8.safetensors --to int8-convrot --overwrite -q --no-report
# 16,384 rows: text 48 + 2 x 1000 audio + 4 x 64 x 56 video
t "verify --model, 16,384 rows (the limit), tiny" \
    h3quant verify tiny_int8.safetensors --model --reference tiny.safetensors \
    --frames 4 --height 128 --width 112 --audio-frames 1000 --text-tokens 48
t "verify --model, 4,096 rows, tiny" \
    h3quant verify tiny_int8.safetensors --model --reference tiny.safetensors \
    --frames 1 --height 128 --width 112 --audio-frames 250 --text-tokens 12
t "verify --model, 16,385 rows (refused)" \
    h3quant verify tiny_int8.safetensors --model \
    --frames 4 --height 128 --width 112 --audio-frames 1000 --text-tokens 49
t "verify --tokens 16384 (the limit), tiny" \
    h3quant verify tiny_int8.safetensors --reference tiny.safetensors --tokens 16384
t "verify --tokens 4096, tiny" \
    h3quant verify tiny_int8.safetensors --reference tiny.safetensors --tokens 4096
h3quant synth full1.safetensors --preset full --blocks 1 --seed 3 --overwrite -q
for w in 1 8 64; do
    t "convert --to w4a8 --workers $w, one full block" \
        h3quant convert full1.safetensors "w4a8_$w.safetensors" --to w4a8 --workers "$w" \
        --overwrite -q --no-report
done
cmp w4a8_1.safetensors w4a8_64.safetensors && echo "cmp --workers 1 vs 64: identical"
python3 - <<'EOF'
import json, struct
# a header naming block 10^12 (no data needed beyond the header: one empty tensor)
h = {"blocks.1000000000000.attn.qkv_proj.weight": {"dtype": "BF16", "shape": [0, 4],
                                                   "data_offsets": [0, 0]}}
raw = json.dumps(h).encode()
open("absurd.safetensors", "wb").write(struct.pack("<Q", len(raw)) + raw)
EOF
t "validate, block index 10^12 (finding T106)" h3quant validate absurd.safetensors
t "convert, block index 10^12 (refused)" h3quant convert absurd.safetensors absurd_out.safetensors
test ! -e absurd_out.safetensors && echo "convert wrote nothing"
rm -f full1.safetensors w4a8_*.safetensors
