"""Synthetic tiny H3 files for the tensor-parallel tests, made once per test run."""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=1)
def tp_files() -> dict[str, Path]:
    """tiny preset, 1 block: BF16 source, int8 ConvRot (canonical and kn layouts) and W4A8."""
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    d = Path(tempfile.mkdtemp(prefix="h3q-tp-"))
    atexit.register(shutil.rmtree, d, True)
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1)
    out = {"dir": d, "bf16": bf16}
    for key, target in (("int8", "int8-convrot"), ("w4a8", "w4a8")):
        out[key] = d / f"{key}.safetensors"
        convert(bf16, out[key], ConvertOptions(target=target, report=False))
    out["kn"] = d / "kn.safetensors"  # the NPU layout: int8 weights stored [K, N]
    convert(out["int8"], out["kn"], ConvertOptions(layout="npu", report=False))
    return out
