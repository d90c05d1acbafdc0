"""Probes: what this machine and this model do when timed (the planner prices from them).

:func:`measure` times the machine into a
:class:`~bb_lightning.planner.profile.HardwareProfile` (:mod:`bb_lightning.probe.measure`,
cached per machine); :func:`model_profile_from_config` and
:func:`model_profile_from_module` find a model's
:class:`~bb_lightning.planner.profile.ModelProfile` by introspection
(:mod:`bb_lightning.probe.model`); :mod:`bb_lightning.probe.calibrate` times the model's
own training and generation passes; :mod:`bb_lightning.probe.contention` keeps the
probes honest on a shared machine. The planner is pure data and imports none of this
(see ``docs/architecture.md``, "Layers").
"""

from bb_lightning.probe.measure import measure
from bb_lightning.probe.model import model_profile_from_config, model_profile_from_module

__all__ = ["measure", "model_profile_from_config", "model_profile_from_module"]
