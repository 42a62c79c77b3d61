"""The ``gpukit`` command line: one module per subcommand, registered in ``__main__``."""
