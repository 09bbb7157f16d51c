"""``verify``: run a checkpoint's layers on a device's int8 path against a float reference, per block
(``blocks``), as the whole streamed model (``model``) or tensor-parallel (``tp``)."""
