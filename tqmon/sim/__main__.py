"""``python -m tqmon.sim``."""

from tqmon.sim.cli import sim

sim(prog_name="python -m tqmon.sim")
