"""The Python API raises h3quant's own error types, with the CLI's messages, and a closed model
or checkpoint says so instead of failing inside torch or the file layer."""

import pytest
import torch
from click.testing import CliRunner

from h3quant.errors import ClosedError, ContainerError, DeviceError, H3QuantError, VerifyError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.pipelines.verify.blocks import verify_checkpoint
from h3quant.pipelines.verify.model import verify_model
from h3quant.pipelines.verify.tp import verify_tp
from h3quant.runtime.model.model import H3Model


@pytest.fixture(scope="module")
def files(tp_files):
    return tp_files


def _cli_error(*args) -> str:
    from h3quant.cli import main

    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    return r.output


def _absent(kind: str) -> bool:
    from h3quant.runtime.capabilities import live_probe

    return not live_probe().device_available(kind)


CALLS = {
    "H3Model.open": lambda f, d: H3Model.open(f["int8"], d),
    "verify_checkpoint": lambda f, d: verify_checkpoint(f["int8"], device=d, blocks=1, tokens=8),
    "verify_model": lambda f, d: verify_model(f["int8"], device=d, depth=1),
    "verify_tp": lambda f, d: verify_tp(f["int8"], tp=2, device=d, blocks=1, tokens=8),
}


@pytest.mark.parametrize("kind", ["cuda", "npu"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_unavailable_device_is_a_device_error_with_the_cli_message(files, kind, call):
    if not _absent(kind):
        pytest.skip(f"this machine has a {kind} device")  # the check needs one it lacks
    with pytest.raises(DeviceError) as err:
        CALLS[call](files, kind)
    out = _cli_error("verify", str(files["int8"]), "--device", kind)
    assert err.value.reason in out  # word for word what the CLI prints
    assert f"no {kind} device is available on this machine" in err.value.reason


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_malformed_device_is_a_device_error_with_the_cli_message(files, call):
    with pytest.raises(DeviceError) as err:
        CALLS[call](files, "gpu:0")
    assert err.value.reason in _cli_error("verify", str(files["int8"]), "--device", "gpu:0")


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_missing_file_is_an_h3quant_error_with_the_cli_message(files, tmp_path, call):
    missing = {k: tmp_path / "absent.safetensors" for k in ("int8",)}
    with pytest.raises(H3QuantError) as err:
        CALLS[call](missing, "cpu")
    assert isinstance(err.value, (ContainerError, VerifyError))
    out = _cli_error("verify", str(missing["int8"]), "--device", "cpu")
    assert str(err.value) in out, (str(err.value), out)


def test_bad_options_are_h3quant_errors(files):
    with pytest.raises(VerifyError, match="linear must be one of"):
        H3Model.open(files["int8"], linear="fast")
    with pytest.raises(VerifyError, match="tokens must be a positive integer"):
        verify_checkpoint(files["int8"], device="cpu", tokens=0)
    with pytest.raises(VerifyError, match="tokens must be a positive integer"):
        verify_tp(files["int8"], tp=2, device="cpu", tokens=0)
    with pytest.raises(H3QuantError, match="tensor-parallel degree must be a positive integer"):
        verify_tp(files["int8"], tp=0, device="cpu")
    with pytest.raises(H3QuantError, match="--tp N is required"):
        verify_tp(files["int8"], tp=None, device="cpu")


def _inputs(m):
    return (torch.zeros(1, m.video_channels, 1, 2, 2), torch.zeros(1, m.audio_channels, 2, 2),
            torch.zeros(1, 4, m.text_dim))


def test_a_closed_model_raises_a_closed_error(files):
    m = H3Model.open(files["int8"])
    state = m.start(*_inputs(m), 0.5)
    m.close()
    m.close()  # twice is harmless
    assert m.closed
    for use in (lambda: m(*_inputs(m), 0.5), lambda: m.start(*_inputs(m), 0.5),
                lambda: m.run_block(state, 0), lambda: m.load_block(0, torch.float32),
                lambda: m.finish(state)):
        with pytest.raises(ClosedError, match="this H3Model was closed"):
            use()
    with H3Model.open(files["int8"]) as m2:
        pass
    with pytest.raises(ClosedError):
        m2(*_inputs(m2), 0.5)


def test_a_closed_checkpoint_raises_a_closed_error(files):
    ckpt = Checkpoint(files["int8"])
    name = next(iter(ckpt.tensors))
    ckpt.close()
    with pytest.raises(ClosedError, match=f"this checkpoint was closed; open it again to read "
                                          f"'{name}'"):
        ckpt.read(name)
    with pytest.raises(ClosedError):  # a model over a checkpoint its caller closed
        H3Model(ckpt)
