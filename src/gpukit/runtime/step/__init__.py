"""One optimizer step and what it needs: the stepper (``stepper``: micro-batches, accumulation,
clipping), the out-of-memory retry (``retry``) with what a retried step restores
(``snapshot``), the non-finite guard (``nonfinite``), mixed precision (``precision``), checks
of the loss (``loss_checks``) and of class targets (``loss_targets``), the points the step
calls around itself (``boundaries``), optimizers built before setup stepping the parameters it
put in place (``optimizer_adoption``), and what the step reads from the run and advances in it
(``live``: protocols the Runtime's settings and state meet, so the step never imports them).

This package's ``__init__`` imports nothing, so that importing one module loads only it.
"""
