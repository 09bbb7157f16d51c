"""An independent, plainly written float H3 forward for the tests (FORMATS.md 5.1).

It shares no code with h3quant.runtime: a dict of tensors in, fp32 math, torch's own
``F.rms_norm`` / ``F.scaled_dot_product_attention``, complex-number RoPE, per-row index gathers
for the adaLN rows, and explicit loops for the patch order. Slow; for tiny shapes only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-5


def _norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w.float(), EPS)


def timesteps(sigma):
    # the sampler hands the model timestep = fp32(sigma) * 1000; the model divides back (fp32)
    s = float(((torch.tensor([float(sigma)], dtype=torch.float32) * 1000) / 1000).clamp(min=1e-6))
    u = s / (12.0 + s * (1 - 12.0))
    shifted = 3.0 * u / (1 + 2.0 * u)
    tv, ta = 1 - s, 1 - shifted
    return tv, ta, sorted({tv, ta})


def time_embedding(src, values):
    """[M, t] fp32 and whether adaLN takes SiLU (full form)."""
    if "adaln_t_table" in src:
        tab = src["adaln_t_table"].float()
        out = []
        for t in values:
            p = min(max(t, 0.0), 1.0) * (tab.shape[0] - 1)
            i = min(int(math.floor(p)), tab.shape[0] - 2)
            f = p - i
            out.append(tab[i] * (1 - f) + tab[i + 1] * f)
        return torch.stack(out), False
    w_in = src["time_embedder.proj_in.weight"].float()
    n = w_in.shape[1] // 2
    emb = []
    for t in values:
        fr = torch.tensor([math.exp(-math.log(10000.0) * i / n) for i in range(n)])
        emb.append(torch.cat([torch.cos(t * fr), torch.sin(t * fr)]))
    h = F.linear(torch.stack(emb), w_in, src["time_embedder.proj_in.bias"].float())
    h = F.linear(F.silu(h), src["time_embedder.proj_out.weight"].float(),
                 src["time_embedder.proj_out.bias"].float())
    return h, True


def positions(L, T, H, W, Ta):
    """[S, 3] (t, h, w) of text | audio | video rows."""
    area = math.sqrt(H * W)

    def axis(n):
        r = n / area
        return [((1 - r) / 2 + i * r / (n // 2)) * 32 for i in range(n // 2)]

    hs, ws = axis(H), axis(W)
    rows = [(float(j), 0.0, 0.0) for j in range(L)]
    for c in range(2):
        rows += [(float(L + f), 0.0, ws[0] if c == 0 else ws[-1]) for f in range(Ta)]
    t0 = float(L)
    for f in range(T):
        rows += [(t0, hh, ww) for hh in hs for ww in ws]
        t0 += 5.0 / 3.0 * (1, 4, 4, 4, 4)[f % 5]
    return torch.tensor(rows, dtype=torch.float64)


def rope(x, pos, inv_freq):
    """x [S, H, 128]: pairs (i, i+48) of dims 0..95 rotated via complex multiplication."""
    ang = torch.cat([pos[:, a:a + 1].float() * inv_freq.float()[None] for a in range(3)], dim=1)
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]  # [S, 1, 48]
    z = torch.complex(x[..., :48], x[..., 48:96]) * rot
    return torch.cat([z.real, z.imag, x[..., 96:]], dim=-1)


def attn(p, x, hd, pos=None, inv_freq=None):
    S = x.shape[0]
    q, k, v = F.linear(x, p("attn.qkv_proj.weight")).chunk(3, -1)
    q = _norm(q.reshape(S, -1, hd), p("attn.q_norm.weight"))
    k = _norm(k.reshape(S, -1, hd), p("attn.k_norm.weight"))
    v = v.reshape(S, -1, hd)
    if pos is not None:
        q, k = rope(q, pos, inv_freq), rope(k, pos, inv_freq)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return F.linear(o.transpose(0, 1).reshape(S, -1), p("attn.out_proj.weight"))


def mlp(p, x):
    g, u = F.linear(x, p("mlp.fc1.weight")).chunk(2, -1)
    return F.linear(F.silu(g) * u, p("mlp.fc2.weight"))


def dit_block(src, i, x, temb, silu, row_of_token, pos):
    p = lambda k: src[f"blocks.{i}.{k}"].float()  # noqa: E731
    hd = p("attn.q_norm.weight").shape[0]
    hidden = x.shape[1]
    t = F.silu(temb) if silu else temb
    mod = F.linear(t, p("adaln_proj.linear.weight"), p("adaln_proj.linear.bias"))
    mod = mod.reshape(-1, 3, 6, hidden).reshape(-1, 6, hidden)[row_of_token]  # [S, 6, hidden]
    sh1, sc1, g1, sh2, sc2, g2 = mod.unbind(1)
    x = x + g1 * attn(p, _norm(x, p("norm1.weight")) * (1 + sc1) + sh1, hd, pos,
                      src["rope.inv_freq"])
    return x + g2 * mlp(p, _norm(x, p("norm2.weight")) * (1 + sc2) + sh2)


def forward(src, video, audio, text, sigma, depth=None, hidden_states=None):
    """(video, audio) outputs of the H3 forward in fp32; ``hidden_states`` collects the hidden
    state after each block."""
    src = {k: v for k, v in src.items()}
    _, C, T, H, W = video.shape
    Ta, L = audio.shape[-1], text.shape[1]
    hidden = src["video_patch_proj.weight"].shape[0]
    vrows = []
    for f in range(T):
        for hh in range(H // 2):
            for ww in range(W // 2):
                vrows.append(video[0, :, f, 2 * hh:2 * hh + 2, 2 * ww:2 * ww + 2].reshape(-1))
    vrows = torch.stack(vrows).float()
    arows = torch.cat([audio[0, :, 0, :].t(), audio[0, :, 1, :].t()]).float()
    txt = text[0].float()
    if txt.shape[1] != hidden:
        txt = F.linear(txt, src["condition_proj.weight"].float(), src["condition_proj.bias"].float())
        j = 0
        while f"token_refiner.blocks.{j}.norm1.weight" in src:
            p = lambda k, j=j: src[f"token_refiner.blocks.{j}.{k}"].float()  # noqa: E731
            txt = txt + attn(p, _norm(txt, p("norm1.weight")), p("attn.q_norm.weight").shape[0])
            txt = txt + mlp(p, _norm(txt, p("norm2.weight")))
            j += 1
        txt = _norm(txt, src["token_refiner.final_norm.weight"])
    v = F.linear(vrows, src["video_patch_proj.weight"].float(), src["video_patch_proj.bias"].float())
    a = F.linear(arows, src["audio_patch_proj.weight"].float(), src["audio_patch_proj.bias"].float())
    x = torch.cat([txt, a, v])
    tv, ta, values = timesteps(sigma)
    temb, silu = time_embedding(src, values)
    iv, ia = values.index(tv), values.index(ta)
    row = torch.tensor([3 * iv + 1] * L + [3 * ia + 2] * (2 * Ta) + [3 * iv] * len(vrows))
    pos = positions(L, T, H, W, Ta)
    i = 0
    while f"blocks.{i}.norm1.weight" in src and (depth is None or i < depth):
        x = dit_block(src, i, x, temb, silu, row, pos)
        if hidden_states is not None:
            hidden_states.append(x.clone())
        i += 1
    t = F.silu(temb) if silu else temb
    shift, scale = F.linear(t, src["final_layer.adaln_proj.linear.weight"].float(),
                            src["final_layer.adaln_proj.linear.bias"].float()).chunk(2, -1)
    nv, nf = 2 * Ta + L, src["video_patch_proj.weight"].shape[1]
    hv = _norm(x[nv:], src["final_layer.norm.weight"]) * (1 + scale[iv]) + shift[iv]
    ha = _norm(x[L:nv], src["final_layer.norm.weight"]) * (1 + scale[ia]) + shift[ia]
    ov = F.linear(hv, src["final_layer.video_out.weight"][:nf].float(),
                  src["final_layer.video_out.bias"][:nf].float())
    oa = F.linear(ha, src["final_layer.audio_out.weight"].float(),
                  src["final_layer.audio_out.bias"].float())
    vid = torch.zeros(1, C, T, H, W)
    n = 0
    for f in range(T):
        for hh in range(H // 2):
            for ww in range(W // 2):
                vid[0, :, f, 2 * hh:2 * hh + 2, 2 * ww:2 * ww + 2] = ov[n].reshape(C, 2, 2)
                n += 1
    aud = torch.stack([oa[:Ta].t(), oa[Ta:].t()], dim=1)[None]
    return -vid, -aud
