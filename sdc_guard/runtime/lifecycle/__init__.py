"""The guard's lifecycle and accounts: ``protect()`` / ``Guard`` (``guard``), its configuration
(``config``, ``checks``), its interception on a thread (``interception``), what the
interception hands it (``intake``), the step's accounts (``ledger``, ``stats``), the
calibration replays (``calibration``), the driven optimizer step (``guarded_step``,
``optimizer_steps``) and the warn-once rule of monitoring failures (``warn_once``).
"""
