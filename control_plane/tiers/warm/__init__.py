"""The warm tier: a host-DRAM directory that *is* Triton's ``--model-repository``.

Staging a model copies its folder from the cold store into this directory; Triton loads it
from here; unloading from the GPU leaves it here.  The directory has its own byte budget and
LRU order.  ``WarmTier`` implements the manager's ``Stager`` protocol:

* ``stage(name)`` returns the model's bytes once ``<repository>/<name>`` is complete, looking
  the artifact up in the registry (URI + sha256) and downloading it on a warm miss.
  Concurrent stages of one name share one download.
* ``set_busy(name, True)`` while a model is loaded or loading: such a model is never evicted
  from warm (``in_use`` is a second guard for models adopted from Triton at restart, which
  were never marked busy).
* ``known()`` lists every name that can be staged.

Why nothing half-written is ever visible to Triton: downloads land in a staging directory
on the repository's filesystem (``<repository>.staging``, or ``<repository>/.mms-staging``
when the repository is a mount point such as a docker volume), are verified against the
registry's sha256, and only then renamed into the repository in one ``rename``.  Evictions
rename the folder out first and delete it afterwards.  A crash leaves debris only in the staging
directory, which ``recover()`` empties at start; folders in the repository are re-checked
against the small manifest written next to the files (``.mms-warm.json``).

Folders in the repository that the registry does not know (a hand-made or demo model) are
served as they are, count against the budget and are never evicted: there is no cold copy
to bring them back from.

Budget note: under /dev/shm the warm tier shares tmpfs with Triton's python-backend
shared-memory regions; leave headroom beyond ``budget_bytes``.

Modules:
    location  tmpfs or on-disk repository, its staging folder, removing the tmpfs tier
    entries   WarmEntry and Download, what the tier records and shows
    tier      WarmTier: staging, the budget and LRU eviction, restart recovery, views
"""

from control_plane.tiers.warm.entries import Download, WarmEntry
from control_plane.tiers.warm.location import (
    STAGING_DIR_NAME,
    default_warm_repository,
    folder_bytes,
    remove_tmpfs_warm_tier,
    staging_dir_for,
    tmpfs_warm_root,
)
from control_plane.tiers.warm.tier import LARGE_DOWNLOAD_BYTES, WARM_MANIFEST, WarmTier

__all__ = [
    "LARGE_DOWNLOAD_BYTES",
    "STAGING_DIR_NAME",
    "WARM_MANIFEST",
    "Download",
    "WarmEntry",
    "WarmTier",
    "default_warm_repository",
    "folder_bytes",
    "remove_tmpfs_warm_tier",
    "staging_dir_for",
    "tmpfs_warm_root",
]
