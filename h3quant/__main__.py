"""``python -m h3quant``: the same CLI as the ``h3quant`` console script."""

from h3quant.cli import main

if __name__ == "__main__":
    main(prog_name="h3quant")
