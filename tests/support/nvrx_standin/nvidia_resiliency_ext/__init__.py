"""A stand-in for nvidia-resiliency-ext, which cannot run here (its rank monitor is a
process ``ft_launcher`` starts beside each rank): only the client side the fleet recipe
calls, following its documented contract (``fault_tolerance.RankMonitorClient``,
``WorkloadAction``, ``WorkloadControlRequest``), recording each call so that a test can
read what the rank monitor and the launcher would have received."""
