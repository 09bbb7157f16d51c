"""``python -m h3quant``: the same CLI as the ``h3quant`` console script."""

from h3quant.cli import run

if __name__ == "__main__":
    run()
