"""Findings: one named, coded rule violation (or note) about a checkpoint.

Codes are stable: tools and tests match on them. The registry below is the single list of every
code h3quant emits, with its default severity and a one-line rule; `h3quant validate --codes`
prints it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: Severity
    rule: str


_RULES: dict[str, Rule] = {}


def _r(code: str, name: str, severity: Severity, rule: str) -> None:
    _RULES[code] = Rule(code, name, severity, rule)


E, W, I = Severity.ERROR, Severity.WARNING, Severity.INFO  # noqa: E741 (I = info, as E and W)
# Naming rules (official / diffusers / fp8 inputs of convert): FORMATS.md 12.
_r("N301", "naming-mixed", E, "a checkpoint uses one naming: not both diffusers and ComfyUI names")
_r("N302", "qkv-missing", E, "split attention projections come as a complete to_q, to_k, to_v")
_r("N303", "qkv-partner-shape", E, "to_q, to_k, to_v share one dtype and shape; SwiGLU rows are even")
_r("N304", "qkv-heads", E, "a fused per-head qkv_proj has a q_norm whose width divides rows / 3")
_r("N305", "fp8-scale", E, "an fp8 weight's scale is F32/BF16/F16, one value per tensor or per row, "
   "finite and positive")
# Container (safetensors) rules: FORMATS.md 1.
_r("C101", "header-length", E, "the u64 header length is bounded (100 MB) and 8 + n fits in the file")
_r("C102", "header-utf8", E, "the header is valid UTF-8")
_r("C103", "header-json", E, "the header is a JSON object")
_r("C104", "tensor-entry", E, "each entry has dtype, shape (non-negative ints) and data_offsets")
_r("C105", "dtype-unknown", E, "each dtype is a safetensors dtype name")
_r("C106", "offsets-range", E, "each offset pair is 0 <= begin <= end <= buffer size")
_r("C107", "byte-length", E, "end - begin == numel * itemsize")
_r("C108", "offsets-overlap", E, "no two tensors share bytes")
_r("C109", "truncated", E, "the data buffer holds every tensor (a short file is a broken download)")
_r("C110", "metadata-type", E, "__metadata__ maps strings to strings")
_r("C111", "buffer-coverage", E, "tensors cover the data buffer with no gap and no trailing bytes")
_r("C112", "file-unreadable", E, "the file exists and can be read")
_r("C113", "header-padding", W, "the header is padded to a multiple of 8 bytes")
# Sharded checkpoints.
_r("S101", "index-json", E, "the shard index is JSON with a weight_map of tensor -> file")
_r("S102", "shard-missing", E, "every shard named by the index exists")
_r("S103", "index-tensor-missing", E, "every tensor named by the index is in its shard")
_r("S104", "tensor-duplicate", E, "no tensor is stored in two shards")
_r("S105", "index-unlisted", W, "every stored tensor is listed in the index")
_r("S106", "index-path-escape", E, "every shard the index names is a plain file name inside its "
   "directory (no path, no '..', no link leading out; in a Hugging Face cache, links into the "
   "same models--* folder's blobs)")
_r("S107", "index-wrong-shard", E, "every tensor is in the shard the index names for it")
_r("S108", "shard-unindexed", W, "every .safetensors file beside the index is named by it")
# Marker rules: FORMATS.md 2.
_r("M101", "marker-empty", E, "a .comfy_quant marker is not zero-length")
_r("M102", "marker-nul", E, "a marker holds no NUL bytes (all-NUL markers misdetect their encoding)")
_r("M103", "marker-json", E, "a marker is UTF-8 JSON")
_r("M104", "marker-not-object", E, "a marker's JSON is an object")
_r("M105", "format-missing", E, "a marker names its format")
_r("M106", "format-unknown", E, "the format is one ComfyUI knows")
_r("M107", "marker-dtype", E, "a marker is a 1-D U8 tensor")
_r("M108", "marker-orphan", E, "a marker belongs to a layer that has a weight")
_r("M109", "marker-missing", E, "a weight of a quantized dtype (I8/U8/F8) has a marker")
_r("M110", "marker-disagree", E, "header _quantization_metadata and the per-layer marker agree")
_r("M111", "header-metadata-json", E, "_quantization_metadata is JSON with a layers object")
_r("M112", "header-only-layer", E, "a layer in _quantization_metadata exists in the file")
_r("M113", "header-metadata-missing", W, "quantized layers are also described in the header metadata")
_r("M114", "marker-field", E, "marker fields have the right types and legal values")
_r("M115", "marker-noncanonical", I, "the marker bytes differ from the canonical ones h3quant writes")
_r("M116", "metadata-unread", I, "header metadata keys other than format, _quantization_metadata and "
   "h3quant.* are read by neither ComfyUI's loader nor h3quant (kept, ignored)")
# Scheme rules: FORMATS.md 3 and 4.
_r("Q101", "tensor-missing", E, "a layer has every tensor its format needs")
_r("Q102", "tensor-dtype", E, "each tensor of a quantized layer has the format's dtype")
_r("Q103", "tensor-shape", E, "each tensor of a quantized layer has the format's shape")
_r("Q104", "group-size", E, "ConvRot group sizes are powers of 4 that divide K")
_r("Q105", "unsupported-format", W, "the format is known but h3quant cannot convert or run it")
_r("Q106", "tensor-unexpected", W, "a quantized layer holds no tensors its format does not define")
_r("Q107", "correction-tensor", W, "weight_correction is not loaded by ComfyUI")
_r("Q108", "k-divisibility", E, "W4A8: group_size is >= 4 and divides 16 or is a multiple of 16; "
   "K is divisible by 16 and by group_size")
_r("Q109", "kn-scale-shape", E, "int8_tensorwise_kn: weight I8 [K, N] and weight_scale F32 [N] "
   "agree on N")
_r("Q110", "kn-nz-ineligible", I, "int8_tensorwise_kn: K % 16 == 0 and N % 32 == 0, else the NPU "
   "keeps the weight ND (no FRACTAL_NZ cast)")
_r("Q111", "kn-npu-n-limit", W, "int8_tensorwise_kn: N <= 65535 per rank (npu_quant_matmul's "
   "limit), else the layer needs tensor parallelism")
# Data rules (--deep).
_r("Q130", "mxfp8-shape", E, "mxfp8: weight dims are multiples of 32 and weight_scale is the "
   "blocked [roundup(N, 128), roundup(K/32, 4)] of that weight")
_r("Q131", "scaled-fp8-marker", W, "ComfyUI's legacy scaled_fp8 marker is present exactly when the "
   "file holds scale_weight fp8 layers (without it ComfyUI loads the codes unscaled)")
_r("Q120", "fp4-padded-shape", E, "nvfp4: the stored weight [Np, Kp/2] has Np and Kp multiples "
   "of 16 (the padded logical shape)")
_r("Q121", "int4-quant-group", E, "convrot_w4a4: K is a multiple of the int4 kernel's group size "
   "64, and quant_group_size (when present) is 64")
_r("Q122", "linear-dtype", E, "convrot_w4a4: linear_dtype is 'int4' or 'int8'")
_r("Q123", "awq-group", E, "awq_w4a16: group_size divides K; weight_scale and weight_zeros share "
   "one dtype")
_r("Q124", "svdquant-tensors", E, "svdquant_w4a4: the low-rank and smoothing tensors come in one "
   "spelling (weight_proj_down, weight_proj_up, weight_smooth_factor or proj_down, proj_up, "
   "smooth_factor), float, proj_down [K, R], proj_up [N, R], smooth_factor [K]")
_r("Q125", "svdquant-layout", E, "svdquant_w4a4: natural row-major storage, group size 64, K a "
   "multiple of 64 (a tile-packed file is not read)")
_r("Q126", "format-alias", I, "int4_tensorwise is another name for convrot_w4a4 (a ComfyUI fork's): "
   "read as convrot_w4a4, written under that name")
_r("Q127", "alias-unrotated", E, "int4_tensorwise is read as convrot_w4a4 only when its marker "
   "says convrot: true (convrot_w4a4 always rotates)")
_r("D101", "scale-nonfinite", E, "scales are finite")
_r("D102", "scale-nonpositive", E, "scales are positive")
_r("D103", "int8-range", W, "int8 codes stay in [-127, 127] (-128 is legal but never produced)")
_r("D104", "codebook", E, "a codebook has 16 sorted finite levels in [-1, 1]")
_r("D105", "marker-bytes", E, "marker bytes decode (deep re-read)")
_r("D106", "weight-nonfinite", E, "float weights are finite")
_r("D130", "fp8-code-nonfinite", E, "fp8 codes decode to finite values (no NaN / inf codes)")
_r("D131", "e8m0-scale-nan", E, "mxfp8 e8m0 block scales are not 0xFF (NaN)")
_r("D120", "block-scale-value", E, "nvfp4: e4m3 block scales are finite and >= 0, and a zero "
   "block scale covers only zero codes")
_r("D121", "block-scale-layout", E, "nvfp4: block scales are stored in cuBLAS's blocked 128 x 4 "
   "layout (zeros in its padding); a row-major grid decodes blocks with other blocks' scales")
_r("D122", "int4-range", W, "signed int4 codes stay in [-7, 7] (-8 is legal but never produced)")
_r("D107", "kn-orientation", E, "int8_tensorwise_kn: the [K, N] weight is not canonical [N, K] "
   "codes under the kn name (every row peaking at |q| = 127 while output channels do not; a "
   "square layer's shape cannot tell)")
# Topology rules: FORMATS.md 5.
_r("T101", "h3-tensor-missing", E, "every tensor of the detected H3 configuration is present")
_r("T102", "h3-tensor-shape", E, "H3 tensors have the shapes of the detected configuration")
_r("T103", "h3-tensor-extra", W, "no extra tensor of an H3 layer (a bias H3's layer lacks: ComfyUI "
   "ignores it, h3quant's forward would add it)")
_r("T104", "h3-not-detected", I, "the checkpoint is recognised as an H3 DiT")
_r("T105", "h3-quantized-unexpected", W, "only the block linears are quantized (a per-tensor "
   "float8 layer, as in ComfyUI's fp8_scaled releases, may be any linear)")
_r("T106", "h3-block-index-limit", E, "block indices stay below 1000 (H3 has 50)")
_r("T107", "h3-time-table-rows", I, "adaln_t_table has H3's 1025 rows; another count samples the same "
   "curve more or less densely, and the forward interpolates over the table's own rows")
_r("T108", "h3-tensor-ignored", I, "a tensor outside H3's layers is an unexpected key: ComfyUI's loader "
   "and h3quant's forward ignore it")
_r("T109", "h3-float-dtype", I, "float tensors are stored in H3's dtypes; another float dtype (F16, "
   "BF16, F32) loads: ComfyUI casts it into its module's dtype, h3quant computes with it (H3's "
   "fp32 parts in fp32)")
_r("T110", "h3-name-prefix", I, "tensor names carry no prefix; a full checkpoint's "
   "model.diffusion_model. is stripped on load")
# GGUF files (read through the gguf package): FORMATS.md, GGUF.
_r("G101", "gguf-header", E, "a GGUF file has the GGUF magic and a header the gguf package reads, with "
   "unique tensor names and shapes within the limits")
_r("G102", "gguf-type", E, "every tensor type is one the gguf package dequantizes")
_r("G103", "gguf-not-h3", W, "the tensors carry ComfyUI's H3 names (ComfyUI-GGUF's layout)")
_r("G104", "gguf-non-finite", E, "every tensor is finite once dequantized (validate --deep)")
# Calibration statistics ('h3quant capture'), validated as convert and plan read them.
_r("K101", "statistics-values", E, "a statistics file's names, shapes and values pass the rules "
   "convert --calibration and plan --calibration apply (finite values, mean |x| >= 0, each "
   "Hessian symmetric and a sum X^T X)")
# A check that could not run.
_r("X101", "check-failed", E, "every check ran to completion (an unexpected error stopped one; "
   "the input is malformed in a way h3quant does not anticipate)")
del E, W, I


def rule(code: str) -> Rule:
    return _RULES[code]


def all_rules() -> list[Rule]:
    return [_RULES[c] for c in sorted(_RULES)]


@dataclass(frozen=True)
class Finding:
    code: str
    message: str
    tensor: str | None = None
    file: str | None = None
    severity: Severity | None = None

    def __post_init__(self) -> None:
        if self.code not in _RULES:
            raise KeyError(f"unregistered finding code {self.code}")
        if self.severity is None:
            object.__setattr__(self, "severity", _RULES[self.code].severity)

    @property
    def level(self) -> Severity:
        """The severity: the one given, else the rule's (set at construction)."""
        return self.severity or _RULES[self.code].severity

    @property
    def name(self) -> str:
        return _RULES[self.code].name

    def to_dict(self) -> dict:
        d = asdict(self)
        d["severity"] = self.level.value
        d["name"] = self.name
        return d

    def __str__(self) -> str:
        where = f" {self.tensor}:" if self.tensor else ""
        return f"{self.level.value.upper():7s} {self.code} {self.name}{where} {self.message}"
