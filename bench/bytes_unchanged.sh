#!/usr/bin/env bash
# Output bytes of a fixed set of conversions on tiny synthetic checkpoints: prints one sha256 per
# output file. Run it before and after a change that must not change behaviour and diff the two
# listings (same inputs must give the same bytes).
# Usage: bench/bytes_unchanged.sh [H3QUANT] (default: .venv/bin/h3quant, else h3quant on PATH)
set -euo pipefail
H3="${1:-}"
if [ -z "$H3" ]; then
  if [ -x .venv/bin/h3quant ]; then H3=.venv/bin/h3quant; else H3=h3quant; fi
fi
case "$H3" in */*) H3="$(cd "$(dirname "$H3")" && pwd)/$(basename "$H3")";; esac
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
W=.  # relative paths: the JSON listings name the files the same way on every run
q() { "$H3" "$@" >/dev/null 2>&1 || { echo "FAILED: h3quant $*" >&2; exit 1; }; }

q synth "$W/bf16.safetensors" --blocks 2 --seed 3 -q
q synth "$W/official" --naming official --blocks 2 --seed 3 -q
q synth "$W/diffusers" --naming diffusers --blocks 2 --seed 3 -q
q synth "$W/diffusers_fp8" --naming diffusers --dtype fp8 --blocks 2 --seed 3 -q
q synth-lora "$W/lora_peft.safetensors" --style diffusers --blocks 2 --seed 5
q synth-lora "$W/lora_kohya.safetensors" --style kohya --blocks 2 --seed 6

C="--no-report -q --workers 2"
q convert "$W/bf16.safetensors" "$W/int8c.safetensors" --to int8-convrot $C
q convert "$W/bf16.safetensors" "$W/int8.safetensors" --to int8 $C
q convert "$W/bf16.safetensors" "$W/w4a8.safetensors" --to w4a8 $C
q convert "$W/bf16.safetensors" "$W/npu.safetensors" --to int8-convrot --layout npu $C
q convert "$W/int8c.safetensors" "$W/int8c_npu.safetensors" --to int8-convrot --layout npu $C
q convert "$W/npu.safetensors" "$W/npu_back.safetensors" --to int8-convrot --layout canonical $C
q convert "$W/w4a8.safetensors" "$W/w4a8_to_int8.safetensors" --to int8-convrot $C
q convert "$W/int8c.safetensors" "$W/back_bf16.safetensors" --to bf16 $C
q convert "$W/w4a8.safetensors" "$W/w4a8_bf16.safetensors" --to bf16 $C
q convert "$W/official" "$W/from_official.safetensors" --to int8-convrot $C
q convert "$W/diffusers" "$W/from_diffusers.safetensors" --to w4a8 $C
q convert "$W/diffusers_fp8" "$W/from_fp8.safetensors" --to int8 $C
q convert "$W/bf16.safetensors" "$W/lora_int8.safetensors" --to int8-convrot \
  --lora "$W/lora_peft.safetensors:0.8" --lora "$W/lora_kohya.safetensors" $C
q convert "$W/int8c.safetensors" "$W/lora_requant.safetensors" --lora "$W/lora_peft.safetensors" $C
q convert "$W/bf16.safetensors" "$W/mixed.safetensors" --to int8-convrot \
  --layer 'blocks\.0\.attn=w4a8' --layer 'mlp\.fc2=keep' --layer 'blocks\.1\.attn=int8:layout=npu' $C

# the header-only commands' verdicts and descriptions, as JSON (must not change either)
for f in int8c w4a8 npu mixed from_fp8 bf16; do
  "$H3" validate "$W/$f.safetensors" --json > "$W/validate_$f.json" 2>/dev/null || true
  "$H3" inspect "$W/$f.safetensors" --json > "$W/inspect_$f.json" 2>/dev/null || true
done
"$H3" validate "$W/w4a8.safetensors" --deep --json > "$W/validate_deep_w4a8.json" 2>/dev/null || true
"$H3" inspect "$W/diffusers" --json > "$W/inspect_diffusers.json" 2>/dev/null || true
"$H3" inspect "$W/lora_kohya.safetensors" --json > "$W/inspect_lora.json" 2>/dev/null || true

find . -type f | LC_ALL=C sort | xargs sha256sum
