"""What a run gives back while it trains: metrics kept on the device (``metrics``), evaluation
in the program's loop (``evaluation``), progress displays (``progress_displays``) and
``rt.progress`` (``progress``), what the loggers are told (``reporting``) and ``rt.profile``
(``profiling``).

This package's ``__init__`` imports nothing, so that importing one module loads only it.
"""
