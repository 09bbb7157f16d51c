#!/usr/bin/env bash
# Convert time and peak RSS of one full-size H3 block from each input naming (ComfyUI file,
# official shards, diffusers shards, scaled fp8) and with a LoRA baked in, side by side in one
# run; checks that the official and diffusers outputs equal the ComfyUI-source outputs (cmp).
# Needs GNU time (/usr/bin/time) and ~20 GB of free disk in DIR.
# usage: bash bench/bench_inputs.sh [DIR]   (h3quant on PATH, e.g. .venv/bin in front)
set -euo pipefail
DIR=${1:-/tmp/h3quant-bench-inputs}
mkdir -p "$DIR"/comfy "$DIR"/official "$DIR"/diffusers
cd "$DIR"
size=(--preset full --blocks 1 --seed 5 --overwrite -q)
h3quant synth comfy/h3 "${size[@]}"
h3quant synth official/h3 --naming official "${size[@]}"
h3quant synth diffusers/h3 --naming diffusers "${size[@]}"
h3quant synth fp8.safetensors --dtype fp8 "${size[@]}"
h3quant synth-lora lora.safetensors --preset full --blocks 1 --rank 32 --scale 0.02 --overwrite
run() {  # label, then the convert arguments
    local label=$1; shift
    /usr/bin/time -f "$label: %e s, peak RSS %M KB" h3quant convert "$@" --overwrite -q
}
for k in comfy/h3 official/h3 diffusers/h3 fp8.safetensors; do
    n=$(echo "$k" | tr '/.' '__')
    for to in bf16 int8-convrot; do
        run "$k --to $to" "$k" "out_${n}_$to.safetensors" --to "$to" --no-report
    done
done
for to in bf16 int8-convrot; do
    for n in official diffusers; do
        cmp "out_comfy_h3_$to.safetensors" "out_${n}_h3_$to.safetensors" \
            && echo "cmp $n vs ComfyUI source, --to $to: identical"
    done
done
run "int8-convrot, no LoRA" comfy/h3 o.safetensors --no-report
run "int8-convrot + LoRA, no report" comfy/h3 o.safetensors --lora lora.safetensors --no-report
run "int8-convrot + LoRA, survival report" comfy/h3 o.safetensors --lora lora.safetensors --report r8.json
run "w4a8, no LoRA" comfy/h3 o.safetensors --to w4a8 --no-report
run "w4a8 + LoRA, survival report" comfy/h3 o.safetensors --to w4a8 --lora lora.safetensors --report r4.json
rm -f out_*.safetensors o.safetensors
