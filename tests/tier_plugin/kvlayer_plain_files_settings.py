"""The ``plainfiles`` test tier's settings, declared through the ``kvlayer.tier_settings`` entry point.

Light on purpose (it imports only ``kvlayer.tier_settings``): every kvlayer config loads it.
One setting, ``root``: the folder of the chunk files, written ``tiers: {plainfiles: {root: DIR}}``
or ``plainfiles_root: DIR``; unset, the tier is off and its backend module is never imported.
"""

from __future__ import annotations

from kvlayer.tier_settings import Setting, TierSettings

SETTINGS = TierSettings((Setting("root", "str | None", None, "folder of the chunk files; unset = off"),),
                        enabled=lambda section: section["root"] is not None)
