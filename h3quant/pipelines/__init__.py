"""Pipelines: plain functions returning dataclasses with ``to_dict()``; the CLI renders them."""

from h3quant.pipelines.headers.inspect import InspectResult, inspect_checkpoint
from h3quant.pipelines.headers.validate import ValidateResult, validate_checkpoint

__all__ = ["InspectResult", "ValidateResult", "inspect_checkpoint", "validate_checkpoint"]
