"""What happens on a confirmed detection: the response policy (``policy``), known-good
snapshots and checkpoints (``snapshot``; files in ``checkpoint_io``, sharded state's
directories in ``sharded_checkpoint``) and the lockstep of ranks (``distributed``).

``sdc_guard.policy`` and ``sdc_guard.snapshot`` are these modules under their former
names (``sdc_guard/__init__.py``).
"""
