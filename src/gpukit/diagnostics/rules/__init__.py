"""The patterns behind readable errors, one module per family of failures: ``cuda`` (asserts,
cuDNN, missing kernels, an old driver), ``devices`` (tensors on different devices) and
``distributed`` (NCCL and gloo). ``gpukit.diagnostics.readable`` tries them in order."""
