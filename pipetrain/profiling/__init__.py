"""Per-layer profiles: the data and its JSON form (:mod:`.profile`), the profiler that measures a model
(:mod:`.profiler`) and the reader of PipeDream's published profiles (:mod:`.graph`)."""
from pipetrain.profiling.profile import LayerProfile, Profile, ProfileError
from pipetrain.profiling.profiler import as_minibatch, profile_model, time_batching

__all__ = ["LayerProfile", "Profile", "ProfileError", "as_minibatch", "profile_model", "time_batching"]
