"""One optimizer step and what it needs: the stepper (``stepper``: micro-batches, accumulation,
clipping), the out-of-memory retry (``retry``) with what a retried step restores
(``snapshot``), the non-finite guard (``nonfinite``), mixed precision (``precision``), checks
of the loss (``loss_checks``) and of class targets (``loss_targets``), and the points the step
calls around itself (``boundaries``).

This package's ``__init__`` imports nothing, so that importing one module loads only it.
"""
