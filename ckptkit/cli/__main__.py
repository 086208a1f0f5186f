"""``python -m ckptkit.cli``: the ``ckptkit`` command (also under torchrun)."""

from . import main

main()
