"""tqmon: observability sidecar for verl V1 async training's TransferQueue prefetch window."""

__version__ = "0.1.0"
