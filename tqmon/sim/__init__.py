"""A simulated verl 0.9.1 V1 async trainer on a real TransferQueue, with named preemption/resume scenarios.

``python -m tqmon.sim --scenario doomed-mix --workdir /tmp/run`` writes ``/tmp/run/trainer.log`` (verl's
log lines) and ``/tmp/run/checkpoints`` (verl's layout), the inputs ``tqmon serve`` reads.
"""
