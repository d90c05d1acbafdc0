"""Probes: what this machine and this model do when timed (the planner prices from them).

:mod:`~bb_lightning.probe.measure` times the machine into a
:class:`~bb_lightning.planner.profile.HardwareProfile`;
:mod:`~bb_lightning.probe.calibrate` times the model's own training and generation
passes; :mod:`~bb_lightning.probe.contention` keeps the probes honest on a shared
machine. The planner is pure and imports none of this.
"""
