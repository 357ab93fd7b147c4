"""The asynchronous regime: parameter servers, sync groups, DiLoCo, actor–learner, replay."""

from replicator.asynchronous.diloco import DiLoCo as DiLoCo
