"""Test aids: faithful SIMULATIONS of hardware this project cannot run on (Ascend NPU, Apple MPS).

Nothing in the production packages (``formats``, ``convrot``, ``runtime``, ``pipelines``, ``cli``)
imports this package. The simulations rename torch's spare device slot and patch
``torch.version.cuda`` while they are active, which production code must never do by import; the
tests (and benchmark scripts) enter them explicitly as context managers.
"""
