"""The runtime: transport, workers, weight versions, checkpoints, process launch, and one worker run alone (solo)."""
