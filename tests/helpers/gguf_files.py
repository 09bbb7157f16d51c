"""GGUF files for the tests, written with the gguf package's own writer and quantizers, and a
Q4_K encoder / decoder written here from the format's published block layout (the package
dequantizes K-quants but cannot quantize them)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def q4k_encode(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> Q4_K blocks (uint8 [N, K / 256 * 144]).

    One block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins (kept
    below 16 here, so only the low bits are used), 128 bytes of 4-bit codes: each 32-byte
    chunk holds sub-block 2i in its low nibbles and 2i+1 in its high nibbles. A value is
    ``d * sc_j * q - dmin * m_j``."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = blocks.max(axis=2)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=1) / 15.0).astype(np.float16)
    dmin = (mins.max(axis=1) / 15.0).astype(np.float16)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, df[:, None], out=np.zeros_like(scale),
                                    where=df[:, None] > 0)), 0, 15).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dmf[:, None], out=np.zeros_like(mins),
                                   where=dmf[:, None] > 0)), 0, 15).astype(np.uint8)
    step = df[:, None] * sc.astype(np.float32)
    off = dmf[:, None] * m.astype(np.float32)
    q = np.divide(blocks + off[:, :, None], step[:, :, None], out=np.zeros_like(blocks),
                  where=step[:, :, None] > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)  # [B, 8, 32]
    scales = np.zeros((q.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4]
    scales[:, 4:8] = m[:, 0:4]
    scales[:, 8:12] = sc[:, 4:8] | (m[:, 4:8] << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(q.shape[0], 128)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                          scales, qs], axis=1)
    return out.reshape(n, k // QK_K * 144)


def q4k_decode(raw: np.ndarray, shape) -> np.ndarray:
    """The values of ``q4k_encode``'s blocks (the same layout read back, written here)."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    s = b[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, s[:, 8:12] & 15], axis=1).astype(np.float32)
    m = np.concatenate([s[:, 4:8] & 63, s[:, 8:12] >> 4], axis=1).astype(np.float32)
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    vals = (d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * m)[:, :, None]
    return vals.reshape(shape)


def write_gguf(tensors: dict, dst, qtype: str, *, prefix: str = "", arch: str = "minimax_h3",
               block_linear=lambda name: ".blocks." in "." + name and name.endswith(
                   ("attn.qkv_proj.weight", "attn.out_proj.weight", "mlp.fc1.weight",
                    "mlp.fc2.weight")) and "token_refiner" not in name) -> None:
    """A GGUF file of torch ``tensors``: the DiT block linear weights in ``qtype`` (Q8_0 and
    Q4_0 by the gguf package's quantizer, Q4_K by ``q4k_encode``), the rest F32."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(dst), arch)
    for name in sorted(tensors):
        a = tensors[name].float().numpy()
        if block_linear(name):
            t = getattr(gguf.GGMLQuantizationType, qtype)
            raw = q4k_encode(a) if qtype == "Q4_K" else quantize(a, t)
            w.add_tensor(prefix + name, raw, raw_dtype=t)
        else:
            w.add_tensor(prefix + name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
