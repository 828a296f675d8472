"""The model manager: the only writer of what is loaded on which Triton server.

Concurrency model (plain asyncio, one event loop):

* ``ensure(model)`` on a loaded model is a dictionary lookup plus a recency touch: no
  remote call.  On a miss, one load task per model exists at a time; late callers await it
  (``asyncio.shield`` so a cancelled caller does not cancel the load for the others).
* Placement and reservation happen under ``_lock`` with no ``await`` in between, so two
  loads can never both claim the same free bytes or the same victim.  The Triton calls
  themselves (unload victims, load, warm-up) run outside the lock, so loads of different
  models overlap.
* Memory of an evicted model is counted as used until Triton's repository index shows it
  UNAVAILABLE (unload returns before the stub exits and frees its memory).
* Every failure undoes exactly what was reserved before it; a model whose load or warm-up
  failed is unloaded again and left ``failed`` with the reason.
* A model whose unload failed keeps its server and its room (``failed``, ``server`` set):
  it is never loaded on another server until the first one confirms it gone, and the
  retries back off.
* A pin wins over an unload that has not started; one under way is awaited, then the
  model is loaded again.  Each reconcile pass (``step``) loads pinned models that are
  not loaded.
* Warm-up follows the model: Triton runs a config's ``model_warmup`` during the load;
  otherwise one synthetic request, unless the model or the registry turned it off.

Eviction off the critical path (a miss should cost one load, not an unload and a load):

* Headroom.  Each server keeps room for the next miss free (``ManagerConfig.headroom_models``
  / ``headroom_bytes``; by default one model's room where at least 8 fit, see
  ``eviction.HeadroomSpec``).  When a load takes it, the policy's next victim is unloaded
  in the background at once (``reason="headroom"``), with the usual rules: never a pinned
  model, never one a request holds or that is loading, lowest rollout stage first.  A
  serving model's miss may use the headroom; a shadow may not.
* Two counts per server.  *Committed* room leaves out the models being unloaded (their room
  is promised): placement plans victims on it, so two misses close together never evict
  two models for the room of one.  *Held* room is what Triton holds: loaded, loading, and
  unloading until its index shows the model UNAVAILABLE.  A load is sent to Triton only
  when held room plus the newcomer fits the budget: the budget is enforced on what
  Triton confirms.
* One exception, overlap: when the measured free memory of the server's device
  (``free_memory(server)``: MemAvailable on CPU, a GPU's free memory where a hook gives
  it) holds the newcomer plus ``overlap_margin_bytes``, on top of every load already sent
  and not finished on that device (each counted at its size plus the margin), the load
  starts while its victims are still shutting down.  What is measured is never
  over-committed, and the counts stay honest: the victims stay counted until Triton
  confirms them gone (``mmctl fleet`` may show the server over its budget meanwhile), and
  no other load can count on that room.  A victim whose unload then fails keeps its room
  (``unload_failed``); the newcomer stays loaded and the reconcile evicts down to the budget.
  Without a probe (unit tests, attached Tritons) nothing overlaps.

Model families (``records.SlotPool``): one cache per server.  A variant in its family's slot
is an entry like a model's, with its slot's bytes and one place of ``--max-loaded``; the
family model's record is a ``ModelBook.pools`` entry per server, moved like a model's, that
costs nothing itself.  One policy orders every entry: a miss of any kind evicts the least
recently used evictable entry of any kind; a family with no variant left is unloaded
(``Unloader.unload_empty_families``).  ``residency.py`` derives the planner entries;
``eviction.planner`` plans them.

Layout: records.py (records, server specs, configuration), room.py (held room, the
overlap rule, the host's free memory), fleet_state.py (``ManagerState``: what the parts share),
residency.py (the planner's view of each copy, derived from its record),
one module per part (known_models.py, recency.py, executor.py with warmup.py, unloader.py,
loader.py, copies.py, pins.py, reconciler.py with health.py, leases.py), and
model_manager.py, where ``ModelManager`` builds the parts and gives each the parts it calls:

    catalog, recency          <- state only
    executor                  <- state only (carries loads, replaces and unloads out)
    unloader                  <- executor (decides what leaves, and when)
    loader                    <- catalog, recency, unloader, executor
    copies                    <- catalog, loader, executor
    pins                      <- catalog, loader
    reconciler                <- catalog, recency, unloader, pins, copies (owns health)
    leases                    <- catalog, recency, loader, and the reconciler's
                                 check_reachable and place_off_down

A server's health (up, suspect, down) has one writer, ``health.Health``: probes every
second per server, down after three missed in a row (a frozen Triton within ~4 s).
"""
