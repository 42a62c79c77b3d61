from gpukit.diagnostics.trace.core import Sync, Trace, Transfer, TransferKind, trace, untraced

__all__ = ["Sync", "Trace", "Transfer", "TransferKind", "trace", "untraced"]
