"""The runtime: transport, workers, weight versions, checkpoints and process launch."""
