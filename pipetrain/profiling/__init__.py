"""Per-layer profiles: the data (:mod:`.profile`), the profiler that measures a model (:mod:`.profiler`)
and the reader of PipeDream's published profiles (:mod:`.graph`)."""
from pipetrain.profiling.profile import (LayerProfile, Profile, ProfileError, _field, as_minibatch, check_header,
                                         parse_json, profile_model, read_text, time_batching)

__all__ = ["LayerProfile", "Profile", "ProfileError", "_field", "as_minibatch", "check_header", "parse_json",
           "profile_model", "read_text", "time_batching"]
