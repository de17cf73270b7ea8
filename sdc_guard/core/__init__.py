"""The V-ABFT math: the screen (``abft``, ``passes``, ``segments``, ``precision``,
``comp_row``, ``batching``), the exact confirmation (``confirm``), the one-call API
(``verify``) and the baseline checksum it replaces (``legacy``).

Nothing is imported here: ``sdc_guard.backends`` and ``sdc_guard.runtime`` import these
modules, and ``verify`` imports ``sdc_guard.backends``.
"""
