"""Parameter servers and sync groups (rp.ParameterServers): servers, workers, their links, shards and checkpoints."""
