"""The runtime: executes each worker's action list with real tensors; the schedule decides the order.

:mod:`.launch` starts the workers (or joins torchrun) and :mod:`.dist` their process group,
:mod:`.job` drives one rank through its epochs, :mod:`.worker` runs its actions, :mod:`.transport`
moves tensors between stages, :mod:`.weights` picks the weight version each minibatch uses,
:mod:`.checkpoint` saves and resumes, and :mod:`.solo` replays one worker alone.
"""
