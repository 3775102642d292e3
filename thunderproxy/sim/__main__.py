"""`python -m thunderproxy.sim`: the same as `thunderproxy sim`."""

from .cli import sim_command

sim_command(prog_name="thunderproxy sim")
