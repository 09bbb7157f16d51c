"""``H3Model``: the whole H3 forward (FORMATS.md 5.1) streamed block by block from a checkpoint.

    model = H3Model.open("h3_int8_convrot.safetensors", device="cpu")
    video, audio = model(video_latent, audio_latent, text_states, sigma)

    # a few-step checkpoint whose output heads are a bank: the step of the sampler's schedule
    sigmas = shifted_schedule(8)                  # or the sampler's own sigmas
    video, audio = model(video_latent, audio_latent, text_states, sigmas=sigmas, step=3)

``H3Model.head_bank`` says how many heads the file stacks; with one head ``sigmas`` / ``step``
change nothing, with a bank the call needs the schedule (``schedule`` explains the rule).

Only the small tensors stay resident (patch embeddings, condition projection, time embedding,
RoPE frequencies, final layer). The token refiner blocks and the DiT blocks are loaded one at a
time when they run; the next block's byte ranges are handed to the kernel's read-ahead
(``madvise(WILLNEED)``, mmap mode) while the current one computes, and a finished block's pages
are released (``madvise(DONTNEED)``), so memory stays flat in the number of blocks.

``linear="runtime"`` runs every quantized linear through the device's dispatch (int8 on the
device's int8 path, W4A8 decoded to its int8 grid, dequantized where the device needs it);
``linear="reference"`` runs the float math of the same weights (``DequantLinear``) - the
reference of a verify run without a float checkpoint. Float tensors keep their stored dtypes;
the compute dtype is the dtype of ``text_states``, as in the reference implementation.

For a verifier the call is split into ``start`` (embeddings, refiner, conditioning),
``run_block`` (one block) and ``finish`` (final layer, un-patchify, negation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from h3quant.errors import ClosedError, VerifyError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.formats.layers import scan_checkpoint
from h3quant.runtime.model.block import (
    Conditioning,
    build_block,
    quantized_linear,
    reference_linear,
    self_attention,
    torch_device,
)
from h3quant.runtime.loader import block_indices, find_prefix, load_prefix
from h3quant.runtime.model.embed import (
    FinalLayer,
    TimeEmbedding,
    pack_audio,
    patchify_video,
    unpack_audio,
    unpatchify_video,
)
from h3quant.runtime.model.layout import PackedLayout, Timesteps
from h3quant.runtime.model.ops import RopeTable, rms_norm, rope_angles
from h3quant.runtime.model.schedule import HeadSpan, check_schedule, head_span, model_sigma

LINEAR_KINDS = ("runtime", "reference")


def read_float(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A float tensor of the checkpoint (VerifyError naming it when missing or not float)."""
    info = ckpt.tensors.get(name)
    if info is None:
        raise VerifyError("tensor missing (the H3 forward needs it)", path=ckpt.path, tensor=name)
    if info.dtype not in FLOAT_DTYPES:
        raise VerifyError(f"tensor is {info.dtype}; the H3 forward needs it in float",
                          path=ckpt.path, tensor=name)
    return ckpt.read(name)


def stored_dtypes(tensors: dict, prefix: str = "") -> dict[str, torch.dtype]:
    """The torch dtype H3 keeps each float tensor in (``h3.topology``), for the tensors of the
    detected configuration; empty when the configuration is not recognised."""
    from h3quant.formats.container.dtypes import to_torch
    from h3quant.h3.topology import detect, expected_tensors

    det = detect(tensors)
    if det is None:
        return {}
    return {n: to_torch(d) for n, (d, _) in expected_tensors(det.config, prefix).items()}


def load_time_embedding(ckpt: Checkpoint, prefix: str = "") -> TimeEmbedding:
    """The curve table (pruned form) or the time embedder (full form) of the checkpoint."""
    if prefix + "adaln_t_table" in ckpt.tensors:
        return TimeEmbedding(table=read_float(ckpt, prefix + "adaln_t_table"))
    te = prefix + "time_embedder."
    if te + "proj_in.weight" not in ckpt.tensors:
        raise VerifyError("neither adaln_t_table nor time_embedder.*: the checkpoint has no time "
                          "embedding", path=ckpt.path, tensor=prefix + "adaln_t_table")
    return TimeEmbedding(proj_in=(read_float(ckpt, te + "proj_in.weight"),
                                  read_float(ckpt, te + "proj_in.bias")),
                         proj_out=(read_float(ckpt, te + "proj_out.weight"),
                                   read_float(ckpt, te + "proj_out.bias")))


def make_conditioning(layout: PackedLayout, ts: Timesteps, time_emb: TimeEmbedding,
                      inv_freq: torch.Tensor, dtype: torch.dtype, device,
                      segments=None) -> Conditioning:
    """The per-call inputs every block shares (time embeddings, adaLN rows, RoPE tables)."""
    t_emb = time_emb(ts.values, device=device)
    adaln_dtype = torch.float32 if time_emb.curve else dtype
    pos = layout.positions.to(torch.float32).to(device)  # fp32 positions, as the reference
    rope = RopeTable.from_angles(rope_angles(pos, inv_freq.to(device)), dtype)
    return Conditioning(t_emb.to(adaln_dtype), segments or layout.mod_segments(ts), rope,
                        adaln_silu=not time_emb.curve, adaln_dtype=adaln_dtype)


@dataclass
class ModelState:
    """One call in progress: the packed hidden state and what the blocks share."""

    x: torch.Tensor  # [S, hidden], compute dtype, on the device
    cond: Conditioning
    layout: PackedLayout
    timesteps: Timesteps
    video_shape: tuple[int, ...]
    video_dtype: torch.dtype
    audio_dtype: torch.dtype
    done: list[int] = field(default_factory=list)  # block indices run so far
    head: HeadSpan | None = None  # the step's heads of a bank (None: a single head)


class H3Model:
    """The H3 forward over a checkpoint; see the module docstring."""

    def __init__(self, ckpt: Checkpoint, *, device="cpu", linear: str = "runtime",
                 backend: str | None = None, probe=None, owns: bool = False):
        from h3quant.runtime.availability import require_device

        if linear not in LINEAR_KINDS:
            raise VerifyError(f"linear must be one of {LINEAR_KINDS}, got {linear!r}")
        self.ckpt, self._owns, self._closed = ckpt, owns, False
        self.path = str(ckpt.path)
        # a string is checked like the CLI's --device: malformed or absent -> DeviceError
        self.device = require_device(device, probe=probe) if isinstance(device, str) else device
        self.tdev = torch_device(self.device)
        self.linear, self.backend, self.probe = linear, backend, probe
        self.scan = scan_checkpoint(ckpt)
        self.prefix = p = find_prefix(ckpt.tensors)
        self.blocks = block_indices(ckpt, p)
        if not self.blocks:
            raise VerifyError("no blocks.{i} tensors: not an H3 DiT checkpoint", path=ckpt.path)
        gaps = sorted(set(range(self.blocks[-1] + 1)) - set(self.blocks))
        if gaps:
            raise VerifyError(f"blocks {gaps[:10]} are missing; the forward needs blocks "
                              f"0..{self.blocks[-1]}", path=ckpt.path)
        self.refiner = sorted({int(n.split(".")[2 + p.count(".")]) for n in ckpt.tensors
                               if n.startswith(p + "token_refiner.blocks.")})

        wide = {n for n, d in stored_dtypes(ckpt.tensors, p).items() if d == torch.float32}

        def f(name):  # a tensor H3 keeps in F32 (its fp32 parts) read as F32 when stored
            x = read_float(ckpt, p + name)  # narrower: widened exactly, as ComfyUI's load casts
            return x.to(self.tdev, dtype=torch.float32 if p + name in wide else x.dtype)

        self.video_proj = (f("video_patch_proj.weight"), f("video_patch_proj.bias"))
        self.audio_proj = (f("audio_patch_proj.weight"), f("audio_patch_proj.bias"))
        self.hidden = int(self.video_proj[0].shape[0])
        self.condition_proj = (f("condition_proj.weight"), f("condition_proj.bias"))
        self.final_norm = f("token_refiner.final_norm.weight") if self.refiner else None
        self.inv_freq = f("rope.inv_freq")
        self.time_emb = load_time_embedding(ckpt, p)
        vp, ap = int(self.video_proj[0].shape[1]), int(self.audio_proj[0].shape[1])
        self.final = FinalLayer(f("final_layer.norm.weight"),
                                f("final_layer.adaln_proj.linear.weight"),
                                f("final_layer.adaln_proj.linear.bias"),
                                (f("final_layer.video_out.weight"), f("final_layer.video_out.bias")),
                                (f("final_layer.audio_out.weight"), f("final_layer.audio_out.bias")),
                                vp, ap)
        if vp % 4:
            raise VerifyError(f"video_patch_proj takes {vp} inputs: not channels x 1x2x2",
                              path=ckpt.path, tensor=p + "video_patch_proj.weight")
        self.video_channels, self.audio_channels = vp // 4, ap
        self.head_bank = self.final.bank  # checks the two heads stack alike
        self.text_dim = int(self.condition_proj[0].shape[1])

    @classmethod
    def open(cls, path: str | os.PathLike, device="cpu", *, mmap: bool = True,
             linear: str = "runtime", backend: str | None = None, probe=None,
             any_layout: bool = False) -> "H3Model":
        """Open a checkpoint (file, shard index or directory) for the forward on ``device``.
        ``any_layout``: a float source or reference in any layout ``convert`` takes (official,
        diffusers, fp8), read as ComfyUI's single file (``h3quant.sources``)."""
        if any_layout:
            from h3quant.sources import open_as_comfy

            ckpt = open_as_comfy(path, mmap=mmap)
        else:
            from h3quant.sources import open_source

            ckpt = open_source(path, mmap=mmap)  # a GGUF file: read in place
        try:
            return cls(ckpt, device=device, linear=linear, backend=backend, probe=probe,
                       owns=True)
        except BaseException:
            ckpt.close()
            raise

    def close(self) -> None:
        """Release the checkpoint (when the model opened it); any later use raises
        ``ClosedError``. Closing twice is harmless."""
        if self._owns and not self._closed:
            self.ckpt.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this H3Model was closed; open the checkpoint again "
                              "(H3Model.open) to run it", path=self.path)

    def __enter__(self) -> "H3Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- streaming
    def _names(self, prefix: str) -> list[str]:
        return [n for n in self.ckpt.tensors if n.startswith(prefix + ".")]

    def _advise(self, prefix: str, how: str) -> None:
        for n in self._names(prefix):
            getattr(self.ckpt.file_of(n), how)(self.ckpt.info(n))

    def _make_linear(self, dtype: torch.dtype):
        if self.linear == "reference":
            return lambda lay: reference_linear(lay, device=self.tdev)
        return lambda lay: quantized_linear(lay, device=self.device, backend=self.backend,
                                            probe=self.probe, compute_dtype=dtype)

    def load_block(self, index: int, dtype: torch.dtype):
        """Build block ``index`` (its tensors read now) and prefetch the next one."""
        self._check_open()
        prefix = f"{self.prefix}blocks.{index}"
        loaded = load_prefix(self.ckpt, self.scan, prefix, index)
        if index + 1 in self.blocks:
            self._advise(f"{self.prefix}blocks.{index + 1}", "prefetch")
        return build_block(loaded, self._make_linear(dtype), device=self.tdev)

    def release_block(self, index: int) -> None:
        self._advise(f"{self.prefix}blocks.{index}", "release_pages")

    # -------------------------------------------------------------------------------- forward
    def _check_inputs(self, video, audio, text) -> None:
        def bad(what, t, want):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise VerifyError(f"{what} must be {want}, got {got}")

        if not isinstance(video, torch.Tensor) or video.dim() != 5 or video.shape[0] != 1 \
                or video.shape[1] != self.video_channels or 0 in video.shape:
            bad("video latent", video, f"[1, {self.video_channels}, T, H, W]")
        if not isinstance(audio, torch.Tensor) or audio.dim() != 4 or audio.shape[0] != 1 \
                or audio.shape[1] != self.audio_channels or audio.shape[2] != 2 \
                or audio.shape[3] == 0:
            bad("audio latent", audio, f"[1, {self.audio_channels}, 2, Ta]")
        if not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[0] != 1 \
                or text.shape[2] not in (self.text_dim, self.hidden) or text.shape[1] == 0:
            bad("text states", text, f"[1, L, {self.text_dim}] (or [1, L, {self.hidden}], "
                "already refined)")
        for name, t in (("video", video), ("audio", audio), ("text", text)):
            if not t.is_floating_point():
                raise VerifyError(f"{name} input must be a float tensor, got {t.dtype}")

    def embed_text(self, text: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[L, hidden]: condition_proj -> refiner blocks -> final_norm (skipped when the text
        width already equals hidden)."""
        self._check_open()
        x = text[0].to(device=self.tdev, dtype=dtype)
        if x.shape[-1] == self.hidden:
            return x
        w, b = self.condition_proj
        from h3quant.runtime.model.block import FloatLinear
        x = FloatLinear(w, b)(x)
        make = self._make_linear(dtype)
        for j in self.refiner:
            prefix = f"{self.prefix}token_refiner.blocks.{j}"
            blk = load_prefix(self.ckpt, self.scan, prefix, j)
            lin = {n: make(blk.linear(n)) for n in ("attn.qkv_proj", "attn.out_proj",
                                                    "mlp.fc1", "mlp.fc2")}
            norm = {k: blk.param(k).to(self.tdev) for k in ("norm1.weight", "norm2.weight",
                                                            "attn.q_norm.weight",
                                                            "attn.k_norm.weight")}
            head_dim = int(norm["attn.q_norm.weight"].shape[0])
            x = x + self_attention(rms_norm(x, norm["norm1.weight"]), lin["attn.qkv_proj"],
                                   lin["attn.out_proj"], norm["attn.q_norm.weight"],
                                   norm["attn.k_norm.weight"], head_dim, None)
            x = x + lin["mlp.fc2"](lin["mlp.fc1"](rms_norm(x, norm["norm2.weight"])),
                                   input_act="swiglu").to(dtype)
            del blk, lin
            self._advise(prefix, "release_pages")
        return rms_norm(x, self.final_norm) if self.final_norm is not None else x

    def text_tensors(self) -> list[str]:
        """Names of the tensors the text path reads (condition_proj, refiner, final_norm)."""
        p = self.prefix
        return sorted(n for n in self.ckpt.tensors
                      if n.startswith((p + "condition_proj.", p + "token_refiner.")))

    def step_sigma(self, sigma: float | None, sigmas=None, step: int | None = None) -> float:
        """The sigma of a call: ``sigma``, or ``sigmas[step]`` (they must agree when both are
        given)."""
        if step is None:
            if sigma is None:
                raise VerifyError("give sigma, or sigmas and step")
            return sigma
        if sigmas is None:
            raise VerifyError("step needs the schedule (sigmas=...)")
        sched = check_schedule(sigmas)
        if not isinstance(step, int) or not 0 <= step < len(sched) - 1:
            raise VerifyError(f"step must be in 0..{len(sched) - 2} for a schedule of "
                              f"{len(sched) - 1} steps, got {step!r}")
        if sigma is not None and float(sigma) != sched[step]:
            raise VerifyError(f"sigma {sigma} is not sigmas[{step}] = {sched[step]}")
        return sched[step]

    def head_for(self, sigma: float, sigmas=None) -> HeadSpan | None:
        """The heads of the bank the step at ``sigma`` uses (None for a single head)."""
        if self.head_bank == 1:
            return None
        if sigmas is None:
            raise VerifyError(f"final_layer.video_out / audio_out hold a bank of "
                              f"{self.head_bank} heads: the forward needs the sampler's sigma "
                              "schedule (sigmas=...)", path=self.path,
                              tensor=self.prefix + "final_layer.video_out.weight")
        return head_span(self.head_bank, sigma, sigmas)

    def start(self, video, audio, text, sigma: float, *, text_embed=None,
              sigmas=None) -> ModelState:
        """Embeddings, text refiner and conditioning: the state before block 0.
        ``text_embed``: the [L, hidden] refined text already computed (e.g. by another model
        with identical float text tensors and the same device and dtype). ``sigmas``: the
        sampler's schedule (needed by a bank of output heads)."""
        self._check_open()
        self._check_inputs(video, audio, text)
        Timesteps.from_sigma(sigma)  # checks the sampler's sigma (0 < sigma <= 1)
        ts = Timesteps.from_sigma(model_sigma(sigma))  # the sigma as the model sees it
        head = self.head_for(sigma, sigmas)
        dtype = text.dtype
        with torch.no_grad():
            rows, (t, h, w) = patchify_video(video)
            layout = PackedLayout.t2va(int(text.shape[1]), t, h, w, int(audio.shape[3]))
            self._advise(f"{self.prefix}blocks.{self.blocks[0]}", "prefetch")
            txt = self.embed_text(text, dtype) if text_embed is None \
                else text_embed.to(device=self.tdev, dtype=dtype)
            v = torch.nn.functional.linear(rows.to(self.tdev), *self.video_proj).to(dtype)
            a = torch.nn.functional.linear(pack_audio(audio).to(self.tdev),
                                           *self.audio_proj).to(dtype)
            x = torch.cat((txt, a, v), dim=0)
            cond = make_conditioning(layout, ts, self.time_emb, self.inv_freq, dtype, self.tdev)
        return ModelState(x, cond, layout, ts, tuple(video.shape), video.dtype, audio.dtype,
                          head=head)

    def run_block(self, state: ModelState, index: int) -> torch.Tensor:
        """Run block ``index`` on the state (loads it, prefetches the next, releases it)."""
        with torch.no_grad():
            block = self.load_block(index, state.x.dtype)
            state.x = block(state.x, state.cond)
        del block
        self.release_block(index)
        state.done.append(index)
        return state.x

    def finish(self, state: ModelState):
        """Final layer, un-patchify, negation: (video [1, C, T, H, W], audio [1, C, 2, Ta])."""
        self._check_open()
        lay, ts = state.layout, state.timesteps
        va, vb = lay.span("video")
        aa, ab = lay.span("audio")
        with torch.no_grad():
            v, a = self.final(state.x, state.cond.t_emb, (va, vb, ts.index(ts.video)),
                              (aa, ab, ts.index(ts.audio)), state.cond.adaln_silu,
                              state.cond.adaln_dtype, state.head)
            video = unpatchify_video(v, lay.frames, lay.height, lay.width, self.video_channels)
            _, _, t, h, w = state.video_shape
            video = video[:, :, :t, :h, :w]
            audio = unpack_audio(a)
        return -video.to(state.video_dtype), -audio.to(state.audio_dtype)

    def __call__(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor,
                 sigma: float | None = None, *, sigmas=None, step: int | None = None,
                 depth: int | None = None, on_block=None):
        """The denoiser output ``(video, audio)`` (negated predictions, input shapes and dtypes).
        ``sigmas`` / ``step``: the sampler's schedule and the step (its sigma is
        ``sigmas[step]``); a bank of output heads needs them. ``depth``: run only the first N
        blocks (then the final layer). ``on_block(i, x)`` is called after each block with its
        hidden state."""
        self._check_open()
        sigma = self.step_sigma(sigma, sigmas, step)
        state = self.start(video, audio, text, sigma, sigmas=sigmas)
        for i in self.blocks[:depth] if depth is not None else self.blocks:
            self.run_block(state, i)
            if on_block is not None:
                on_block(i, state.x)
        return self.finish(state)
