"""Starting a job: `replicator launch`'s launcher, its local processes, and whole-job restarts."""

# `_environment` and `_register_rendezvous` are private: re-exported for the security tests,
# which ask torchrun's own code what a launch would listen on.
from replicator.launch.launcher import HEAP_KEPT, heap_kept_environment, launch
from replicator.launch.launcher import _environment as _environment
from replicator.launch.recovery import Outcome, current_attempt, run_attempts
from replicator.launch.spawn import LOOPBACK_RENDEZVOUS, free_port, torchrun_arguments
from replicator.launch.spawn import _register_rendezvous as _register_rendezvous
from replicator.launch.spec import LaunchSpec

__all__ = [
    "LaunchSpec",
    "launch",
    "free_port",
    "heap_kept_environment",
    "HEAP_KEPT",
    "torchrun_arguments",
    "LOOPBACK_RENDEZVOUS",
    "Outcome",
    "run_attempts",
    "current_attempt",
]
