"""The whole H3 forward (FORMATS.md 5.1): ops, packed layout and positions, embeddings, and the
streaming model ``H3Model`` (imported lazily: ``from h3quant.runtime.model import H3Model``)."""


def __getattr__(name: str):
    if name in ("H3Model", "ModelState"):
        from h3quant.runtime.model import model

        return getattr(model, name)
    raise AttributeError(f"module 'h3quant.runtime.model' has no attribute {name!r}")
