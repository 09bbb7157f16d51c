"""``verify --tp N``: run blocks tensor-parallel over N ranks and compare them with one device.

Every rank builds its shard of each chosen block (reading only its own bytes) and runs it on
seeded inputs; rank 0 then runs the single-device reference and compares (bit-identical in the
``shared`` scale mode, within ``PER_RANK_TOLERANCE`` in ``per-rank``: docs/verify.md).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from h3quant.errors import VerifyError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.platform import max_rss_bytes
from h3quant.formats.layers import scan_checkpoint
from h3quant.pipelines.verify import blocks as verify
from h3quant.pipelines.metrics import error_metrics
from h3quant.pipelines.verify.result import Verdict
from h3quant.pipelines.verify.tp_reference import precheck_reference, reference_verdict
from h3quant.runtime.loader import BLOCK_LINEARS, block_indices, find_prefix
from h3quant.runtime.tp.group import DEFAULT_TIMEOUT_S, LocalCollectives
from h3quant.runtime.tp.env import launched_by_torchrun
from h3quant.runtime.tp.launch import plan_launch, rank_setup_probe
from h3quant.runtime.tp.plan import COLUMN_PARALLEL, SCALE_MODES, TpError, check_world
from h3quant.runtime.tp.runner import (
    assemble_columns,
    held_bytes,
    row_input_slice,
    shard_block,
    swiglu_input_slice,
)

if TYPE_CHECKING:
    from h3quant.runtime.devices import Device

PER_RANK_TOLERANCE = 0.05


def _small_model_inputs():
    from h3quant.pipelines.verify.model import ModelInputs

    return ModelInputs(frames=2, height=4, width=4, audio_frames=4, text_tokens=8)


@dataclass
class TpCheck:
    """One output compared with the single-device run (``what``: a layer path or ``block``)."""

    block: int
    what: str  # "attn.qkv_proj", "mlp.fc2 [swiglu]", "block"
    parallel: str  # column, row, block
    strategy: str  # split, regroup, -
    backend: str
    identical: bool
    max_abs: float
    rel_l2: float
    limit: str
    passed: bool


@dataclass
class RankStats:
    rank: int
    bytes_read: int
    bytes_held: int
    peak_rss: int


@dataclass
class TpResult(Verdict):
    path: str
    device: str
    backend: str
    tp: int
    scale_mode: str
    blocks: list[int]
    tokens: int
    seed: int
    launched: str  # spawn or torchrun
    checks: list[TpCheck] = field(default_factory=list)
    ranks: list[RankStats] = field(default_factory=list)
    linear_bytes: int = 0  # bytes of the chosen blocks' linears in the file
    reference_vs_runtime: float = 0.0  # rel L2 of the tp=1 reference vs the runtime's block
    notes: list[str] = field(default_factory=list)
    # --reference: the single-device verify against the float checkpoint (pipelines.verify.
    # tp_reference); its failures are this result's too
    reference: Any = None

    @property
    def failures(self) -> list[str]:
        own = [f"block {c.block} {c.what}: " + (f"max |diff| {c.max_abs:.3g}" if
               self.scale_mode == "shared" else f"rel L2 {c.rel_l2:.4g}") + f" (limit {c.limit})"
               for c in self.checks if not c.passed]
        ref = [f"vs the float reference: {f}" for f in self.reference.failures] \
            if self.reference is not None else []
        return own + ref

    def to_dict(self) -> dict:
        body = asdict(self)
        body["reference"] = None if self.reference is None else self.reference.to_dict()
        return self.verdict_dict(body)


@dataclass(frozen=True)
class TpSpec:
    """Everything a rank needs (picklable for the spawn start method)."""

    path: str
    blocks: int | list[int] | None
    tokens: int
    seed: int
    mode: str
    mmap: bool
    backend: str | None = None  # runtime backend forced for the local layers
    sigma: float = 0.6  # the noise level of the block conditioning (verify's default)
    model: bool = False  # the whole forward (every block) instead of per-block checks
    model_inputs: object = None  # pipelines.verify.model.ModelInputs (None: a small default)
    depth: int | None = None  # --model: only the first N blocks
    rank_setup: Any = None  # tests: rank_setup(ctx) -> context manager giving (probe, device)


# ------------------------------------------------------------------------------ inputs


def layer_input(block: int, salt: int, tokens: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + block * 16 + salt)
    return torch.randn(tokens, width, generator=g)


def block_inputs(ckpt: Checkpoint, root: str, hidden: int, tokens: int, seed: int, sigma: float,
                 dtype: torch.dtype, tdev):
    """Seeded hidden states [tokens, hidden] in ``dtype`` and the real conditioning of a small
    t2va layout of ``tokens`` rows at ``sigma`` (the file's time embedding and RoPE), on tdev."""
    from h3quant.runtime.model.layout import Timesteps, layout_for_rows
    from h3quant.runtime.model.model import (
        load_time_embedding,
        make_conditioning,
        read_float,
    )

    cond = make_conditioning(layout_for_rows(tokens), Timesteps.from_sigma(sigma),
                             load_time_embedding(ckpt, root), read_float(ckpt, root + "rope.inv_freq"),
                             dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype).to(tdev), cond.to(tdev)


# ------------------------------------------------------------------------------ one rank


def _run_layers(block, info, comm, tokens: int, seed: int, dtype, tdev, inputs) -> dict:
    """Full outputs of every block linear and of the block on seeded inputs (every rank calls
    it; the collectives need all of them)."""
    world, rank = comm.world, comm.rank
    outs = {}
    mods = block.linears()
    with torch.no_grad():
        for salt, role in enumerate(BLOCK_LINEARS):
            shape = info.shapes[role]
            x = layer_input(info.index, salt, tokens, shape.in_features, seed).to(dtype)
            lin = mods[role]
            if role in COLUMN_PARALLEL:
                y = lin(x.to(tdev)).float()  # gathered on the device (nccl carries no CPU tensor)
                y = assemble_columns([p.cpu() for p in comm.all_gather(y, f"{role} outputs")],
                                     COLUMN_PARALLEL[role])
                outs[role] = y
                continue
            outs[role] = lin(row_input_slice(x, role, world, rank).to(tdev)).float().cpu()
            if role == "mlp.fc2":
                x2 = layer_input(info.index, 8 + salt, tokens, 2 * shape.in_features,
                                 seed).to(dtype)
                xs = swiglu_input_slice(x2, world, rank).to(tdev)
                outs[role + " [swiglu]"] = lin(xs, input_act="swiglu").float().cpu()
        outs["block"] = block(*inputs).float().cpu()
    return outs


def _device(ctx_device: str, probe):
    from h3quant.runtime.devices import parse_device

    return parse_device(ctx_device, probe=probe)


def rank_main(ctx, spec: TpSpec):
    """Body of every rank; rank 0 returns the TpResult."""
    with rank_setup_probe(ctx, spec.rank_setup) as probe:
        return _rank_body(ctx, spec, probe)


def _rank_body(ctx, spec: TpSpec, probe):
    from h3quant.runtime.capabilities import live_probe

    probe = probe or live_probe()
    dev = _device(ctx.device, probe)
    tdev = dev.torch_device
    dtype = dev.compute_dtype
    comm = ctx.comm
    if spec.model:
        return _rank_model(ctx, spec, probe, dev, dtype)
    kept, infos, read, held = {}, {}, 0, 0
    with Checkpoint(spec.path, mmap=spec.mmap) as ckpt:
        scan = scan_checkpoint(ckpt)
        root = find_prefix(ckpt.tensors)
        idx = verify.choose_blocks(spec.blocks, block_indices(ckpt, root), spec.path)
        for i in idx:
            block, info = shard_block(ckpt, scan, f"{root}blocks.{i}", i, comm, mode=spec.mode,
                                      device=dev, probe=probe, backend=spec.backend,
                                      compute_dtype=dtype)
            read += info.bytes_read
            held = max(held, held_bytes(block))
            inputs = block_inputs(ckpt, root, block.hidden, spec.tokens, spec.seed + i,
                                  spec.sigma, dtype, tdev)
            outs = _run_layers(block, info, comm, spec.tokens, spec.seed, dtype, tdev, inputs)
            backends = {r: str(getattr(m, "backend_name", "?")) for r, m in block.linears().items()}
            if ctx.rank == 0:
                kept[i] = outs
                infos[i] = (info, backends)
            del block
            gc.collect()
        rss = _peak_rss()
        stats = torch.tensor([read, held, rss], dtype=torch.int64, device=tdev)
        every = [t.cpu() for t in comm.all_gather(stats, "per-rank memory figures")]
        if ctx.rank != 0:
            return None
        result = TpResult(spec.path, str(dev), ctx.backend, ctx.world, spec.mode, idx,
                          spec.tokens, spec.seed, "torchrun" if launched_by_torchrun() else "spawn")
        result.ranks = [RankStats(r, *(int(v) for v in t.tolist())) for r, t in enumerate(every)]
        for i in idx:
            info, backends = infos[i]
            result.linear_bytes += info.bytes_total
            result.notes.extend(f"block {i}: {n}" for n in info.notes)
            ref, runtime_diff = _reference(ckpt, scan, root, i, spec, dev, probe, dtype, tdev)
            result.reference_vs_runtime = max(result.reference_vs_runtime, runtime_diff)
            _compare(result, i, info, backends, kept.pop(i), ref)
    result.notes.append("reference: the same blocks on one device (tp=1, no collectives); "
                        f"its rel L2 difference from the runtime's plain single-device block: "
                        f"{result.reference_vs_runtime:.3g}" + ("" if dev.kind == "cpu" else
                        " (the runtime's device op rounds its output to the activation dtype "
                        "inside; the tp path sums int32 and scales in fp32)"))
    return result


def _rank_model(ctx, spec: TpSpec, probe, dev, dtype):
    """``--model``: the whole forward with sharded blocks on every rank; rank 0 then runs the
    runtime's single-device H3Model on the same inputs and compares every block's hidden state
    and the final video / audio outputs."""
    from h3quant.pipelines.verify.model import ModelInputs
    from h3quant.runtime.model.model import H3Model
    from h3quant.runtime.tp.model import TpH3Model

    comm = ctx.comm
    mi = spec.model_inputs or _small_model_inputs()
    if not isinstance(mi, ModelInputs):
        raise TpError(f"model inputs must be a ModelInputs, got {type(mi).__name__}")
    sigma = mi.sigma
    with Checkpoint(spec.path, mmap=spec.mmap) as ckpt:
        model = TpH3Model(ckpt, device=dev, comm=comm, mode=spec.mode, backend=spec.backend,
                          probe=probe)
        video, audio, text = (t.to(dtype) for t in mi.tensors(model.video_channels,
                                                               model.audio_channels, model.text_dim))
        hidden: dict[int, torch.Tensor] = {}
        outputs = model(video, audio, text, sigma, depth=spec.depth,
                        on_block=lambda i, x: hidden.__setitem__(i, x.float().cpu()))
        infos, held = model.infos, model.held
        stats = torch.tensor([sum(i.bytes_read for i in infos), held, _peak_rss()],
                             dtype=torch.int64, device=dev.torch_device)
        every = [t.cpu() for t in comm.all_gather(stats, "per-rank memory figures")]
        if ctx.rank != 0:
            return None
        outs = {**{f"block {i} hidden": h for i, h in hidden.items()},
                **_final(outputs)}
        del model
        gc.collect()
        ref_model = H3Model(ckpt, device=dev, backend=spec.backend, probe=probe)
        ref_hidden: dict[int, torch.Tensor] = {}
        ref_out = ref_model(video, audio, text, sigma, depth=spec.depth,
                            on_block=lambda i, x: ref_hidden.__setitem__(i, x.float().cpu()))
        ref = {**{f"block {i} hidden": h for i, h in ref_hidden.items()}, **_final(ref_out)}
    idx = [i.index for i in infos]
    result = TpResult(spec.path, str(dev), ctx.backend, ctx.world, spec.mode, idx, 0, spec.seed,
                      "torchrun" if launched_by_torchrun() else "spawn")
    result.ranks = [RankStats(r, *(int(v) for v in t.tolist())) for r, t in enumerate(every)]
    result.linear_bytes = sum(i.bytes_total for i in infos)
    for info in infos[:1]:
        result.notes.extend(f"every block: {n}" for n in info.notes)
    for what, y in outs.items():
        _append_check(result, -1 if what in ("video", "audio") else int(what.split()[1]),
                      what, "model", "-", "-", y, ref[what])
    result.notes.append("reference: the runtime's single-device H3Model forward on the same "
                        f"inputs ({mi}); 'held' is the largest block's shard")
    return result


def _final(outputs) -> dict:
    """The video / audio outputs of a full forward (none with ``depth``: the final layer is
    then skipped)."""
    if not isinstance(outputs, tuple) or len(outputs) != 2:
        return {}
    video, audio = outputs
    return {"video": video.float().cpu(), "audio": audio.float().cpu()}


def _reference(ckpt, scan, root, i, spec, dev, probe, dtype, tdev):
    """Outputs of block ``i`` on one device, and the relative L2 difference of that block's
    output from the runtime's ordinary single-device block."""
    from h3quant.runtime.model.block import runtime_block
    from h3quant.runtime.loader import load_blocks

    comm = LocalCollectives()
    block, info = shard_block(ckpt, scan, f"{root}blocks.{i}", i, comm, mode="shared",
                              device=dev, probe=probe, backend=spec.backend, compute_dtype=dtype)
    inputs = block_inputs(ckpt, root, block.hidden, spec.tokens, spec.seed + i, spec.sigma,
                          dtype, tdev)
    outs = _run_layers(block, info, comm, spec.tokens, spec.seed, dtype, tdev, inputs)
    del block
    plain = runtime_block(load_blocks(ckpt, [i], scan=scan)[0], device=dev, backend=spec.backend,
                          probe=probe, compute_dtype=dtype)
    with torch.no_grad():
        y = plain(*inputs).float().cpu()
    del plain
    gc.collect()
    return outs, float(error_metrics(outs["block"], y)[0])


def _compare(result: TpResult, i: int, info, backends, outs: dict, ref: dict) -> None:
    for what, y in outs.items():
        r = ref[what]
        role = what.split(" ")[0]
        if what == "block":
            parallel, strategy, backend = "block", "-", "-"
        elif role in COLUMN_PARALLEL:
            parallel, strategy, backend = "column", "split", backends[role]
        else:
            parallel, strategy = "row", info.plan.rows[role].strategy
            backend = backends[role]
        _append_check(result, i, what, parallel, strategy, backend, y, r)


def _append_check(result: TpResult, i: int, what: str, parallel: str, strategy: str,
                  backend: str, y: torch.Tensor, r: torch.Tensor) -> None:
    identical = bool(torch.equal(y, r))
    diff = (y - r).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = error_metrics(y, r)[0]
    if result.scale_mode == "shared":
        limit, passed = "0 (bit-identical)", identical
    else:
        limit, passed = f"rel L2 <= {PER_RANK_TOLERANCE}", rel <= PER_RANK_TOLERANCE
    result.checks.append(TpCheck(i, what, parallel, strategy, backend, identical, max_abs, rel,
                                 limit, passed))


def _peak_rss() -> int:
    return max_rss_bytes() or 0  # 0 where the platform does not say (Windows)


# ------------------------------------------------------------------------------ entry point


def verify_tp(path, *, tp: int | None, scale_mode: str = "shared", device: str | Device = "cpu",
              blocks=None, tokens: int = 16, seed: int = 0, mmap: bool = True,
              timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
              start_method: str | None = None, dist_backend: str | None = None,
              comm_cls=None, rank_setup=None, sigma: float = 0.6,
              model: bool = False, model_inputs=None, depth: int | None = None,
              reference=None, thresholds=None) -> TpResult | None:
    """Run the check with ``tp`` ranks: joins torchrun's group when launched by torchrun
    (``h3quant.runtime.tp.env``; ``tp`` must equal its WORLD_SIZE), else spawns ``tp`` local
    ranks. ``device``: cpu, cuda or npu (ranks use
    ``<kind>:<local_rank>``). ``dist_backend``/``comm_cls``/``rank_setup``: tests and
    simulations (default: the device's backend and plain collectives). ``reference``: a float
    checkpoint; rank 0 then also runs the single-device verify against it (``thresholds``: its
    per-block ``Thresholds``) and the result holds both verdicts (``tp_reference``)."""
    from h3quant.runtime.tp.group import Collectives

    if scale_mode not in SCALE_MODES:
        raise TpError(f"--tp-scale must be one of {', '.join(SCALE_MODES)}, got {scale_mode!r}")
    if not isinstance(tokens, int) or tokens < 1:
        raise VerifyError(f"tokens must be a positive integer, got {tokens!r}")
    if timeout_s <= 0:
        raise TpError(f"--tp-timeout must be > 0 seconds, got {timeout_s}")
    # N, torchrun's variables, the device (the CLI's --device message), its backend and device
    # count: checked before any file is read (a simulated device comes with rank_setup)
    launch = plan_launch(tp, device, backend=dist_backend)
    _precheck(path, tp, None if model else blocks, mmap)
    if reference is not None:
        precheck_reference(reference, mmap)
    spec = TpSpec(str(path), blocks, tokens, seed, scale_mode, mmap, backend=backend,
                  sigma=sigma, rank_setup=rank_setup, model=model,
                  model_inputs=model_inputs, depth=depth)
    res = launch.run(rank_main, (spec,), backend=dist_backend, timeout_s=timeout_s,
                     start_method=start_method, comm_cls=comm_cls or Collectives)
    if res is not None and reference is not None:  # rank 0 (or the parent), the group gone
        res.reference = reference_verdict(
            path, reference, device=device, blocks=res.blocks, tokens=tokens, seed=seed,
            sigma=sigma, mmap=mmap, backend=backend, model=model,
            model_inputs=model_inputs or _small_model_inputs(), depth=depth,
            thresholds=thresholds)
    return res


def _precheck(path, tp, blocks, mmap) -> None:
    """Fail in the parent, before any rank starts, on what the header alone can tell: a bad
    file, missing blocks, a tp degree that does not divide the heads or widths."""
    from h3quant.runtime.tp.plan import plan_block
    from h3quant.runtime.tp.runner import block_layers, head_dim_of
    from h3quant.runtime.tp.shard_load import layer_shape

    with Checkpoint(path, mmap=mmap) as ckpt:
        scan = scan_checkpoint(ckpt)
        root = find_prefix(ckpt.tensors)
        idx = verify.choose_blocks(blocks, block_indices(ckpt, root), path)
        if tp is None:
            return
        check_world(tp)
        for i in idx:
            prefix = f"{root}blocks.{i}"
            layers = block_layers(scan, prefix)
            missing = [r for r in BLOCK_LINEARS if r not in layers]
            if missing:
                raise TpError(f"block linear missing: {', '.join(missing)}", tensor=prefix)
            shapes = {r: layer_shape(layers[r], r) for r in BLOCK_LINEARS}
            try:
                plan_block(shapes, head_dim_of(layers, prefix), tp, 0)
            except TpError as exc:
                raise TpError(exc.reason, path=path, tensor=exc.tensor and
                              f"{prefix}.{exc.tensor}") from None
