"""Starting runs: layouts of roles and machines, and the local process launcher."""

from .launcher import Launcher, free_port, launch, launch_script
from .layout import SERVER, WORKER, Layout, ProcessSpec

__all__ = ["Layout", "ProcessSpec", "Launcher", "launch", "launch_script", "free_port",
           "WORKER", "SERVER"]
