"""The command front-ends behind ``dapo-mcore`` (``cli.py`` dispatches to them): ``config``, ``plan``, ``data check``
and the ``--nproc-per-node`` launcher. Each parses its own arguments and calls down into the library."""
