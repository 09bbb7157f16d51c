"""One codec object per on-disk layer format (see ``h3quant.formats.codecs.registry``)."""
